"""Blocking user code in a daemon thread, abandoned on cancellation.

Why not ``anyio.to_thread.run_sync``: the interpreter joins anyio's worker threads at
exit, so a reward or a tool that never returns would keep the process alive after a
stop. A daemon thread is abandoned by a cancelled caller and dies with the process.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import anyio.from_thread
from anyio.lowlevel import current_token

__all__ = ["in_daemon_thread"]

T = TypeVar("T")


async def in_daemon_thread(fn: Callable[..., T], *args: Any, name: str = "engine-worker") -> T:
    """``fn(*args)`` in a new daemon thread (what it raises is raised here). A cancelled
    caller abandons the thread; one that never returns dies with the process."""
    token = current_token()
    done = anyio.Event()
    box: list[Any] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            box.append(fn(*args))
        except BaseException as exc:
            failed.append(exc)
        finally:
            # RuntimeError: the event loop is gone; nobody waits for this result any more.
            with contextlib.suppress(RuntimeError):
                anyio.from_thread.run_sync(done.set, token=token)

    threading.Thread(target=run, name=name, daemon=True).start()
    await done.wait()
    if failed:
        raise failed[0]
    return box[0]  # type: ignore[no-any-return]
