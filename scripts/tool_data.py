"""Synthetic tool-use conversations for the packaged agent model (``make_model
--environments``): one tool of a random kind, name and parameter names, its schema listed
by the chat template, and a question it answers. The model learns to read a tool from
its schema (copy its name and parameter names into a call, the question's values into the
arguments, the result into the answer) rather than to know a fixed set of tools, so a
user's own ``@tool`` gets called now and then and RL has a behaviour to raise.

Each tool is made by :func:`engine.envs.tools.tool` from a Python function, so its schema
is exactly what a user's ``@tool`` produces. :data:`HELD_OUT` names are never drawn: the
build measures calls of a ``subtract`` tool it has never seen
(``make_model.env_format_stats``).
"""

from __future__ import annotations

import inspect
import json
import keyword
import random
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.envs import HermesToolCalls
from engine.envs.tools import FunctionTool, tool

Messages = list[dict[str, Any]]

HELD_OUT = frozenset({"subtract"})
"""Tool names the synthetic conversations never use (the build's unseen-tool check)."""


@dataclass(frozen=True)
class ToolKind:
    """What a tool does: names and descriptions to draw from (``{0}``, ``{1}``: its
    parameter names), parameter names, how a question asks for it and the result."""

    names: tuple[str, ...]
    descriptions: tuple[str, ...]
    params: tuple[tuple[str, ...], ...]
    kind: type  # every parameter's type (int or str)
    question: Callable[..., str]
    result: Callable[..., Any]


_PAIRS: tuple[tuple[str, ...], ...] = (
    *(("a", "b"), ("x", "y"), ("m", "n"), ("first", "second"), ("left", "right")),
    *(("lhs", "rhs"), ("num1", "num2"), ("p", "q"), ("i", "j"), ("u", "v")),
)
_ONES = (("n",), ("x",), ("a",), ("value",), ("number",), ("k",), ("num",))
_WORDS = (("word",), ("text",), ("s",), ("string",), ("w",), ("name",))

KINDS = (
    ToolKind(
        ("add", "plus", "sum_two", "addition", "add_numbers", "total", "add_ints"),
        ("Add two integers.", "Return {0} + {1}.", "Add {1} to {0}."),
        _PAIRS,
        int,
        lambda a, b: f"What is {a} + {b}?",
        lambda a, b: a + b,
    ),
    ToolKind(
        ("minus", "difference", "sub", "deduct", "take_away", "diff", "sub_ints"),
        ("Subtract {1} from {0}.", "Return {0} - {1}.", "The difference of two integers."),
        _PAIRS,
        int,
        lambda a, b: f"What is {a} - {b}?",
        lambda a, b: a - b,
    ),
    ToolKind(
        ("multiply", "times", "product", "mul", "multiplication", "mult", "mul_ints"),
        ("Multiply two integers.", "Return {0} * {1}.", "The product of {0} and {1}."),
        _PAIRS,
        int,
        lambda a, b: f"What is {a} * {b}?",
        lambda a, b: a * b,
    ),
    ToolKind(
        ("divide", "quotient", "div", "int_div", "floor_div", "divide_ints"),
        ("Divide {0} by {1}, rounding down.", "Return {0} // {1}."),
        _PAIRS,
        int,
        lambda a, b: f"What is {a} // {b}?",
        lambda a, b: a // b,
    ),
    ToolKind(
        ("modulo", "mod", "remainder", "rem", "modulus"),
        ("The remainder of {0} divided by {1}.", "Return {0} % {1}."),
        _PAIRS,
        int,
        lambda a, b: f"What is {a} % {b}?",
        lambda a, b: a % b,
    ),
    ToolKind(
        ("maximum", "larger", "max_of", "bigger", "greatest", "max2"),
        ("The larger of two integers.", "Return the larger of {0} and {1}."),
        _PAIRS,
        int,
        lambda a, b: f"Which is larger, {a} or {b}?",
        max,
    ),
    ToolKind(
        ("minimum", "smaller", "min_of", "least", "min2"),
        ("The smaller of two integers.", "Return the smaller of {0} and {1}."),
        _PAIRS,
        int,
        lambda a, b: f"Which is smaller, {a} or {b}?",
        min,
    ),
    ToolKind(
        ("square", "squared", "sq", "square_int"),
        ("Square an integer.", "Return {0} * {0}."),
        _ONES,
        int,
        lambda a: f"What is {a} squared?",
        lambda a: a * a,
    ),
    ToolKind(
        ("double", "twice", "times_two", "doubled"),
        ("Double an integer.", "Return 2 * {0}."),
        _ONES,
        int,
        lambda a: f"What is twice {a}?",
        lambda a: 2 * a,
    ),
    ToolKind(
        ("reverse_word", "flip", "backwards", "mirror", "reversed_text"),
        ("Reverse a word.", "Return {0} backwards."),
        _WORDS,
        str,
        lambda w: f"Reverse the word: {w}",
        lambda w: w[::-1],
    ),
    ToolKind(
        ("upper", "uppercase", "to_upper", "shout", "capitals"),
        ("Write a word in capital letters.", "Return {0} in upper case."),
        _WORDS,
        str,
        lambda w: f"Write {w} in capital letters.",
        str.upper,
    ),
    ToolKind(
        ("length", "count_letters", "strlen", "word_length", "letters"),
        ("Count the letters of a word.", "The number of letters in {0}."),
        _WORDS,
        str,
        lambda w: f"How many letters are in {w}?",
        len,
    ),
)

