"""The built-in dataset task: ``--task jsonl:PATH`` or ``hf:PATH`` with ``--task-arg
KEY=VALUE``.

Each line of the JSONL file (each row of the Hugging Face dataset) is one problem: a
prompt (a string, sent raw, or a list of chat messages rendered by the served model's
chat template) and an answer, scored by a reward preset (:mod:`engine.tasks.rewards`).
A held-out split (``eval_size`` rows, a second dataset ``eval_path``, or an ``hf``
dataset's split ``eval_split``) is what ``--eval-every`` evaluates greedily. Both formats
share every rule below the reading of records: field mapping, presets, shuffling, epochs
and the cursor.

Why a cursor and not an iterator: the order is a seeded shuffle per epoch (epoch ``e``
uses ``Random(f"{seed}:{e}")``), so the source's whole state is ``(epoch, position,
drawn)``; a checkpoint stores it and a resumed run draws exactly the problems an
uninterrupted run would have drawn.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import random
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Final, Literal, TypedDict, Unpack

from engine.core.problems import Problem, RewardBreakdown
from engine.errors import ConfigError
from engine.tasks.hf import read_hf_splits
from engine.tasks.rewards import REWARD_PRESETS, RewardFn, make_reward, user_reward

__all__ = [
    "DATASET_ARGS",
    "HF_ARGS",
    "DataFormat",
    "DatasetSource",
    "DatasetTask",
    "Row",
    "RowArgs",
    "RowParser",
    "RowTask",
    "int_arg",
    "known_args",
    "raw_prompts_warning",
    "read_records",
    "row_args",
    "rows_of",
    "template_options",
]

DATASET_ARGS: Final[Mapping[str, str]] = {
    "prompt_field": "field holding the prompt: a string or a list of chat messages "
    "(default: messages, else prompt, else question)",
    "answer_field": "field holding the answer (default: answer)",
    "system": "a system message put before a chat prompt (a string prompt becomes a user message)",
    "chat": "true: send a string prompt as a user message through the chat template "
    "(default: raw; the run warns when the served model has a chat template)",
    "reward": f"reward preset: {', '.join(REWARD_PRESETS)} (default: exact), or your own "
    "module:function (response, problem) -> number or RewardBreakdown, sync or async",
    "tolerance": "numeric: relative tolerance (absolute below 1; default 1e-6)",
    "numeric_position": "numeric: which number of the response is the answer: first "
    "(default; the packaged model), last (chat models) or boxed (inside \\boxed{})",
    "pattern": "regex: the answer is group 1 (or the whole match) of the first match",
    "pattern_timeout": "regex: seconds a match may take before it is a reward error (default 1)",
    "epochs": "passes over the training rows before the source ends (default: unlimited)",
    "shuffle": "false: keep the file order (default: a seeded shuffle per epoch)",
    "eval_size": "rows held out for --eval-every (default 0; taken by a fixed shuffle)",
    "eval_path": "a second dataset (same format as PATH) of held-out rows",
    "stop": "stop strings, separated by '|'",
    "enable_thinking": "true/false: the Qwen3 chat template's thinking switch",
}

HF_ARGS: Final[Mapping[str, str]] = {
    "split": "the training split (default: train, or the only split)",
    "eval_split": "a split of held-out rows for --eval-every (e.g. test)",
}
"""The task arguments only ``hf:`` datasets take (on top of :data:`DATASET_ARGS`)."""

DataFormat = Literal["jsonl", "hf"]

_TRUE: Final = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
_SPLIT_SEED: Final = "engine-eval-split"


@dataclass(frozen=True)
class Row:
    """One dataset row: its 0-based line number among the rows, prompt and answer."""

    index: int
    prompt: str | tuple[Mapping[str, Any], ...]
    answer: Any


def read_records(path: Path) -> Iterator[tuple[str, Any]]:
    """``(where, record)`` of each non-blank line of a JSONL file (``where`` is
    ``path:line``); a ConfigError names the first line that cannot be read."""
    try:
        lines = path.read_bytes().splitlines()
    except OSError as exc:
        raise ConfigError(f"cannot read dataset {path}: {exc.strerror or exc}") from None
    for number, raw in enumerate(lines, start=1):
        where = f"{path}:{number}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{where} is not UTF-8 text (byte {exc.start + 1})") from None
        if not line.strip():
            continue
        try:
            yield where, json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{where} is not valid JSON ({exc.msg})") from None
        except RecursionError:
            raise ConfigError(f"{where} is nested too deeply to read") from None
        except ValueError as exc:  # e.g. an integer beyond Python's digit limit
            raise ConfigError(f"{where} cannot be read ({str(exc).splitlines()[0]})") from None


def rows_of(
    records: Iterable[tuple[str, Any]], prompt_field: str | None, answer_field: str, name: str
) -> list[Row]:
    """Rows from ``(where, record)`` pairs, whatever file they come from; a ConfigError
    names ``where`` of the first bad record, or ``name`` when there are none."""
    rows: list[Row] = []
    for where, record in records:
        if not isinstance(record, dict):
            raise ConfigError(f"{where} is not a JSON object")
        field = prompt_field or next(
            (f for f in ("messages", "prompt", "question") if f in record), "messages"
        )
        if field not in record:
            raise ConfigError(f"{where} has no prompt field {field!r}")
        if answer_field not in record:
            raise ConfigError(f"{where} has no answer field {answer_field!r}")
        answer = record[answer_field]
        try:
            json.dumps(answer)
        except (TypeError, ValueError):
            raise ConfigError(
                f"{where}: the answer {answer!r} is not JSON (checkpoints store answers)"
            ) from None
        rows.append(Row(len(rows), _prompt(record[field], where), answer))
    if not rows:
        raise ConfigError(f"{name} has no rows")
    return rows


def _prompt(value: Any, where: str) -> str | tuple[Mapping[str, Any], ...]:
    if isinstance(value, str):
        return _encodable(value, where)
    if (
        isinstance(value, list)
        and value
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in value
        )
    ):
        for message in value:
            if isinstance(message["content"], str):
                _encodable(message["content"], where)
        return tuple(value)
    raise ConfigError(f"{where}: the prompt must be a string or a list of {{role, content}} dicts")


def _encodable(text: str, where: str) -> str:
    """``text`` when the tokenizer can encode it (a lone surrogate such as ``"\\ud800"``
    is valid JSON but no UTF-8: it would fail mid-run)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ConfigError(
            f"{where}: the prompt holds a lone surrogate {text[exc.start]!r} at character "
            f"{exc.start}, which no tokenizer can encode"
        ) from None
    return text


