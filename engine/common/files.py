"""Run files written so that a crash or a full disk never leaves half of one: atomic
replacement, and cutting a per-step JSONL log back to a step on resume."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import structlog

from engine.errors import RunFileError

__all__ = ["fsync_dir", "truncate_metrics", "unwritable_reason", "write_file_atomically"]

_log = structlog.get_logger("engine.common.files")


def fsync_dir(path: Path) -> None:
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


def unwritable_reason(directory: Path) -> str | None:
    """Why no file can be created in ``directory`` (tried with a temporary file), or None
    when one can."""
    try:
        with tempfile.TemporaryFile(dir=directory):
            return None
    except OSError as exc:
        return (exc.strerror or str(exc)).lower()


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
    fsync_dir(path.parent)


def truncate_metrics(
    path: str | os.PathLike[str],
    keep_through_step: int,
    *,
    log: Any = None,
) -> int:
    """Drop the lines of a per-step JSONL log whose ``step`` is after
    ``keep_through_step``; return how many.

    Call it when resuming or recovering, before the engine appends again: the steps after
    the checkpoint are redone and written anew, so without this each of them would appear
    twice. Steps count from 1, so ``keep_through_step`` is the checkpoint's ``step``.
    Lines without a ``step`` are kept; torn or invalid lines are dropped. The file is
    rewritten atomically; a missing file is 0.
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
        step = data.get("step") if isinstance(data, dict) else None
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
