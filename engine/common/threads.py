"""Blocking user code in a daemon thread, abandoned on cancellation.

Why not ``anyio.to_thread.run_sync``: the interpreter joins anyio's worker threads at
exit, so a reward or a tool that never returns would keep the process alive after a
stop. A daemon thread is abandoned by a cancelled caller and dies with the process.

The threads are kept for the next call once idle (per event loop, like anyio's, and
retired after ``IDLE_S``): starting a thread makes the event loop wait until the new
thread runs, and with the SDK's thread busy that wait, once per group scored, was a
good part of a step's scoring latency.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import anyio.from_thread
from anyio.lowlevel import EventLoopToken, RunVar, current_token

__all__ = ["in_daemon_thread"]

T = TypeVar("T")

IDLE_S = 10.0
"""An idle worker thread retires after this many seconds without a call."""

_Job = tuple[Callable[[], bool], str]
"""A call to run and the name the thread takes meanwhile; the call returns False once
the event loop it reports to is gone."""


class _Worker:
    """A daemon thread that runs one job at a time from its queue."""

    def __init__(self, idle: list[_Worker], lock: threading.Lock) -> None:
        self.jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._idle = idle
        self._lock = lock
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                job, name = self.jobs.get(timeout=IDLE_S)
            except queue.Empty:
                with self._lock:  # retire, unless a call picked this worker meanwhile
                    if self.jobs.empty() and self in self._idle:
                        self._idle.remove(self)
                        return
                continue
            threading.current_thread().name = name
            if not job():
                return  # the event loop is gone


_workers: RunVar[tuple[list[_Worker], threading.Lock]] = RunVar("engine_daemon_workers")


def _pool() -> tuple[list[_Worker], threading.Lock]:
    try:
        return _workers.get()
    except LookupError:
        pool: tuple[list[_Worker], threading.Lock] = ([], threading.Lock())
        _workers.set(pool)
        return pool


async def in_daemon_thread(fn: Callable[..., T], *args: Any, name: str = "engine-worker") -> T:
    """``fn(*args)`` in a daemon thread (what it raises is raised here). A cancelled
    caller abandons the thread; one that never returns dies with the process."""
    token: EventLoopToken = current_token()
    idle, lock = _pool()
    with lock:
        worker = idle.pop() if idle else None
    if worker is None:
        worker = _Worker(idle, lock)
    done = anyio.Event()
    box: list[Any] = []
    failed: list[BaseException] = []

    def finished() -> None:  # on the event loop
        done.set()
        with lock:
            idle.append(worker)

    def job() -> bool:  # in the worker; False once the event loop is gone
        try:
            box.append(fn(*args))
        except BaseException as exc:
            failed.append(exc)
        with contextlib.suppress(RuntimeError):
            anyio.from_thread.run_sync(finished, token=token)
            return True
        return False

    worker.jobs.put((job, name))
    await done.wait()
    if failed:
        raise failed[0]
    return box[0]  # type: ignore[no-any-return]
