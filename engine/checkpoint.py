"""Durable checkpoints of a run and what a resumed run needs.

Why: a run must survive ``kill -9``, an interrupt and a broken server without losing or
repeating training. The run dir holds:

* ``config.json`` -- the run's (redacted) config, written once at the start
  (:func:`write_config`);
* ``checkpoints.jsonl`` -- one JSON line per checkpoint (:class:`CheckpointLog`):
  ``step`` (completed optimizer steps in the saved state), ``state_path`` (``tinker://``
  path from ``save_state``), ``sampler_path``, ``reason``, ``time`` and the engine's
  opaque ``loop_state`` (data cursor, RNG state... of the last TRAINED step);
* ``metrics.jsonl`` -- the engine's per-step metrics; on resume
  :func:`truncate_metrics` drops the lines of steps after the checkpoint, so the resumed
  run appends them again without duplicates.

Which directories a run may use (:func:`prepare_run_dir`): a new or empty one, or one
that holds only an unfinished start-up (an engine ``config.json`` but no checkpoint and
no trained step: a process killed before its step-0 checkpoint); never one that holds a
run (resume it instead) or someone else's files, and never one that cannot be written.
Files the engine rewrites (``config.json``, summaries) are written atomically (temp file
+ rename), so a full disk leaves the previous version, and the error names the file.

Durability: a record is ONE ``write`` of one line, then ``flush`` + ``fsync``; a record
exists only once ``save_state`` has returned its path, so every record points at a
state that was saved. A line torn by a crash (no trailing newline / invalid JSON) is
ignored with a warning on read, and the next append first terminates it, so it can
never swallow a new record.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Collection, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, get_args

import anyio
import structlog

from engine.errors import ConfigError, NoCheckpointYet, ResumeError, RunFileError
from engine.redact import REDACTED, redact_config

__all__ = [
    "CHECKPOINTS_FILE",
    "CONFIG_FILE",
    "DEFAULT_RESUME_IGNORE",
    "LOCAL_SERVER_DIR",
    "METRICS_FILE",
    "SUMMARY_FILES",
    "CheckpointLog",
    "CheckpointReason",
    "CheckpointRecord",
    "ResumeState",
    "check_writable",
    "load_resume_state",
    "prepare_run_dir",
    "read_run_config",
    "truncate_metrics",
    "write_config",
    "write_file_atomically",
]

CHECKPOINTS_FILE = "checkpoints.jsonl"
CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILES = ("summary.json", "summary.md")
LOCAL_SERVER_DIR = "local-server"
"""Where, inside the run dir, a local server started by the engine keeps its data."""

CheckpointReason = Literal["periodic", "interrupt", "final", "breaker", "watchdog", "error"]
_REASONS: tuple[str, ...] = get_args(CheckpointReason)

_log = structlog.get_logger("engine.checkpoint")


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


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


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
            _fsync_dir(self.run_dir)
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
            raw = self.path.read_bytes()
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

    def all(self) -> list[CheckpointRecord]:
        """Every valid record in file order (torn lines skipped with a warning)."""
        return list(self._records())

    def latest(self) -> CheckpointRecord | None:
        """The last valid record, or None when there is none."""
        last: CheckpointRecord | None = None
        for record in self._records():
            last = record
        return last


def write_file_atomically(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` all at once (temp file, fsync, rename): a crash or a
    full disk leaves the previous version, never a truncated file. A failure raises
    :class:`~engine.errors.RunFileError` naming ``path``."""
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        raise RunFileError(path, exc) from exc
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise RunFileError(path, exc) from exc
        raise
    _fsync_dir(path.parent)


def write_config(run_dir: str | os.PathLike[str], config: Mapping[str, Any]) -> dict[str, Any]:
    """Write ``<run_dir>/config.json`` (redacted, atomic) and return what was written."""
    directory = Path(run_dir)
    directory.mkdir(parents=True, exist_ok=True)
    safe = redact_config(config)
    text = json.dumps(safe, indent=2, sort_keys=True, default=str) + "\n"
    write_file_atomically(directory / CONFIG_FILE, text.encode())
    return safe


# --------------------------------------------------------------------------- run dirs