_RANDOM_NAME_SHARE = 0.3
"""Tools named by random letters: the name can only be copied from the schema."""
_RANDOM_PARAM_SHARE = 0.2


def _identifier(rng: random.Random, lo: int, hi: int) -> str:
    letters = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(lo, hi)))
    if keyword.iskeyword(letters):  # not a Python parameter name (``in``, ``if``)
        letters += "x"
    return letters if rng.random() < 0.7 else f"{letters}_{rng.choice(string.ascii_lowercase)}"


def make_tool(
    name: str, description: str, params: tuple[str, ...], kind: type, result: Callable[..., Any]
) -> FunctionTool:
    """A tool as ``@tool`` would make it from ``def name(params: kind) -> str``."""

    def run(**arguments: Any) -> str:
        return str(result(*(arguments[p] for p in params)))

    run.__name__ = name
    run.__doc__ = description
    keyword = inspect.Parameter.KEYWORD_ONLY
    signature = inspect.Signature([inspect.Parameter(p, keyword, annotation=kind) for p in params])
    setattr(run, "__signature__", signature)  # noqa: B010 (what inspect.signature reads)
    return tool(run)


def _values(rng: random.Random, kind: type, count: int) -> list[Any]:
    if kind is str:
        return [_identifier(rng, 3, 7).replace("_", "") for _ in range(count)]
    return [rng.randint(10, 99) if i == 0 else rng.randint(2, 99) for i in range(count)]


def tool_transcript(
    rng: random.Random, tool_call_share: float
) -> tuple[Messages, set[int], list[FunctionTool]]:
    """A question answered through a freshly drawn tool (share ``tool_call_share``) or
    directly; returns the messages, the trained (assistant) indices and the tool (the
    chat template lists its schema)."""
    spec = rng.choice(KINDS)
    params = rng.choice(spec.params)
    if rng.random() < _RANDOM_PARAM_SHARE:
        params = tuple(_identifier(rng, 1, 5) for _ in params)
        if len(set(params)) < len(params):
            params = tuple(f"{p}{i}" for i, p in enumerate(params))
    name = rng.choice(spec.names)
    if rng.random() < _RANDOM_NAME_SHARE:
        name = _identifier(rng, 3, 9)
    if name in HELD_OUT:
        name = f"{name}_{rng.choice(string.ascii_lowercase)}"
    made = make_tool(
        name, rng.choice(spec.descriptions).format(*params), params, spec.kind, spec.result
    )
    values = _values(rng, spec.kind, len(params))
    answer = str(spec.result(*values))
    messages: Messages = [{"role": "user", "content": spec.question(*values)}]
    if rng.random() < tool_call_share:
        messages += [
            call_message(name, dict(zip(params, values, strict=True))),
            {"role": "tool", "content": answer},
        ]
    messages.append({"role": "assistant", "content": answer})
    trained = {i for i, m in enumerate(messages) if m["role"] == "assistant"}
    return messages, trained, [made]


def call_text(name: str, arguments: dict[str, Any]) -> str:
    """A call in the Hermes format the agent model's template writes and
    :class:`~engine.envs.tools.HermesToolCalls` reads."""
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def call_message(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """The assistant message of one call, as the message layer builds it from the reply."""
    return HermesToolCalls().parse(call_text(name, arguments)).assistant_message()
