"""``in_daemon_thread``: user code in daemon threads that are kept for the next call,
never shared by two calls at once, and retired once idle."""

from __future__ import annotations

import threading

import anyio
import pytest

from engine.common import threads
from engine.common.threads import in_daemon_thread
from tests.reliability_support import until

pytestmark = pytest.mark.anyio


async def test_a_call_reuses_the_thread_an_earlier_call_left_idle() -> None:
    first = await in_daemon_thread(threading.get_ident, name="engine-first")
    second = await in_daemon_thread(lambda: threading.current_thread(), name="engine-second")
    assert second.ident == first and second.daemon and second.name == "engine-second"


async def test_a_call_never_waits_behind_one_that_hangs() -> None:
    release = threading.Event()
    hung: list[int] = []

    def hang() -> None:
        hung.append(threading.get_ident())
        release.wait()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(in_daemon_thread, hang)
            await until(lambda: bool(hung))
            tg.cancel_scope.cancel()  # abandoned, still running
        other = await in_daemon_thread(threading.get_ident)
        assert other != hung[0]
    finally:
        release.set()


async def test_what_the_call_raises_is_raised_to_the_caller() -> None:
    def fail() -> None:
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        await in_daemon_thread(fail)


async def test_an_idle_thread_retires(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(threads, "IDLE_S", 0.01)
    thread = await in_daemon_thread(threading.current_thread, name="engine-retiring")
    await until(lambda: not thread.is_alive())
    again = await in_daemon_thread(threading.current_thread)
    assert again is not thread
