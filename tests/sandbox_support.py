"""What the sandbox tests share: skip (or, on CI, fail) where this machine cannot isolate,
and find processes that outlived a run by a token in their command line."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import anyio
import pytest

from engine.sandbox import isolation, runner
from engine.sandbox.isolation import Backend, isolation_problem

GUARD_S = 60.0
"""A hang guard, never a timing claim: how long a check may wait for something to happen."""


def require_isolation() -> None:
    """Skip where bubblewrap cannot isolate here, with the reason; on CI (which installs
    bubblewrap) that is a failure instead, so a missing install step cannot pass green."""
    problem = anyio.run(isolation_problem)
    if problem is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"CI must be able to isolate: {problem}")
    pytest.skip(f"this machine cannot isolate: {problem}")


def use_backend(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every sandbox of the test isolates with ``backend``; skip where it cannot (on CI
    too: bubblewrap is the one CI must have, and a runner may forbid user namespaces)."""
    problem = isolation.isolation_problem_now(backend)
    if problem is not None:
        pytest.skip(f"this machine cannot isolate with {backend}: {problem}")
    monkeypatch.setattr(runner, "isolation_backend", lambda: backend)


def new_token() -> str:
    return f"sandbox-token-{uuid.uuid4().hex}"


def processes_with(token: str) -> list[int]:
    """Host pids whose command line holds ``token``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if token.encode() in cmdline:
            found.append(int(entry.name))
    return found


async def survivors(token: str) -> list[int]:
    """The processes with ``token`` left once they had up to :data:`GUARD_S` to go (a run
    that returned has already reaped its tree: this is a hang guard, not a wait)."""
    with anyio.move_on_after(GUARD_S):
        while processes_with(token):  # noqa: ASYNC110 (a process's exit has no event here)
            await anyio.sleep(0.05)
    return processes_with(token)
