"""The call a worker (a process of the pool or a Ray task) makes on an environment, and
its outcome read back here: shared by :mod:`engine.envs.executors`,
:mod:`engine.envs.ray_workers` and the agents' worker processes."""

from __future__ import annotations

from typing import Any

import anyio

__all__ = ["call_in_worker", "outcome_of"]


def outcome_of(outcome: tuple[Any, Any, BaseException | None]) -> tuple[Any, Any]:
    """What :func:`call_in_worker` answered: the target and the value, or its error raised."""
    target_after, value, error = outcome
    if error is not None:
        raise error
    return target_after, value


def call_in_worker(target: Any, method: str, *args: Any) -> tuple[Any, Any, BaseException | None]:
    """In the worker: run ``target.method(*args)`` on a fresh event loop; what it raises
    comes back as a value."""

    async def run() -> Any:
        return await getattr(target, method)(*args)

    try:
        return target, anyio.run(run), None
    except Exception as exc:
        return target, None, exc