def check_writable(directory: Path) -> None:
    """ConfigError (one line, before anything starts) when files cannot be created in
    ``directory``: a read-only run dir would otherwise fail at its first write."""
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as exc:
        reason = (exc.strerror or str(exc)).lower()
        raise ConfigError(
            f"run directory {directory} is not writable ({reason}); fix its permissions "
            "or choose another --run-dir"
        ) from None


def _engine_config(directory: Path) -> dict[str, Any] | None:
    """The run config in ``directory``, or None when its config.json (if any) is not one
    the engine wrote."""
    try:
        data = json.loads((directory / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and {"task_name", "server"} <= data.keys() else None


def _has_trained_steps(directory: Path) -> bool:
    try:
        return bool((directory / METRICS_FILE).read_bytes().strip())
    except FileNotFoundError:
        return False


def _is_unfinished_startup(directory: Path) -> bool:
    """An engine run dir whose process stopped before its first checkpoint: nothing was
    trained, so a new run may start over in it."""
    return (
        _engine_config(directory) is not None
        and CheckpointLog(directory, log=_QUIET).latest() is None
        and not _has_trained_steps(directory)
    )


def _forget_unfinished_startup(directory: Path) -> None:
    """Remove the summary an earlier start-up may have left (the new run writes its
    own); events.jsonl keeps the earlier start-up's lines, the rest is rewritten."""
    for name in SUMMARY_FILES:
        (directory / name).unlink(missing_ok=True)


def prepare_run_dir(directory: Path) -> bool:
    """Make ``directory`` ready for a NEW run and return True when it held an unfinished
    start-up that the run now starts over in. Created when missing; refused with a
    ConfigError (one line, exit 2) when it holds a run (metrics or a checkpoint), when it
    holds files but no engine run (the engine would overwrite the user's config.json and
    summary.md), or when it cannot be written."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        reason = (exc.strerror or str(exc)).lower()
        raise ConfigError(f"cannot create run directory {directory}: {reason}") from None
    if _engine_config(directory) is not None:
        if not _is_unfinished_startup(directory):
            raise ConfigError(
                f"run directory {directory} already holds a run; continue it with --resume "
                f"{directory}, or choose another --run-dir"
            )
        check_writable(directory)
        _forget_unfinished_startup(directory)
        return True
    if any(not _is_temp_file(entry.name) for entry in directory.iterdir()):
        raise ConfigError(
            f"run directory {directory} is not empty and holds no engine run; choose a new "
            "or empty --run-dir (the engine would overwrite files there)"
        )
    check_writable(directory)
    return False


def _is_temp_file(name: str) -> bool:
    """A temp file of :func:`write_file_atomically` left by a crash."""
    return name.startswith(".") and name.endswith(".tmp")


class _Quiet:
    def warning(self, event: str, **fields: Any) -> None:
        pass

    info = error = warning


_QUIET = _Quiet()


def truncate_metrics(
    path: str | os.PathLike[str],
    keep_through_step: int,
    *,
    step_key: str = "step",
    log: Any = None,
) -> int:
    """Drop the metrics lines of steps after ``keep_through_step``; return how many.

    Call it once when resuming, before the engine appends again: the resumed run redoes
    the steps after the checkpoint and writes their lines anew, so without this each of
    them would appear twice. Pass the step number the engine's metrics use for the last
    step contained in the checkpoint (``checkpoint.step`` when metrics count steps from
    1, ``checkpoint.step - 1`` when from 0). Lines without ``step_key`` are kept; torn or
    invalid lines are dropped. The file is rewritten atomically; a missing file is 0.
    """
    target = Path(path)
    try:
        raw = target.read_bytes()
    except FileNotFoundError:
        return 0
    kept: list[bytes] = []
    dropped = 0
    for line in raw.split(b"\n"):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            dropped += 1
            continue
        step = data.get(step_key) if isinstance(data, dict) else None
        if (
            isinstance(step, int | float)
            and not isinstance(step, bool)
            and step > keep_through_step
        ):
            dropped += 1
            continue
        kept.append(line)
    if dropped:
        write_file_atomically(target, b"".join(line + b"\n" for line in kept))
        (log if log is not None else _log).info(
            "metrics.truncated", path=str(target), after_step=keep_through_step, dropped=dropped
        )
    return dropped


# --------------------------------------------------------------------------- resume

DEFAULT_RESUME_IGNORE: frozenset[str] = frozenset(
    {
        "resume",
        "run_dir",
        "steps",
        "base_url",
        "api_key",
        "progress",
        "concurrency",
        "log_level",
        "log_format",
        "task_repr",
        "checkpoint_every",
        "request_timeout",
        "unreachable_timeout",
        "stall_timeout",
        "max_consecutive_failures",
        "retry_attempts",
        "retry_backoff",
        "on_reward_error",
    }
)
"""Config keys that may change between a run and its resumption (dotted paths; a key
also covers everything below it)."""


@dataclass(frozen=True)
class ResumeState:
    """What the engine needs to continue a run: its stored config and the checkpoint."""

    run_dir: Path
    config: dict[str, Any]
    checkpoint: CheckpointRecord

    @property
    def step(self) -> int:
        return self.checkpoint.step

    @property
    def loop_state(self) -> dict[str, Any]:
        return self.checkpoint.loop_state


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, Mapping) and value:
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: value}


def _ignored(key: str, ignore: Collection[str]) -> bool:
    return any(key == i or key.startswith(i + ".") for i in ignore)


def _config_mismatches(
    stored: Mapping[str, Any], current: Mapping[str, Any], ignore: Collection[str]
) -> list[str]:
    # Compare the redacted current config: that is the form config.json holds.
    old = _flatten(json.loads(json.dumps(stored, default=str)))
    new = _flatten(json.loads(json.dumps(redact_config(current), default=str)))
    problems = []
    for key in sorted(set(old) | set(new)):
        if _ignored(key, ignore) or REDACTED in (str(old.get(key)), str(new.get(key))):
            continue
        if key not in old:
            problems.append(f"{key} is new ({new[key]!r})")
        elif key not in new:
            problems.append(f"{key} is missing (run dir has {old[key]!r})")
        elif old[key] != new[key]:
            problems.append(f"{key} is {old[key]!r} in the run dir but {new[key]!r} now")
    return problems


def read_run_config(directory: Path) -> dict[str, Any]:
    """The stored config of the run dir ``directory``; ResumeError (one line, exit 2)
    when it is missing, not a directory, or holds no readable config.json."""
    if not directory.exists():
        raise ResumeError(f"cannot resume: {directory} does not exist")
    if not directory.is_dir():
        raise ResumeError(f"cannot resume: {directory} is not a directory")
    config_path = directory / CONFIG_FILE
    if not config_path.is_file():
        raise ResumeError(f"cannot resume: {directory} is not a run directory (no {CONFIG_FILE})")
    try:
        stored = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ResumeError(f"cannot resume: {config_path} is not valid JSON ({exc})") from None
    if not isinstance(stored, dict):
        raise ResumeError(f"cannot resume: {config_path} does not hold a JSON object")
    return stored


def load_resume_state(
    run_dir: str | os.PathLike[str],
    *,
    current_config: Mapping[str, Any] | None = None,
    ignore: Collection[str] = DEFAULT_RESUME_IGNORE,
    log: Any = None,
) -> ResumeState:
    """Validate ``run_dir`` and return its config and latest checkpoint.

    Raises :class:`~engine.errors.ResumeError` (exit code 2, one line) when the
    directory is missing, is not a run dir (no config.json), has no checkpoint yet, or
    when ``current_config`` differs from the stored config in a key not in ``ignore``;
    :class:`~engine.errors.NoCheckpointYet` (a ResumeError) when it holds only an
    unfinished start-up, which a caller may start over in (:func:`prepare_run_dir`).
    """
    directory = Path(run_dir)
    stored = read_run_config(directory)
    latest = CheckpointLog(directory, log=log).latest()
    if latest is None:
        error = ResumeError if _has_trained_steps(directory) else NoCheckpointYet
        raise error(
            f"cannot resume: {directory} has no checkpoint yet ({CHECKPOINTS_FILE} is missing "
            "or empty); start a new run instead"
        )
    if current_config is not None:
        problems = _config_mismatches(stored, current_config, ignore)
        if problems:
            shown = "; ".join(problems[:5]) + ("; ..." if len(problems) > 5 else "")
            raise ResumeError(
                f"cannot resume {directory}: the config differs from its {CONFIG_FILE}: {shown} "
                "(use the same settings, or a new run dir)"
            )
    return ResumeState(run_dir=directory, config=stored, checkpoint=latest)
