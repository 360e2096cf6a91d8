"""Chat messages to prompt tokens and sampled tokens back to chat replies, with the
served chat template and the template's tool-call format.

:class:`ChatFormat` renders OpenAI messages (and ``tools``) with the served template and
reads a sampled reply back: its text cut at the stop, its tool calls parsed
(:class:`~engine.envs.tools.HermesToolCalls` unless another parser is given) into
OpenAI ``tool_calls``. :class:`Conversation` keeps one episode's last call so that the
next prompt is built from the tokens that were sampled, never from the model's text
re-tokenized: when the agent sends the conversation back extended (the previous messages,
the assistant reply it got, new messages), the prompt is the previous prompt + the
sampled completion + the rendering of only the new messages; any other history (rewritten,
truncated, resent) is rendered afresh and counted as a rewrite (a new datum).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.agents.openai_wire import EndpointError, MessageWire, ToolWire
from engine.envs.tools import HermesToolCalls, ToolCall, ToolCallParser
from engine.tasks import TaskContext

__all__ = ["Answer", "ChatFormat", "Choice", "Conversation"]

_PROBE = "\x00engine-probe\x00"


@dataclass(frozen=True)
class Choice:
    """One sampled reply as the agent gets it, with the exact sampled tokens."""

    tokens: tuple[int, ...]
    text: str
    """The reply's text, cut at its stop (tool-call markup included)."""
    content: str | None
    tool_calls: tuple[ToolCall, ...]
    finish_reason: str
    logprobs: tuple[float, ...] | None = None
    parse_error: str | None = None
    token_texts: tuple[str, ...] = ()
    """Each token's text (with ``logprobs``)."""

    def message(self) -> dict[str, Any]:
        """The assistant message in the template's form (tool arguments as objects)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content or ""}
        if self.tool_calls:
            message["tool_calls"] = [c.to_message_entry() for c in self.tool_calls]
        return message


@dataclass(frozen=True)
class Answer:
    """A call's answer: the prompt's length (usage) and its choices."""

    prompt_tokens: int
    choices: tuple[Choice, ...]


class ChatFormat:
    """The served tokenizer's chat template and tool-call format."""

    def __init__(self, task: TaskContext, parser: ToolCallParser | None = None) -> None:
        self.tokenizer = task.tokenizer
        self._options = dict(task.chat_template_options)
        self._parser = parser or HermesToolCalls()
        probe = self.render_text(
            [{"role": "user", "content": "?"}, {"role": "assistant", "content": _PROBE}],
            [],
            generation=False,
        )
        head, _, self.closing = probe.partition(_PROBE)
        """What the template writes after an assistant message's content."""
        prompt = self.render_text([{"role": "user", "content": "?"}], [], generation=True)
        self.opening = head[len(prompt) :] if head.startswith(prompt) else ""
        """What the template writes between the generation prompt and an assistant
        message's content (``Answer:`` then `` {content}``): the model samples it, the
        message's content leaves it out."""

    def messages(self, wire: Sequence[MessageWire]) -> list[dict[str, Any]]:
        """OpenAI messages in the form chat templates take (text content, tool-call
        arguments as objects); a non-text content part is a 400."""
        out: list[dict[str, Any]] = []
        for i, m in enumerate(wire):
            message: dict[str, Any] = {"role": m.role, "content": _text(m, i)}
            if m.name is not None:
                message["name"] = m.name
            if m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
            if m.tool_calls:
                message["tool_calls"] = [
                    ToolCall(
                        c.function.name, _arguments(c.function.arguments, i), c.id
                    ).to_message_entry()
                    for c in m.tool_calls
                ]
            out.append(message)
        return out

    @staticmethod
    def tools(wire: Sequence[ToolWire] | None) -> list[dict[str, Any]]:
        return [t.model_dump(exclude_none=True) for t in wire or ()]

    def render_text(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]],
        *,
        generation: bool,
    ) -> str:
        options = dict(self._options)
        if tools:
            options["tools"] = list(tools)
        try:
            text = self.tokenizer.apply_chat_template(
                list(messages), tokenize=False, add_generation_prompt=generation, **options
            )
        except Exception as exc:
            raise EndpointError(
                400, f"the chat template cannot render these messages: {exc}"
            ) from None
        return str(text)

    def encode(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_tokens(self, prompt: str | Sequence[int]) -> tuple[int, ...]:
        """A text completion's prompt as token ids; 400 unless it is a non-empty prompt
        of the served vocabulary (a bad id must not reach, and fail, the sampler)."""
        tokens = self.encode(prompt) if isinstance(prompt, str) else tuple(prompt)
        size = len(self.tokenizer)
        if not tokens or any(not 0 <= t < size for t in tokens):
            raise EndpointError(
                400, f"prompt must be non-empty text or token ids in [0, {size})", param="prompt"
            )
        return tokens

    def decode(self, tokens: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(tokens), skip_special_tokens=False))

    def choice(
        self,
        tokens: Sequence[int],
        stop_reason: str,
        stop_strings: Sequence[str],
        *,
        tools: bool,
        logprobs: Sequence[float] | None = None,
    ) -> Choice:
        """A sampled reply read back: cut at the first stop string or EOS, tool calls
        parsed when the request offered tools."""
        text = self.decode(tokens)
        eos = getattr(self.tokenizer, "eos_token", None)
        cuts = [text.find(s) for s in (*stop_strings, *([eos] if isinstance(eos, str) else ()))]
        found = [c for c in cuts if c >= 0]
        text = text[: min(found)] if found else text
        body = text.removeprefix(self.opening)
        calls: tuple[ToolCall, ...] = ()
        content: str | None = body
        error = None
        if tools:
            parsed = self._parser.parse(body)
            if parsed.error is None:
                calls = tuple(
                    ToolCall(c.name, c.arguments, f"call_{i}")
                    for i, c in enumerate(parsed.tool_calls)
                )
                content = parsed.content if (parsed.content or not calls) else None
            error = parsed.error
        finish = "tool_calls" if calls else ("length" if stop_reason == "length" else "stop")
        lps = tuple(logprobs) if logprobs is not None else None
        texts = tuple(self.decode([t]) for t in tokens) if lps is not None else ()
        return Choice(tuple(tokens), text, content, calls, finish, lps, error, texts)


