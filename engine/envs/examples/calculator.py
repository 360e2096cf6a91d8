"""A calculator tool for multiplication: the model is asked ``What is A * B?``; it may
call ``multiply`` (``<tool_call>{"name": "multiply", "arguments": {"a": A, "b": B}}
</tool_call>``, the Hermes format), reads the product back as a ``tool`` message and
then answers.

Reward: 1 for the exact product, 0 otherwise. The agent model was trained to call the
tool on only some of these questions and to guess the product itself on the rest (it
cannot multiply), so what RL learns is to use the tool. Episodes run 1 turn (a direct
answer) or 2 (a call, then the answer); ``tool_latency`` (seconds) makes the tool slow.

Run: ``python -m engine.run --local --task engine.envs.examples.calculator:CalculatorTask``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Final

import anyio

from engine.basemodels.catalogue import AGENT_MODEL_DIR
from engine.core.problems import Problem, SeededSource
from engine.envs.examples.stops import stop_at_eos
from engine.envs.messages import ChatGroup, MessageStep
from engine.envs.tools import FunctionTool, tool
from engine.envs.types import EnvContext, EnvGroupBuilder
from engine.tasks.arithmetic import ArithmeticTask
from engine.tasks.render import ChatMessage

__all__ = [
    "MAX_REPLY_TOKENS",
    "TOOL_NAME",
    "CalculatorEnv",
    "CalculatorTask",
    "multiply_tool",
    "question",
    "tool_call_text",
]

TOOL_NAME: Final = "multiply"
MAX_REPLY_TOKENS: Final = 96
"""A reply's token budget: a tool call in the Hermes format is about 70 bytes (tokens)."""


def question(a: int, b: int) -> str:
    """The user message (the arithmetic task's question)."""
    return f"What is {a} * {b}?"


def tool_call_text(a: int, b: int) -> str:
    """The reply that calls the tool, in the format the agent model knows."""
    call: dict[str, Any] = {"name": TOOL_NAME, "arguments": {"a": a, "b": b}}
    return f"<tool_call>{json.dumps(call)}</tool_call>"


def multiply_tool(latency: float = 0.0) -> FunctionTool:
    """The ``multiply`` tool; ``latency`` seconds of waiting per call (a slow tool)."""

    async def multiply(a: int, b: int) -> str:
        """Multiply two integers."""
        if latency > 0:
            await anyio.sleep(latency)
        return str(a * b)

    return tool(multiply)


class CalculatorEnv:
    """One question (a :class:`~engine.envs.messages.MessageEnv`); the tool's calls are
    run by the message layer, which calls :meth:`respond` on the reply without one."""

    def __init__(self, problem: Problem) -> None:
        self.problem = problem

    async def initial_messages(self) -> Sequence[ChatMessage]:
        return [{"role": "user", "content": self.problem.question}]

    async def respond(self, messages: Sequence[ChatMessage]) -> MessageStep:
        reply = str(messages[-1].get("content", ""))
        solved = reply.strip() == str(self.problem.answer)
        used_tool = any(m.get("role") == "tool" for m in messages)
        return MessageStep(
            reward=1.0 if solved else 0.0,
            done=True,
            metrics={"solved": float(solved), "used_tool": float(used_tool)},
        )


class CalculatorTask:
    """Two-digit multiplication with the ``multiply`` tool; ``--task-arg`` values:
    ``min_operand``/``max_operand`` (10..99), ``eval_size`` (held-out pairs, default 64)
    and ``tool_latency`` (seconds, default 0), strings as the command line gives them."""

    local_model: ClassVar[Path] = AGENT_MODEL_DIR
    """The local server loads the packaged agent model for this task unless a model is
    given (``--local-model``): the default model does not know the tool's format."""

    def __init__(
        self,
        min_operand: int | str = 10,
        max_operand: int | str = 99,
        eval_size: int | str = 64,
        tool_latency: float | str = 0.0,
    ) -> None:
        self.problems = ArithmeticTask.from_args(
            {
                "op": "*",
                "min_operand": str(min_operand),
                "max_operand": str(max_operand),
                "eval_size": str(eval_size),
            }
        )
        try:
            latency = float(tool_latency)
        except ValueError:
            raise ValueError(f"tool_latency must be a number, got {tool_latency!r}") from None
        if not latency >= 0:
            raise ValueError(f"tool_latency must be >= 0 seconds, got {latency}")
        self.tool = multiply_tool(latency)
        self.name = "calculator"

    def source(self, seed: int, state: Mapping[str, Any] | None = None) -> SeededSource:
        return self.problems.source(seed, state)

    def eval_problems(self) -> list[Problem]:
        """The held-out pairs (the same for every seed; never drawn for training)."""
        return self.problems.eval_problems()

    def group_builder(
        self, problem: Problem, group_size: int, context: EnvContext
    ) -> EnvGroupBuilder:
        context = stop_at_eos(context, MAX_REPLY_TOKENS)
        envs = [CalculatorEnv(problem) for _ in range(group_size)]
        return ChatGroup(envs, context, tools=[self.tool])