class DatasetSource:
    """Training rows in a seeded shuffle per epoch, for ``epochs`` epochs (None: no end).
    State: ``{"epoch", "position", "drawn"}``; problem ids count draws from 0."""

    def __init__(
        self,
        rows: Sequence[Row],
        seed: int,
        *,
        shuffle: bool,
        epochs: int | None,
        state: Mapping[str, Any] | None = None,
    ) -> None:
        self._rows = rows
        self._seed = seed
        self._shuffle = shuffle
        self._epochs = epochs
        self._epoch = self._position = self._drawn = 0
        if state is not None:
            try:
                self._epoch = int(state["epoch"])
                self._position = int(state["position"])
                self._drawn = int(state["drawn"])
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"not a dataset source state: {exc}") from exc
        self._order = self._order_of(self._epoch)

    def _order_of(self, epoch: int) -> list[int]:
        order = list(range(len(self._rows)))
        if self._shuffle:
            random.Random(f"{self._seed}:{epoch}").shuffle(order)
        return order

    def next(self) -> Problem | None:
        if self._position >= len(self._order):
            self._epoch += 1
            self._position = 0
            self._order = self._order_of(self._epoch)
        if self._epochs is not None and self._epoch >= self._epochs:
            return None
        row = self._rows[self._order[self._position]]
        data = {"split": "train", "row": row.index, "epoch": self._epoch}
        problem = _problem(self._drawn, row, data)
        self._position += 1
        self._drawn += 1
        return problem

    def state(self) -> dict[str, Any]:
        return {"epoch": self._epoch, "position": self._position, "drawn": self._drawn}


def _problem(problem_id: int, row: Row, data: Mapping[str, Any]) -> Problem:
    question = row.prompt if isinstance(row.prompt, str) else _last_question(row.prompt)
    return Problem(id=problem_id, question=question, answer=row.answer, data=dict(data))


def _last_question(messages: Sequence[Mapping[str, Any]]) -> str:
    """The last user message of a chat prompt (or conversation), else its last message."""
    user = [m for m in messages if m.get("role") == "user"]
    return str((user or list(messages))[-1]["content"])


RowParser = Callable[[Iterable[tuple[str, Any]], str], list[Row]]
"""Rows from ``(where, record)`` pairs and the data's name (for "has no rows"); each
row task parses its own fields and refuses a bad record naming ``where``."""


