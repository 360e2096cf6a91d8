"""Environment calls as Ray tasks (``--score-workers ray:N``; ``pip install 'engine[ray]'``).

For environments that need more CPU than one machine (code execution, simulators): each
``initial_observation``, ``step`` and ``compute_group_rewards`` is one Ray task that
runs the pickled environment (or builder) on a fresh event loop in a Ray worker and
returns it with its new state (:func:`~engine.envs.executors.call_in_worker`, the same
call the worker processes make). At most ``N`` calls of a run are in flight.

Which cluster: the one this process already joined (``ray.init(...)`` before the run:
the engine uses it as it is and leaves it running); otherwise the engine calls
``ray.init()``, which joins the cluster at ``RAY_ADDRESS`` when that is set (Ray's own
variable, e.g. ``ray://head:10001`` or ``auto``) and starts a local one otherwise, and
shuts down at the end of the run only what it started. Ray pickles with cloudpickle: an
environment must survive it (no open sockets or locks in its state), checked on the
task before the run starts. A cancelled call is cancelled on the cluster (its worker is
killed), as worker processes are.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable
from types import ModuleType, TracebackType
from typing import Any

import anyio
import anyio.to_thread

from engine.common.threads import in_daemon_thread
from engine.envs.executors import call_in_worker, outcome_of
from engine.errors import ConfigError, EngineError

__all__ = ["RAY_MISSING", "RayWorkers", "ray_available", "ray_dumps"]

RAY_MISSING = "--score-workers ray needs Ray: pip install 'engine[ray]'"


def ray_available() -> bool:
    return importlib.util.find_spec("ray") is not None


def _ray() -> ModuleType:
    if not ray_available():
        raise ConfigError(RAY_MISSING)
    import ray

    return ray


def ray_dumps() -> Callable[[Any], bytes]:
    """The serializer Ray sends task arguments with (for the check before the run)."""
    from ray import cloudpickle

    return cloudpickle.dumps  # type: ignore[no-any-return]


class RayWorkers:
    """At most ``calls`` environment calls in flight as Ray tasks; entered once per run
    (joins or starts the cluster, see the module docstring)."""

    def __init__(self, calls: int) -> None:
        self._limiter = anyio.CapacityLimiter(calls)
        self._started = False
        self._remote: Any = None

    async def __aenter__(self) -> RayWorkers:
        ray = _ray()
        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS") or None
            try:
                # A daemon thread: a stop is not held up by a cluster that never answers.
                await in_daemon_thread(
                    functools.partial(ray.init, include_dashboard=False), name="engine-ray-init"
                )
            except Exception as exc:
                where = f"the Ray cluster at RAY_ADDRESS={address}" if address else "Ray"
                raise EngineError(f"could not start {where}: {exc}") from exc
            self._started = True
        self._remote = ray.remote(call_in_worker)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._started:
            self._started = False
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(_ray().shutdown)

    async def call(self, target: Any, method: str, *args: Any) -> tuple[Any, Any]:
        if self._remote is None:
            raise RuntimeError("RayWorkers must be entered ('async with') before a call")
        ray = _ray()
        async with self._limiter:
            ref = self._remote.remote(target, method, *args)
            try:
                outcome = await in_daemon_thread(ray.get, ref, name="engine-ray")
            except anyio.get_cancelled_exc_class():
                ray.cancel(ref, force=True)
                raise
            except ray.exceptions.RayError as exc:
                first = next((line for line in str(exc).splitlines() if line.strip()), "")
                raise EngineError(f"its Ray task failed: {type(exc).__name__}: {first}") from None
        return outcome_of(outcome)
