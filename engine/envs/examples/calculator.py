"""A calculator tool for multiplication: the model is asked ``What is A * B?``; it may
call ``multiply`` (``<tool_call>{"name": "multiply", "arguments": {"a": A, "b": B}}
</tool_call>``, one line), gets the product back as a ``tool`` message and then answers.

Reward: 1 for the exact product, 0 otherwise. The default model was trained to call the
tool on only some of these questions and to guess the product itself on the rest (it
cannot multiply), so what RL learns is to use the tool.
"""

from __future__ import annotations

import json
from typing import Any, Final

__all__ = ["TOOL_NAME", "question", "tool_call_text"]

TOOL_NAME: Final = "multiply"
TOOL_CALL_OPEN: Final = "<tool_call>"
TOOL_CALL_CLOSE: Final = "</tool_call>"


def question(a: int, b: int) -> str:
    """The user message."""
    return f"What is {a} * {b}?"


def tool_call_text(a: int, b: int) -> str:
    """The assistant message that calls the tool, in the format the default model knows."""
    call: dict[str, Any] = {"name": TOOL_NAME, "arguments": {"a": a, "b": b}}
    return f"{TOOL_CALL_OPEN}{json.dumps(call)}{TOOL_CALL_CLOSE}"
