"""Chat conversations for supervised fine-tuning: ``--objective sft --task jsonl:PATH``
(or ``hf:PATH``, a Hugging Face dataset on disk, read by :mod:`engine.tasks.hf`).

Each line of the JSONL file (each row of the dataset) is one conversation,
``{"messages": [{"role", "content"}, ...]}`` with at least one assistant message, and
not an assistant message first (unless the ``system`` argument puts one before it): a
line that breaks either is refused, naming the line. A conversation is rendered with the
served model's chat template, one assistant message at a time
(:func:`render_conversation`): the context before it, as the sampler would see it
(the template with its generation prompt), and the tokens the message adds (its text
and the end token the template writes). Only those tokens are trained (docs/sft.md).
The held-out split (``eval_size`` rows, a second file ``eval_path`` or an ``hf``
dataset's split ``eval_split``), shuffling, epochs and the resumable cursor are the
dataset task's (:class:`~engine.tasks.dataset.DatasetSource`).

A conversation task is also an ordinary task: its prompt is the conversation up to
its first assistant message and its reward 1 when a response equals that message
(stripped), so the held-out replies can be scored greedily as well.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, TypeGuard, Unpack

from engine.core.problems import Problem, RewardBreakdown
from engine.errors import ConfigError
from engine.tasks.dataset import DataFormat, Row, RowArgs, RowTask, known_args, row_args
from engine.tasks.render import ChatMessage, TaskContext

__all__ = [
    "CONVERSATION_ARGS",
    "NORMALIZED_CHARS",
    "ConversationTask",
    "ConversationTooLong",
    "check_encodable",
    "is_chat",
    "max_context_chars",
    "render_conversation",
]

CONVERSATION_ARGS: Final[Mapping[str, str]] = {
    "messages_field": "field holding the conversation, a list of chat messages (default: messages)",
    "system": "a system message put before each conversation that has none",
    "epochs": "passes over the training conversations before the run ends (default: unlimited)",
    "shuffle": "false: keep the file order (default: a seeded shuffle per epoch)",
    "eval_size": "conversations held out for --eval-every (default 0; taken by a fixed shuffle)",
    "eval_path": "a second JSONL file of held-out conversations",
    "enable_thinking": "true/false: the Qwen3 chat template's thinking switch",
}


NORMALIZED_CHARS: Final = 3
"""The most characters a tokenizer's normalizer joins into one before it splits a text
(NFC: a Hangul syllable of three jamo, a letter with two accents)."""


class ConversationTooLong(ValueError):
    """A rendered conversation has more characters (``chars``) than can fit the context."""

    def __init__(self, chars: int) -> None:
        super().__init__(f"the conversation renders to {chars} characters")
        self.chars = chars


def max_context_chars(tokenizer: Any, max_context: int | None) -> int | None:
    """The most characters a text of ``max_context`` tokens can hold: each token stands
    for at most its vocabulary entry's characters (the longest one's, special tokens
    included) of the text its normalizer gives, which joins at most
    :data:`NORMALIZED_CHARS` characters into one. None when the context or the
    vocabulary is not known."""
    vocabulary = getattr(tokenizer, "get_vocab", None)
    if max_context is None or not callable(vocabulary):
        return None
    longest = max(map(len, vocabulary()), default=1)
    return max_context * longest * NORMALIZED_CHARS


def render_conversation(
    context: TaskContext, messages: Sequence[ChatMessage], *, max_chars: int | None = None
) -> list[tuple[list[int], list[int]]]:
    """``(context tokens, message tokens)`` of each assistant message: the conversation
    before it rendered with the generation prompt (as a prompt is), and the tokens the
    message adds to it. ConfigError when the template does not render the conversation
    as that prompt followed by the message; :class:`ConversationTooLong` when a rendered
    text is over ``max_chars`` (:func:`max_context_chars`), before it is tokenized."""
    tokenizer, options = context.tokenizer, dict(context.chat_template_options)
    if getattr(tokenizer, "chat_template", None) is None:
        raise ConfigError(
            "supervised fine-tuning renders conversations with the served model's chat "
            "template, and its tokenizer has none"
        )
    turns: list[tuple[list[int], list[int]]] = []
    for k, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before = [dict(m) for m in messages[:k]]
        prompt = str(
            tokenizer.apply_chat_template(
                before, tokenize=False, add_generation_prompt=True, **options
            )
        )
        full = str(
            tokenizer.apply_chat_template(
                [*before, dict(message)], tokenize=False, add_generation_prompt=False, **options
            )
        )
        if max_chars is not None and len(full) > max_chars:
            raise ConversationTooLong(len(full))
        if not full.startswith(prompt) or len(full) == len(prompt):
            raise ConfigError(
                f"the chat template does not render assistant message {k + 1} as the "
                "prompt before it followed by the message, so its tokens cannot be told "
                "apart for training"
            )
        turns.append(
            (
                list(tokenizer.encode(prompt, add_special_tokens=False)),
                list(tokenizer.encode(full[len(prompt) :], add_special_tokens=False)),
            )
        )
    return turns


def is_chat(value: Any) -> TypeGuard[list[dict[str, Any]]]:
    """Whether ``value`` is a non-empty list of ``{role, content}`` messages with string
    roles and contents."""
    return (
        isinstance(value, list)
        and bool(value)
        and all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in value
        )
    )


def check_encodable(texts: Iterable[str], where: str) -> None:
    """ConfigError naming ``where`` when a text holds a lone surrogate (valid JSON, no
    UTF-8: the tokenizer would fail mid-run)."""
    for text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise ConfigError(f"{where}: a message holds a lone surrogate") from None


def _conversation(
    record: Any, field: str, where: str, *, system: bool
) -> tuple[Mapping[str, Any], ...]:
    if not isinstance(record, dict):
        raise ConfigError(f"{where} is not a JSON object")
    messages = record.get(field)
    if not is_chat(messages):
        raise ConfigError(
            f"{where}: field {field!r} must be a list of {{role, content}} messages with "
            "string contents"
        )
    if not any(m["role"] == "assistant" for m in messages):
        raise ConfigError(f"{where}: the conversation has no assistant message to train on")
    if messages[0]["role"] == "assistant" and not system:
        raise ConfigError(
            f"{where}: the conversation starts with an assistant message, and an assistant "
            "message is trained as the reply to the messages before it: put a user (or "
            "system) message first, or give every conversation one (--task-arg system=...)"
        )
    check_encodable((m["content"] for m in messages), where)
    return tuple(messages)


def _rows(records: Iterable[tuple[str, Any]], name: str, *, field: str, system: bool) -> list[Row]:
    rows: list[Row] = []
    for where, record in records:
        messages = _conversation(record, field, where, system=system)
        first = next(m["content"] for m in messages if m["role"] == "assistant")
        rows.append(Row(len(rows), messages, first))
    if not rows:
        raise ConfigError(f"{name} has no conversations")
    return rows


class ConversationTask(RowTask):
    """Conversations of a JSONL file for ``--objective sft`` (see the module doc)."""

    skip_special_tokens = True
    noun = "conversations"
    split_seed = "engine-sft-eval-split"
    name_prefix = "sft"

    def __init__(
        self, path: str | Path, *, messages_field: str = "messages", **rows: Unpack[RowArgs]
    ) -> None:
        parse = functools.partial(
            _rows, field=messages_field, system=rows.get("system") is not None
        )
        super().__init__(path, parse, **rows)

    @classmethod
    def from_args(
        cls, path: str, args: Mapping[str, str], data_format: DataFormat = "jsonl"
    ) -> ConversationTask:
        """Build from ``--task-arg`` strings (see :data:`CONVERSATION_ARGS`, and
        :data:`~engine.tasks.dataset.HF_ARGS` for ``hf``)."""
        known_args(args, CONVERSATION_ARGS, data_format, f"--objective sft {data_format} tasks")
        messages_field = args.get("messages_field", "messages")
        return cls(path, messages_field=messages_field, **row_args(args, data_format))

    def __repr__(self) -> str:
        return (
            f"ConversationTask({str(self.path)!r}, {len(self._train)} train / "
            f"{len(self._held_out)} held-out conversations)"
        )

    def conversation(self, problem: Problem) -> list[ChatMessage]:
        """The problem's conversation (with the ``system`` message, if set)."""
        return self._messages(problem)

    def prompt(self, problem: Problem) -> list[ChatMessage]:
        """The conversation up to its first assistant message."""
        messages = self.conversation(problem)
        first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
        return messages[:first]

    def score(self, response: str, problem: Problem) -> RewardBreakdown:
        """1 when the response is the first assistant message (both stripped), else 0."""
        correct = float(response.strip() == str(problem.answer).strip())
        return RewardBreakdown(correct, {"correct": correct})
