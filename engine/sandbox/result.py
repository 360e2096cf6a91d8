"""What a sandboxed run did: exit status or signal, the limit that stopped it, its output
(bounded) and how much it wrote, wall and CPU time."""

from __future__ import annotations

import dataclasses
import errno
import signal as signals
from dataclasses import dataclass
from typing import Any

from engine.sandbox.limits import SandboxLimits

__all__ = ["SandboxResult", "limit_reached", "signal_name"]


@dataclass(frozen=True)
class SandboxResult:
    exit_code: int | None
    """The code's exit status; None when a signal ended it."""
    signal: str | None
    """The signal that ended it (``SIGKILL``, ``SIGXCPU``...), or None."""
    limit: str | None
    """The limit that stopped it (one of :data:`~engine.sandbox.limits.LIMIT_NAMES`), or None."""
    stdout: str
    stderr: str
    stdout_bytes: int
    """Bytes the code wrote to stdout (all of them, up to the output limit)."""
    stderr_bytes: int
    truncated: bool
    """Whether ``stdout``/``stderr`` hold less than the code wrote."""
    wall_s: float
    cpu_s: float | None
    """CPU seconds of the code and the children it waited for; None when it was killed."""
    isolated: bool
    """False only for a run the user let go without isolation."""

    @property
    def ok(self) -> bool:
        """Exit status 0 within every limit."""
        return self.exit_code == 0 and self.limit is None

    @property
    def reason(self) -> str:
        """How it ended, in a few words: ``exit 0``, ``exit 1``, ``signal SIGSEGV``,
        ``limit wall (killed by SIGKILL)``."""
        how = f"exit {self.exit_code}" if self.signal is None else f"signal {self.signal}"
        return how if self.limit is None else f"limit {self.limit} ({how})"

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "ok": self.ok, "reason": self.reason}


def signal_name(number: int) -> str:
    try:
        return signals.Signals(number).name
    except ValueError:
        return f"signal {number}"


def limit_reached(
    limits: SandboxLimits, *, signal: str | None, cpu_s: float | None, stderr: str
) -> str | None:
    """The limit behind an ending the sandbox did not cause itself (it knows when it killed
    for the wall clock or the output): SIGXCPU or SIGKILL past the CPU limit is ``cpu``;
    SIGXFSZ, or Python's ``File too large`` error (Python ignores SIGXFSZ) as the last line
    of stderr, ``file_size``; a Python ``MemoryError`` as that line ``memory``."""
    if signal == "SIGXCPU" or (signal == "SIGKILL" and cpu_s is not None and cpu_s >= limits.cpu_s):
        return "cpu"
    last = stderr.rstrip().rsplit("\n", 1)[-1]
    if signal == "SIGXFSZ" or f"[Errno {errno.EFBIG}]" in last:
        return "file_size"
    if last.startswith("MemoryError"):
        return "memory"
    return None
