"""Preference pairs for ``--objective dpo --task jsonl:PATH`` (or ``hf:PATH``, a Hugging
Face dataset on disk, read by :mod:`engine.tasks.hf`).

Each line (each row) is one pair, ``{"prompt": ..., "chosen": "...", "rejected": "..."}``:
the prompt is a string (sent as a user message) or a list of chat messages, and the two
responses are the assistant's reply the data prefers and the one it does not. A pair is
rendered like a conversation of supervised fine-tuning
(:func:`~engine.tasks.conversations.render_conversation`): the prompt through the served
chat template with its generation prompt, and each response as the tokens an assistant
message adds (its text and the template's end token). A line without a non-empty
``chosen`` or ``rejected``, or whose two responses are the same, is refused naming the
line. The held-out split, shuffling, epochs and the resumable cursor are the row task's
(:class:`~engine.tasks.dataset.RowTask`). docs/dpo.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Final, Unpack

from engine.core.problems import Problem, RewardBreakdown
from engine.errors import ConfigError
from engine.tasks.conversations import check_encodable, is_chat, render_conversation
from engine.tasks.dataset import DataFormat, Row, RowArgs, RowTask, known_args, row_args
from engine.tasks.render import ChatMessage, TaskContext

__all__ = ["PAIR_ARGS", "PairTask", "RenderedPair"]

PAIR_ARGS: Final[Mapping[str, str]] = {
    "system": "a system message put before each prompt that has none",
    "epochs": "passes over the training pairs before the run ends (default: unlimited)",
    "shuffle": "false: keep the file order (default: a seeded shuffle per epoch)",
    "eval_size": "pairs held out for --eval-every (default 0; taken by a fixed shuffle)",
    "eval_path": "a second JSONL file of held-out pairs",
    "enable_thinking": "true/false: the Qwen3 chat template's thinking switch",
}

RenderedPair = tuple[list[int], list[int], list[int]]
"""A pair's tokens: the prompt (with the generation prompt), the chosen response and
the rejected one (each with the template's end token)."""


def _messages(value: Any, where: str) -> tuple[Mapping[str, Any], ...]:
    messages = [{"role": "user", "content": value}] if isinstance(value, str) else value
    if (isinstance(value, str) and not value.strip()) or not is_chat(messages):
        raise ConfigError(
            f"{where}: the prompt must be a non-empty string or a list of {{role, content}} "
            "messages with string contents"
        )
    return tuple(messages)


def _response(record: Mapping[str, Any], key: str, where: str) -> str:
    value = record.get(key)
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{where}: the pair has no {key} response (a non-empty string)")
    return value


def _rows(records: Iterable[tuple[str, Any]], name: str) -> list[Row]:
    rows: list[Row] = []
    for where, record in records:
        if not isinstance(record, dict):
            raise ConfigError(f"{where} is not a JSON object")
        if "prompt" not in record:
            raise ConfigError(f"{where} has no prompt field 'prompt'")
        messages = _messages(record["prompt"], where)
        chosen = _response(record, "chosen", where)
        rejected = _response(record, "rejected", where)
        if chosen == rejected:
            raise ConfigError(
                f"{where}: chosen and rejected are the same response; a pair must differ"
            )
        check_encodable([chosen, rejected, *(m["content"] for m in messages)], where)
        rows.append(Row(len(rows), messages, {"chosen": chosen, "rejected": rejected}))
    if not rows:
        raise ConfigError(f"{name} has no pairs")
    return rows


class PairTask(RowTask):
    """Preference pairs of a JSONL file for ``--objective dpo`` (see the module doc)."""

    skip_special_tokens = True
    noun = "pairs"
    split_seed = "engine-dpo-eval-split"
    name_prefix = "dpo"

    def __init__(self, path: str | Path, **rows: Unpack[RowArgs]) -> None:
        super().__init__(path, _rows, **rows)

    @classmethod
    def from_args(
        cls, path: str, args: Mapping[str, str], data_format: DataFormat = "jsonl"
    ) -> PairTask:
        """Build from ``--task-arg`` strings (see :data:`PAIR_ARGS`, and
        :data:`~engine.tasks.dataset.HF_ARGS` for ``hf``)."""
        known_args(args, PAIR_ARGS, data_format, f"--objective dpo {data_format} tasks")
        return cls(path, **row_args(args, data_format))

    def __repr__(self) -> str:
        return (
            f"PairTask({str(self.path)!r}, {len(self._train)} train / "
            f"{len(self._held_out)} held-out pairs)"
        )

    def every_problem(self) -> list[Problem]:
        """Every pair, training and held-out, as a problem (to check them all before a
        run sends anything)."""
        train = [
            Problem(row.index, "", row.answer, {"split": "train", "row": row.index})
            for row in self._train
        ]
        return [*train, *self.eval_problems()]

    def prompt(self, problem: Problem) -> list[ChatMessage]:
        """The pair's prompt messages (with the ``system`` message, if set)."""
        return self._messages(problem)

    def pair_tokens(self, context: TaskContext, problem: Problem) -> RenderedPair:
        """The pair's tokens: its prompt, chosen and rejected responses."""
        prompt = self.prompt(problem)
        answers = self._row(problem).answer
        (context_tokens, chosen), (_, rejected) = (
            render_conversation(context, [*prompt, {"role": "assistant", "content": text}])[-1]
            for text in (answers["chosen"], answers["rejected"])
        )
        return context_tokens, chosen, rejected

    def score(self, response: str, problem: Problem) -> RewardBreakdown:
        """1 when the response is the chosen one (both stripped), else 0."""
        chosen = str(self._row(problem).answer["chosen"]).strip()
        correct = float(response.strip() == chosen)
        return RewardBreakdown(correct, {"correct": correct})
