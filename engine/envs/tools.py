"""Tools an episode's model may call, and reading tool calls from the model's text.

A :class:`Tool` has a name, a description and a JSON schema of its arguments (what the
chat template shows the model), and an ``async call`` that returns messages (usually one
``{"role": "tool", ...}`` message) and may end the episode. :func:`tool` turns a plain or
``async`` Python function with type hints into one (pydantic derives the schema).

Tool calls are written in the format of the model's chat template; a
:class:`ToolCallParser` reads them back. :class:`HermesToolCalls` reads the Hermes /
Qwen format, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; another format
is another parser (the message layer takes any).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import pydantic

from engine.common.threads import in_daemon_thread
from engine.tasks.render import ChatMessage

__all__ = [
    "FunctionTool",
    "HermesToolCalls",
    "ParsedReply",
    "Tool",
    "ToolCall",
    "ToolCallParser",
    "ToolResult",
    "tool",
    "tool_schema",
]


@dataclass(frozen=True)
class ToolResult:
    """What a tool call returns: the messages appended to the conversation, whether
    the episode ends here, and a reward for this turn (added to the turn's reward)."""

    messages: Sequence[ChatMessage]
    done: bool = False
    reward: float = 0.0


@runtime_checkable
class Tool(Protocol):
    """A callable tool. ``parameters`` is the JSON schema of the arguments object."""

    @property
    def name(self) -> str: ...

    @property
    def description(self) -> str: ...

    @property
    def parameters(self) -> Mapping[str, Any]: ...

    async def call(self, arguments: Mapping[str, Any]) -> ToolResult:
        """Run the tool. Raising is a tool error: the model is told, the episode goes on
        (``tool_errors`` counts it)."""
        ...


def tool_schema(t: Tool) -> dict[str, Any]:
    """The OpenAI-style schema chat templates render in their tool list."""
    return {
        "type": "function",
        "function": {
            "name": t.name,
            "description": t.description,
            "parameters": dict(t.parameters),
        },
    }


@dataclass(frozen=True)
class FunctionTool:
    """A :class:`Tool` over a Python function: its arguments are validated against the
    signature, a plain function runs in a daemon thread (one that hangs past
    ``--tool-timeout`` is abandoned), and a returned string becomes
    one ``tool`` message (a :class:`ToolResult` is returned as is)."""

    fn: Callable[..., Any]
    name: str
    description: str
    parameters: Mapping[str, Any] = field(repr=False)
    _model: type[pydantic.BaseModel] = field(repr=False, compare=False)

    async def call(self, arguments: Mapping[str, Any]) -> ToolResult:
        try:
            args = self._model.model_validate(dict(arguments))
        except pydantic.ValidationError as exc:
            raise ValueError(
                f"invalid arguments for {self.name}: {exc.errors()[0].get('msg')}"
            ) from None
        kwargs = {k: getattr(args, k) for k in type(args).model_fields}
        if inspect.iscoroutinefunction(self.fn):
            value = await self.fn(**kwargs)
        else:  # abandoned (not waited for) when the tool times out
            value = await in_daemon_thread(lambda: self.fn(**kwargs), name="engine-tool")
        if isinstance(value, ToolResult):
            return value
        return ToolResult([{"role": "tool", "name": self.name, "content": str(value)}])


def tool(fn: Callable[..., Any] | Callable[..., Awaitable[Any]]) -> FunctionTool:
    """A tool from a function: its name, its docstring's first paragraph as the
    description, its typed parameters as the schema.

    >>> @tool
    ... def add(a: int, b: int) -> str:
    ...     '''Add two integers.'''
    ...     return str(a + b)
    """
    signature = inspect.signature(fn)
    fields: dict[str, Any] = {}
    for name, param in signature.parameters.items():
        annotation = param.annotation if param.annotation is not inspect.Parameter.empty else Any
        default = param.default if param.default is not inspect.Parameter.empty else ...
        fields[name] = (annotation, default)
    model = pydantic.create_model(f"{fn.__name__}_arguments", **fields)
    schema = model.model_json_schema()
    schema.pop("title", None)
    for prop in schema.get("properties", {}).values():
        prop.pop("title", None)
    description = (inspect.getdoc(fn) or fn.__name__).split("\n\n")[0].strip()
    return FunctionTool(fn, fn.__name__, description, schema, model)


@dataclass(frozen=True)
class ToolCall:
    """One parsed tool call."""

    name: str
    arguments: Mapping[str, Any]
    id: str | None = None

    def to_message_entry(self) -> dict[str, Any]:
        """The call as chat templates expect it in an assistant message's
        ``tool_calls``."""
        entry: dict[str, Any] = {
            "type": "function",
            "function": {"name": self.name, "arguments": dict(self.arguments)},
        }
        if self.id is not None:
            entry["id"] = self.id
        return entry


@dataclass(frozen=True)
class ParsedReply:
    """The model's reply read back: its text without the tool calls, the calls in
    order, and ``error`` when a call could not be read (the calls read before it are
    kept)."""

    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    error: str | None = None

    def assistant_message(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [c.to_message_entry() for c in self.tool_calls]
        return message


@runtime_checkable
class ToolCallParser(Protocol):
    """Reads tool calls from a decoded reply, in one chat template's format."""

    def parse(self, text: str) -> ParsedReply: ...


_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)


class HermesToolCalls:
    """``<tool_call>{"name": "f", "arguments": {...}}</tool_call>`` (Hermes, Qwen2.5,
    Qwen3). An unterminated last call is read to the end of the text (a stop string may
    have cut its closing tag)."""

    def parse(self, text: str) -> ParsedReply:
        calls: list[ToolCall] = []
        for match in _HERMES.finditer(text):
            body = match.group(1).strip()
            try:
                data = json.loads(body)
            except json.JSONDecodeError as exc:
                return ParsedReply(_strip_calls(text), tuple(calls), f"invalid JSON ({exc.msg})")
            if not isinstance(data, dict) or not isinstance(data.get("name"), str):
                return ParsedReply(
                    _strip_calls(text), tuple(calls), 'a tool call needs a "name" string'
                )
            arguments = data.get("arguments", {})
            if isinstance(arguments, str):  # some models write the arguments as a JSON string
                with contextlib.suppress(json.JSONDecodeError):
                    arguments = json.loads(arguments)
            if not isinstance(arguments, dict):
                return ParsedReply(
                    _strip_calls(text), tuple(calls), '"arguments" must be a JSON object'
                )
            calls.append(ToolCall(data["name"], arguments))
        return ParsedReply(_strip_calls(text), tuple(calls))


def _strip_calls(text: str) -> str:
    return _HERMES.sub("", text).strip()