class RowArgs(TypedDict, total=False):
    """What every row task takes besides its path (:class:`RowTask`)."""

    data_format: DataFormat
    split: str | None
    eval_split: str | None
    system: str | None
    epochs: int | None
    shuffle: bool
    eval_size: int
    eval_path: str | Path | None
    chat_template_options: Mapping[str, Any] | None
    args: Mapping[str, str] | None


def row_args(args: Mapping[str, str], data_format: DataFormat) -> RowArgs:
    """:class:`RowArgs` from ``--task-arg`` strings."""
    return RowArgs(
        data_format=data_format,
        split=args.get("split"),
        eval_split=args.get("eval_split"),
        system=args.get("system"),
        epochs=int_arg(args, "epochs") if "epochs" in args else None,
        shuffle=flag_arg(args, "shuffle") if "shuffle" in args else True,
        eval_size=int_arg(args, "eval_size") if "eval_size" in args else 0,
        eval_path=args.get("eval_path"),
        chat_template_options=template_options(args),
        args=args,
    )


class RowTask:
    """What every task of dataset rows shares (:class:`DatasetTask`, the conversations of
    ``--objective sft``, the preference pairs of ``--objective dpo``): the rows read once
    from a JSONL file or a Hugging Face dataset on disk, the held-out split
    (``eval_size`` rows taken by a fixed shuffle, a second dataset ``eval_path`` or, for
    ``hf``, the split ``eval_split``), the seeded resumable source, the held-out problems
    and a problem's row, its ``system`` message and chat template options. A subclass says
    how a record is parsed (``parse``) and what its rows are called (``noun``)."""

    noun: ClassVar[str] = "training rows"
    split_seed: ClassVar[str] = _SPLIT_SEED
    name_prefix: ClassVar[str | None] = None
    """The task's name is ``<this or the data format>-<file stem>``."""

    def __init__(
        self,
        path: str | Path,
        parse: RowParser,
        *,
        data_format: DataFormat = "jsonl",
        split: str | None = None,
        eval_split: str | None = None,
        system: str | None = None,
        epochs: int | None = None,
        shuffle: bool = True,
        eval_size: int = 0,
        eval_path: str | Path | None = None,
        chat_template_options: Mapping[str, Any] | None = None,
        args: Mapping[str, str] | None = None,
    ) -> None:
        self.path = Path(path)
        held_out_sources = [
            name
            for name, given in (
                ("eval_size", eval_size != 0),
                ("eval_path", eval_path is not None),
                ("eval_split", eval_split is not None),
            )
            if given
        ]
        if len(held_out_sources) > 1:
            raise ConfigError(
                f"task arguments {' and '.join(held_out_sources)} both choose the held-out "
                "rows: give one"
            )
        rows, held_out = _read(self.path, data_format, split, eval_split, eval_path, parse)
        if not 0 <= eval_size < len(rows):
            raise ConfigError(
                f"task argument eval_size must be in 0..{len(rows) - 1} for {self.path} "
                f"({len(rows)} {self.noun}), got {eval_size}"
            )
        if eval_size:
            order = list(range(len(rows)))
            random.Random(self.split_seed).shuffle(order)
            chosen = set(order[:eval_size])
            held_out = [r for r in rows if r.index in chosen]
            rows = [r for r in rows if r.index not in chosen]
        if epochs is not None and epochs < 1:
            raise ConfigError(f"task argument epochs must be positive, got {epochs}")
        self._train = rows
        self._held_out = held_out
        self._rows = {
            "train": {r.index: r for r in rows},
            "eval": {r.index: r for r in held_out},
        }
        self._epochs = epochs
        self._shuffle = shuffle
        self._system = system
        self.chat_template_options = dict(chat_template_options or {})
        self.stop: tuple[str, ...] = ()
        stem = self.path.stem or self.path.resolve().name
        self.name = f"{self.name_prefix or data_format}-{stem}"
        self.spec = (f"{data_format}:{self.path.resolve()}", dict(args or {}))

    def source(self, seed: int, state: Mapping[str, Any] | None = None) -> DatasetSource:
        return DatasetSource(
            self._train, seed, shuffle=self._shuffle, epochs=self._epochs, state=state
        )

    def eval_problems(self) -> list[Problem]:
        """The held-out rows, in file order (ids count from 0)."""
        return [
            _problem(i, row, {"split": "eval", "row": row.index})
            for i, row in enumerate(self._held_out)
        ]

    def _row(self, problem: Problem) -> Row:
        split = str(problem.data.get("split", "train"))
        return self._rows[split][int(problem.data["row"])]

    def _chat_or_raw(self, chat: bool | None) -> None:
        """The rule for string prompts of the tasks that take ``chat`` (DatasetTask,
        CodeTask): raw unless ``chat`` or a ``system`` message says chat."""
        self._chat = bool(chat) or self._system is not None
        self.raw_unasked = (
            chat is None
            and not self._chat
            and any(isinstance(r.prompt, str) for r in (*self._train, *self._held_out))
        )
        """String prompts go raw (tokenizer.encode) and ``chat`` was not set either way."""

    def _prompt_of(self, problem: Problem) -> str | list[Mapping[str, Any]]:
        """The prompt by :meth:`_chat_or_raw`'s rule."""
        row = self._row(problem)
        if isinstance(row.prompt, str) and not self._chat:
            return row.prompt
        return self._messages(problem)

    def _messages(self, problem: Problem) -> list[Mapping[str, Any]]:
        """The problem's chat messages (a string prompt: one user message), with the
        ``system`` message first when set and the messages have none."""
        prompt = self._row(problem).prompt
        messages: list[Mapping[str, Any]] = (
            [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        )
        if self._system is not None and messages[0].get("role") != "system":
            messages.insert(0, {"role": "system", "content": self._system})
        return messages


class DatasetTask(RowTask):
    """A dataset scored by a reward preset, or by the user's function ``reward=
    "module:function"`` (:func:`~engine.tasks.rewards.user_reward`): a JSONL file
    (``jsonl``) or a Hugging Face dataset on disk (``hf``, :mod:`engine.tasks.hf`). Build
    it with :meth:`from_args` (what ``--task jsonl:PATH`` / ``hf:PATH`` with
    ``--task-arg KEY=VALUE`` does) or directly. The held-out rows are ``eval_size`` rows
    of the training split, a second dataset ``eval_path`` (same format) or, for ``hf``,
    the split ``eval_split``."""

    skip_special_tokens = True

    def __init__(
        self,
        path: str | Path,
        *,
        prompt_field: str | None = None,
        answer_field: str = "answer",
        chat: bool | None = None,
        reward: str = "exact",
        reward_options: Mapping[str, str] | None = None,
        stop: Sequence[str] = (),
        **rows: Unpack[RowArgs],
    ) -> None:
        super().__init__(
            path,
            functools.partial(_dataset_rows, prompt_field=prompt_field, answer_field=answer_field),
            **rows,
        )
        self._chat_or_raw(chat)
        self._own: Callable[..., Any] | None = None
        if ":" in reward:
            self._own = user_reward(reward)
            if _is_async(self._own):  # the scorer awaits it on the event loop
                self.score = self._score_async  # type: ignore[method-assign,assignment]
        else:
            self._score: RewardFn = make_reward(reward, reward_options or {})
        self.reward = reward
        self.stop = tuple(stop)
        self.data_digest = _rows_digest(self._train, self._held_out)
        """A fingerprint of every row (prompts and answers, both splits): a run dir records
        it, and resuming on a changed dataset is refused."""

    @classmethod
    def from_args(
        cls, path: str, args: Mapping[str, str], data_format: DataFormat = "jsonl"
    ) -> DatasetTask:
        """Build from ``--task-arg`` strings (see :data:`DATASET_ARGS`, and
        :data:`HF_ARGS` for ``hf``)."""
        known_args(args, DATASET_ARGS, data_format, f"{data_format} tasks")
        options = {
            k: args[k]
            for k in ("tolerance", "numeric_position", "pattern", "pattern_timeout")
            if k in args
        }
        return cls(
            path,
            prompt_field=args.get("prompt_field"),
            answer_field=args.get("answer_field", "answer"),
            chat=flag_arg(args, "chat") if "chat" in args else None,
            reward=args.get("reward", "exact"),
            reward_options=options,
            stop=tuple(s for s in args.get("stop", "").split("|") if s),
            **row_args(args, data_format),
        )

    def __repr__(self) -> str:
        return (
            f"DatasetTask({str(self.path)!r}, {len(self._train)} train / "
            f"{len(self._held_out)} held-out rows, reward={self.reward!r})"
        )

    def prompt(self, problem: Problem) -> str | list[Mapping[str, Any]]:
        return self._prompt_of(problem)

    def score(self, response: str, problem: Problem) -> RewardBreakdown:
        if self._own is not None:
            return self._own(response, problem)  # type: ignore[no-any-return]  # (checked by the scorer)
        return self._score(response, problem.answer)

    async def _score_async(self, response: str, problem: Problem) -> RewardBreakdown:
        assert self._own is not None
        return await self._own(response, problem)  # type: ignore[no-any-return]


def raw_prompts_warning(task: object, tokenizer: Any) -> str | None:
    """What a run says before its first step when a dataset's plain-string prompts go
    to a model with a chat template raw, ``chat`` unset (a chat model then answers
    nothing useful): the fix, and how to keep them raw quietly. None otherwise."""
    if not (isinstance(task, RowTask) and getattr(task, "raw_unasked", False)):
        return None
    if getattr(tokenizer, "chat_template", None) is None:
        return None
    return (
        f"the prompts of {task.name} are plain strings, sent raw to a model that has a "
        "chat template: for a chat model, --task-arg chat=true sends each as a user "
        "message through it (--task-arg chat=false keeps them raw and silences this)"
    )


def _is_async(fn: Callable[..., Any]) -> bool:
    """Whether calling ``fn`` gives a coroutine (an ``async def``, or an object whose
    ``__call__`` is one)."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004
    )


def _read(
    path: Path,
    data_format: DataFormat,
    split: str | None,
    eval_split: str | None,
    eval_path: str | Path | None,
    parse: RowParser,
) -> tuple[list[Row], list[Row]]:
    """The training rows and the held-out rows of ``eval_path`` or ``eval_split`` (none
    without either): the only part that differs between the formats."""
    if data_format == "jsonl":
        if split is not None or eval_split is not None:
            raise ConfigError(
                "task arguments split and eval_split name splits of hf: datasets; a "
                "jsonl file has none (eval_size=N or eval_path=FILE hold rows out)"
            )
        rows = parse(read_records(path), f"dataset {path}")
        if eval_path is None:
            return rows, []
        return rows, parse(read_records(Path(eval_path)), f"dataset {eval_path}")
    dataset = read_hf_splits(path)
    split = dataset.require(split) if split is not None else dataset.default()
    if eval_split == split:
        raise ConfigError(f"task argument eval_split must differ from split ({split!r})")
    rows = parse(dataset.records(split), f"{path} (split {split})")
    if eval_split is not None:
        records = dataset.records(dataset.require(eval_split))
        return rows, parse(records, f"{path} (split {eval_split})")
    if eval_path is not None:
        other = read_hf_splits(Path(eval_path))
        return rows, parse(other.records(other.default()), f"dataset {eval_path}")
    return rows, []


def _dataset_rows(
    records: Iterable[tuple[str, Any]], name: str, *, prompt_field: str | None, answer_field: str
) -> list[Row]:
    return rows_of(records, prompt_field, answer_field, name)


def _rows_digest(train: Sequence[Row], held_out: Sequence[Row]) -> str:
    digest = hashlib.sha256()
    for split, rows in (("train", train), ("eval", held_out)):
        for row in rows:
            record = [split, row.index, row.prompt, row.answer]
            digest.update(json.dumps(record, sort_keys=True, default=str).encode() + b"\n")
    return f"sha256:{digest.hexdigest()}"


def known_args(
    args: Mapping[str, str], known: Mapping[str, str], data_format: DataFormat, what: str
) -> None:
    """ConfigError naming the first of ``args`` that is neither in ``known`` nor, for an
    ``hf`` dataset, in :data:`HF_ARGS`."""
    names = {**known, **(HF_ARGS if data_format == "hf" else {})}
    unknown = sorted(set(args) - set(names))
    if unknown:
        raise ConfigError(
            f"unknown task argument {unknown[0]!r} for {what}; known: {', '.join(names)}"
        )


def template_options(args: Mapping[str, str]) -> dict[str, Any]:
    """The chat template's options the task arguments set (``enable_thinking``)."""
    if "enable_thinking" not in args:
        return {}
    return {"enable_thinking": flag_arg(args, "enable_thinking")}


def flag_arg(args: Mapping[str, str], key: str) -> bool:
    value = _TRUE.get(args[key].strip().lower())
    if value is None:
        raise ConfigError(f"task argument {key} must be true or false, got {args[key]!r}")
    return value


def int_arg(args: Mapping[str, str], key: str) -> int:
    """The integer task argument ``key``; ConfigError when it is not one."""
    try:
        return int(args[key])
    except ValueError:
        raise ConfigError(f"task argument {key} must be an integer, got {args[key]!r}") from None
