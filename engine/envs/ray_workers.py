"""Environment calls as Ray tasks (``--score-workers ray:N``; ``pip install 'engine[ray]'``).

For environments that need more CPU than one machine (code execution, simulators): each
``initial_observation``, ``step`` and ``compute_group_rewards`` is one Ray task that
runs the pickled environment (or builder) on a fresh event loop in a Ray worker and
returns it with its new state (:func:`~engine.envs.worker_calls.call_in_worker`, the same
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

import os
import threading
from collections.abc import Callable
from types import ModuleType, TracebackType
from typing import Any

import anyio

from engine.common.extras import require
from engine.common.threads import in_daemon_thread
from engine.envs.worker_calls import call_in_worker, outcome_of
from engine.errors import EngineError

__all__ = ["RAY_FEATURE", "SHUTDOWN_TIMEOUT_S", "RayWorkers", "ray_dumps"]

RAY_FEATURE = "--score-workers ray:N"
SHUTDOWN_TIMEOUT_S = 60.0
"""How long the end of a run waits for a cluster the engine started to shut down."""


def _ray() -> ModuleType:
    require("ray", RAY_FEATURE)
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
        self._owner: _ClusterOwner | None = None
        self._remote: Any = None

    async def __aenter__(self) -> RayWorkers:
        ray = _ray()
        if not ray.is_initialized():
            owner = _ClusterOwner(ray)
            try:
                await owner.start()
            except Exception as exc:
                address = os.environ.get("RAY_ADDRESS")
                where = f"the Ray cluster at RAY_ADDRESS={address}" if address else "Ray"
                raise EngineError(f"could not start {where}: {exc}") from exc
            self._owner = owner
        self._remote = ray.remote(call_in_worker)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        owner, self._owner = self._owner, None
        if owner is not None:
            with anyio.move_on_after(SHUTDOWN_TIMEOUT_S, shield=True):
                await owner.stop()

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


class _ClusterOwner:
    """A thread that calls ``ray.init()``, stays until :meth:`stop`, then calls
    ``ray.shutdown()``. Why a thread of its own: a local cluster's processes are killed
    when the *thread* that started them ends (Ray sets ``PR_SET_PDEATHSIG``), so the
    starting thread must live as long as the cluster; and not the event loop's thread,
    which ``ray.init`` would block for seconds."""

    def __init__(self, ray: ModuleType) -> None:
        self._ray = ray
        self._started = threading.Event()
        self._stopping = threading.Event()
        self._failed: list[BaseException] = []
        self._thread = threading.Thread(target=self._own, name="engine-ray", daemon=True)

    async def start(self) -> None:
        """Start the cluster (or join ``RAY_ADDRESS``); raises what ``ray.init`` raised.
        A cancelled caller abandons a start that hangs (an address that never answers)."""
        self._thread.start()
        await in_daemon_thread(self._started.wait, name="engine-ray-start")
        if self._failed:
            raise self._failed[0]

    async def stop(self) -> None:
        self._stopping.set()
        await in_daemon_thread(self._thread.join, name="engine-ray-stop")

    def _own(self) -> None:
        try:
            self._ray.init(include_dashboard=False)
        except BaseException as exc:
            self._failed.append(exc)
            self._started.set()
            return
        self._started.set()
        self._stopping.wait()
        self._ray.shutdown()
