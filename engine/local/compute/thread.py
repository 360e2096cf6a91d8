"""The compute thread that runs backend calls.

Torch work must stay off the event loop (long-polls and heartbeats must keep answering
while a forward_backward runs) and the backend is written for a single caller, so all
backend calls go through one dedicated OS thread, one job at a time, in the order the
event loop hands them over. Torch keeps per-thread state (grad mode), so a pool whose
worker may change between calls would not do. The one exception is sampling when the
backend ``samples_apart``: the sample batcher then runs it on a second ``ComputeThread``
of its own (``engine.local.operations.batcher``).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import anyio.lowlevel
from anyio import from_thread

T = TypeVar("T")

_STOP = object()

JOBS_KEPT = 4096


class ComputeThreadClosed(RuntimeError):
    """The server is shutting down; no more backend calls are accepted."""


class ComputeThread:
    """Runs callables on one dedicated thread; ``await run(fn)`` from the event loop."""

    def __init__(self, name: str = "engine.local-compute") -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._lock = anyio.Lock()
        self._closed = False
        self.busy_s = 0.0
        """Seconds the thread has spent computing (for stats)."""
        self.jobs: deque[tuple[str, float, float]] = deque(maxlen=JOBS_KEPT)
        """The most recent jobs as (label, start, end) in ``time.monotonic`` seconds
        (the clock of the event loop, and of ``time.perf_counter`` on Linux)."""
        self._thread.start()

    async def run(self, fn: Callable[[], T], label: str = "other") -> T:
        """Run ``fn`` on the compute thread and return its result (or raise its error);
        ``label`` names the job in :attr:`jobs`."""
        return await self.run_prepared(lambda: fn, label)

    async def run_prepared(self, prepare: Callable[[], Callable[[], T]], label: str = "other") -> T:
        """Like ``run``, but ``prepare`` is called on the event loop once the thread is
        free, right before the job starts: the sampler uses it to collect every request
        that arrived while the thread was busy into one batch."""
        async with self._lock:
            if self._closed:
                raise ComputeThreadClosed("the local server is shutting down")
            fn = prepare()
            done = anyio.Event()
            box: dict[str, Any] = {}
            token = anyio.lowlevel.current_token()

            def job() -> None:
                started = time.monotonic()
                try:
                    box["value"] = fn()
                except BaseException as exc:  # handed back to the awaiting task
                    box["error"] = exc
                finally:
                    ended = time.monotonic()
                    self.busy_s += ended - started
                    self.jobs.append((label, started, ended))
                    # RuntimeError: the event loop is gone, nobody is waiting any more.
                    with contextlib.suppress(RuntimeError):
                        from_thread.run_sync(done.set, token=token)

            self._jobs.put(job)
            # Shielded: the lock must stay held until the thread has finished this job,
            # or a cancelled caller would let the next job overlap with it.
            with anyio.CancelScope(shield=True):
                await done.wait()
        if "error" in box:
            raise box["error"]
        return box["value"]  # type: ignore[no-any-return]

    async def aclose(self) -> None:
        """Stop accepting jobs and let the thread exit after its current job."""
        async with self._lock:
            self._closed = True
            self._jobs.put(_STOP)

    @property
    def ident(self) -> int | None:
        """The compute thread's identifier (for checks that all work ran on it)."""
        return self._thread.ident

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            job()
