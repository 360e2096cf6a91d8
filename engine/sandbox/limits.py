"""What a sandboxed run may spend: CPU seconds, wall-clock time, memory, processes, open
files, file size, temp space and output bytes (one frozen value, checked when made)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = ["DEFAULT_LIMITS", "LIMIT_NAMES", "SandboxLimits"]

LIMIT_NAMES = ("wall", "cpu", "memory", "output", "file_size")
"""The ``limit`` a result can name: the one that stopped the code."""


@dataclass(frozen=True)
class SandboxLimits:
    """Bounds on one run. Each must be positive; ``cpu_s`` and ``wall_s`` are seconds
    (``cpu_s`` rounds up to whole seconds: the kernel counts in seconds)."""

    wall_s: float = 20.0
    """Wall-clock time from start to kill (the whole process tree)."""
    cpu_s: float = 10.0
    """CPU seconds per process (RLIMIT_CPU: SIGXCPU, then SIGKILL a second later)."""
    memory_bytes: int = 512 << 20
    """Address space per process (RLIMIT_AS): an allocation past it fails."""
    processes: int = 16
    """Processes and threads of the code's user at once (RLIMIT_NPROC): fork fails past it.
    With ``memory_bytes`` it bounds a run's memory: at most their product (8 GiB)."""
    open_files: int = 256
    """File descriptors per process (RLIMIT_NOFILE)."""
    file_bytes: int = 16 << 20
    """Largest file the code may write (RLIMIT_FSIZE: SIGXFSZ past it)."""
    tmp_bytes: int = 64 << 20
    """Size of the private writable ``/tmp``, and of ``/dev/shm`` (tmpfs: a full one is
    ENOSPC)."""
    output_bytes: int = 1 << 20
    """stdout and stderr together: past it the tree is killed and the output truncated."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ValueError(
                    f"sandbox limit {field.name} must be a positive number, got {value!r}"
                )
            if field.type == "int" and not isinstance(value, int):
                raise ValueError(f"sandbox limit {field.name} must be an integer, got {value!r}")

    def rlimits(self) -> dict[str, tuple[int, int]]:
        """The resource limits set in the code's process (soft, hard) by ``RLIMIT_*`` name."""
        cpu = max(1, int(-(-self.cpu_s // 1)))
        return {
            "RLIMIT_CPU": (cpu, cpu + 1),
            "RLIMIT_AS": (self.memory_bytes, self.memory_bytes),
            "RLIMIT_NPROC": (self.processes, self.processes),
            "RLIMIT_NOFILE": (self.open_files, self.open_files),
            "RLIMIT_FSIZE": (self.file_bytes, self.file_bytes),
            "RLIMIT_CORE": (0, 0),
        }

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


DEFAULT_LIMITS = SandboxLimits()