@dataclass(frozen=True)
class _Call:
    messages: tuple[Any, ...]
    tools: str
    text: str
    prompt: tuple[int, ...]
    reply: Choice


class Conversation:
    """One episode's prompts, each built on the tokens sampled before it."""

    def __init__(self, chat: ChatFormat) -> None:
        self._chat = chat
        self._last: _Call | None = None
        self._rendered = ""

    def prompt(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]
    ) -> tuple[tuple[int, ...], bool]:
        """The prompt tokens of a call, and whether they rewrite the history (a call
        after the first whose messages do not extend the last call's plus its reply)."""
        chat = self._chat
        full = chat.render_text(messages, tools, generation=True)
        self._rendered = full
        last = self._last
        if last is None:
            return chat.encode(full), False
        n = len(last.messages)
        reply = _key(last.reply.message())
        extends = (
            len(messages) > n
            and tuple(_key(m) for m in messages[:n]) == last.messages
            and _key(messages[n]) == reply
            and json.dumps(tools, sort_keys=True) == last.tools
        )
        if extends:
            base = chat.render_text(messages[: n + 1], tools, generation=False)
            if base.startswith(last.text) and full.startswith(base):
                completion = chat.decode(last.reply.tokens)
                closing = chat.closing
                overlap = next(
                    (k for k in range(len(closing), 0, -1) if completion.endswith(closing[:k])), 0
                )
                bridge = chat.encode(closing[overlap:] + full[len(base) :])
                return (*last.prompt, *last.reply.tokens, *bridge), False
        return chat.encode(full), True

    def record(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]],
        prompt: tuple[int, ...],
        reply: Choice,
    ) -> None:
        """The call just answered (the base of the next prompt; ``messages`` and
        ``tools`` are those :meth:`prompt` rendered last)."""
        text = self._rendered
        self._last = _Call(
            tuple(_key(m) for m in messages), json.dumps(tools, sort_keys=True), text, prompt, reply
        )


def _key(message: dict[str, Any]) -> Any:
    """What must match for a message to be the same one (tool-call ids aside)."""
    calls = tuple(
        (c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True))
        for c in message.get("tool_calls") or ()
    )
    return (
        message.get("role"),
        message.get("content") or "",
        message.get("name"),
        message.get("tool_call_id"),
        calls,
    )


def _text(message: MessageWire, index: int) -> str:
    content = message.content
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise EndpointError(
                400,
                f"messages[{index}]: only text content is supported, not {part.type!r}",
                param=f"messages[{index}].content",
            )
        parts.append(part.text)
    return "".join(parts)


def _arguments(arguments: str, index: int) -> dict[str, Any]:
    try:
        value = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise EndpointError(
            400,
            f"messages[{index}]: tool call arguments must be a JSON object string",
            param=f"messages[{index}].tool_calls",
        )
    return value
