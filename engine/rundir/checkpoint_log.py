"""A run's durable checkpoints.

Why: a run must survive ``kill -9``, an interrupt and a broken server without losing or
repeating training. ``<run dir>/checkpoints.jsonl`` (:class:`CheckpointLog`) holds one
JSON line per checkpoint: ``step`` (completed optimizer steps in the saved state),
``state_path`` (``tinker://`` path from ``save_state``), ``sampler_path``, ``reason``,
``time`` and the engine's opaque ``loop_state`` (data cursor, RNG state... of the last
TRAINED step). On resume and recovery
:func:`~engine.common.files.truncate_metrics` drops the lines of the
steps after the checkpoint from the per-step logs (for every one of them at once:
:meth:`engine.rundir.record.RunRecord.rewind`), so the redone steps appear once.
Files the engine rewrites (``config.json``, summaries) are written atomically
(:func:`~engine.common.files.write_file_atomically`: temp file + rename), so a full
disk leaves the previous version, and the error names the file. The directory itself
(which one a run may use, ``config.json``, the resume check, the summaries) is
:mod:`engine.rundir.directory`.

Durability: a record is ONE ``write`` of one line, then ``flush`` + ``fsync``; a record
exists only once ``save_state`` has returned its path, so every record points at a
state that was saved. A line torn by a crash (no trailing newline / invalid JSON) is
ignored with a warning on read, and the next append first terminates it, so it can
never swallow a new record.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, get_args

import anyio
import structlog

from engine.common.files import fsync_dir
from engine.errors import ResumeError, RunFileError
from engine.rundir.checkpoint_copy import read_regular_file

__all__ = [
    "CHECKPOINTS_FILE",
    "CheckpointLog",
    "CheckpointReason",
    "CheckpointRecord",
]

CHECKPOINTS_FILE = "checkpoints.jsonl"

CheckpointReason = Literal["periodic", "interrupt", "stop", "final", "breaker", "watchdog", "error"]
_REASONS: tuple[str, ...] = get_args(CheckpointReason)

_log = structlog.get_logger("engine.rundir.checkpoint_log")


@dataclass(frozen=True)
class CheckpointRecord:
    """One checkpoint. ``step`` = optimizer steps applied to the saved state;
    ``loop_state`` = the engine's JSON-able state as of that step (see module doc)."""

    step: int
    state_path: str
    reason: CheckpointReason
    sampler_path: str | None = None
    loop_state: dict[str, Any] = field(default_factory=dict)
    time: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))

    def __post_init__(self) -> None:
        if isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 0:
            raise ValueError(f"checkpoint step must be an int >= 0, got {self.step!r}")
        if not isinstance(self.state_path, str) or not self.state_path:
            raise ValueError(
                f"checkpoint state_path must be a non-empty string, got {self.state_path!r}"
            )
        if self.sampler_path is not None and not isinstance(self.sampler_path, str):
            raise ValueError(f"checkpoint sampler_path must be a string, got {self.sampler_path!r}")
        if self.reason not in _REASONS:
            raise ValueError(
                f"checkpoint reason must be one of {', '.join(_REASONS)}, got {self.reason!r}"
            )
        if not isinstance(self.loop_state, dict):
            raise ValueError(
                f"checkpoint loop_state must be a dict, got {type(self.loop_state).__name__}"
            )

    def to_line(self) -> str:
        """The record as one JSON line (with the newline); ValueError if ``loop_state``
        is not JSON-serialisable."""
        try:
            text = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"checkpoint loop_state is not JSON-serialisable: {exc}") from exc
        return text + "\n"

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CheckpointRecord:
        """Parse a decoded line; ValueError with the reason if it is not a record."""
        missing = [k for k in ("step", "state_path", "reason") if k not in data]
        if missing:
            raise ValueError(f"missing field(s) {', '.join(missing)}")
        known = {"step", "state_path", "reason", "sampler_path", "loop_state", "time"}
        kwargs = {k: v for k, v in data.items() if k in known}
        return cls(**kwargs)


class CheckpointLog:
    """``<run_dir>/checkpoints.jsonl``: append-only, one record per line."""

    def __init__(self, run_dir: str | os.PathLike[str], *, log: Any = None) -> None:
        self._log = log if log is not None else _log
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / CHECKPOINTS_FILE

    def append(self, record: CheckpointRecord) -> None:
        """Write ``record`` durably (one write, flush, fsync). Blocking; from async code
        use :meth:`aappend`."""
        line = record.to_line().encode()
        created = not self.path.exists()
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            with open(self.path, "ab") as f:
                if not created and f.tell() > 0 and not self._ends_with_newline():
                    line = b"\n" + line  # isolate a torn last line left by a crash
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            raise RunFileError(self.path, exc) from exc
        if created:
            fsync_dir(self.run_dir)
        self._log.info(
            "checkpoint",
            step=record.step,
            reason=record.reason,
            state_path=record.state_path,
            sampler_path=record.sampler_path,
        )

    async def aappend(self, record: CheckpointRecord) -> None:
        """:meth:`append` in a worker thread (fsync must not block the event loop)."""
        await anyio.to_thread.run_sync(self.append, record)

    def _ends_with_newline(self) -> bool:
        with open(self.path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            return f.read(1) == b"\n"

    def _records(self) -> Iterator[CheckpointRecord]:
        try:
            raw = read_regular_file(self.path)
        except FileNotFoundError:
            return
        lines = raw.split(b"\n")
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                data = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                torn = number == len(lines)  # no newline after it: the write was cut
                self._log.warning(
                    "checkpoint.torn_line" if torn else "checkpoint.bad_line",
                    path=str(self.path),
                    line=number,
                    detail="ignored (a write interrupted by a crash)",
                )
                continue
            if not isinstance(data, dict):
                raise ResumeError(f"{self.path} line {number} is not a checkpoint record")
            try:
                yield CheckpointRecord.from_dict(data)
            except (TypeError, ValueError) as exc:
                raise ResumeError(
                    f"{self.path} line {number} is not a valid checkpoint record: {exc}"
                ) from None

    def first_of_step(self, step: int) -> CheckpointRecord | None:
        """The first valid record of ``step`` with sampler weights, or None."""
        return next(
            (r for r in self._records() if r.step == step and r.sampler_path is not None), None
        )

    def latest(self) -> CheckpointRecord | None:
        """The last valid record, or None when there is none."""
        last: CheckpointRecord | None = None
        for record in self._records():
            last = record
        return last
