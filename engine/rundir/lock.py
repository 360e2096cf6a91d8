"""One run directory, one process: an OS lock on ``<run dir>/.lock``.

Why an OS lock (``fcntl.flock``) and not a pid file: the kernel releases it when the
process ends, however it ends (kill -9 included), so a crashed run never leaves a stale
lock behind, and a second process (a ``--resume`` started while the run still trains)
is refused at once instead of interleaving two lineages in checkpoints.jsonl. The file
holds the owner's pid, only to name it in the refusal.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from typing import Final

from engine.errors import ConfigError

__all__ = ["LOCK_FILE", "RunDirLock"]

LOCK_FILE: Final = ".lock"


class RunDirLock:
    """The held lock of one run dir; :meth:`release` (or the process ending) frees it."""

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, directory: Path) -> RunDirLock:
        """The lock of ``directory`` (which must exist); ConfigError (one line, exit 2)
        when another process holds it."""
        path = directory / LOCK_FILE
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            reason = (exc.strerror or str(exc)).lower()
            raise ConfigError(f"cannot lock run directory {directory}: {reason}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            owner = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            raise ConfigError(
                f"run directory {directory} is in use by another process"
                + (f" (pid {owner})" if owner.isdigit() else "")
                + ": one process per run dir; wait for it to end (or stop it) first"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        return cls(fd)

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
