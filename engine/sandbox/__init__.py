"""A sandbox for untrusted code: isolated by bubblewrap (no network, a private temp
directory, a read-only view of the interpreter only, a clean environment), bounded by
:class:`SandboxLimits`, the whole process tree killed at the end. See docs/sandbox.md."""

from engine.sandbox.limits import DEFAULT_LIMITS, LIMIT_NAMES, SandboxLimits
from engine.sandbox.result import SandboxResult
from engine.sandbox.runner import Sandbox, SandboxUnavailable, default_python, run_python_sync

__all__ = [
    "DEFAULT_LIMITS",
    "LIMIT_NAMES",
    "Sandbox",
    "SandboxLimits",
    "SandboxResult",
    "SandboxUnavailable",
    "default_python",
    "run_python_sync",
]
