"""The CLI's last resort against a blocked event loop: decisions on an injected clock,
and one real run whose async reward never awaits, stopped by SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from engine.supervision.loop_monitor import LoopMonitor
from tests.clock import SetTime

ROOT = Path(__file__).resolve().parent.parent


def test_a_running_loop_is_left_alone_even_after_a_signal() -> None:
    clock = SetTime(100.0)
    monitor = LoopMonitor(blocked_limit=60, after_signal=10, clock=clock)
    monitor.note_signal(signal.SIGTERM)
    for _ in range(30):  # the graceful stop takes its time, but the loop keeps beating
        clock.now += 1
        monitor._last_beat = clock.now
        assert monitor.check() is None


def test_a_signal_to_a_blocked_loop_exits_after_the_grace() -> None:
    clock = SetTime(100.0)
    monitor = LoopMonitor(blocked_limit=600, after_signal=10, clock=clock)
    clock.now += 3
    monitor.note_signal(signal.SIGTERM)
    clock.now += 9.9
    assert monitor.check() is None
    clock.now += 0.1
    verdict = monitor.check()
    assert verdict is not None
    message, code = verdict
    assert code == 128 + signal.SIGTERM
    assert message.startswith("Error: SIGTERM received but the event loop has been blocked")


def test_a_second_signal_to_a_blocked_loop_exits_at_once() -> None:
    clock = SetTime(100.0)
    monitor = LoopMonitor(blocked_limit=600, after_signal=10, clock=clock)
    clock.now += 1
    monitor.note_signal(signal.SIGINT)
    monitor.note_signal(signal.SIGINT)
    verdict = monitor.check()
    assert verdict is not None and verdict[1] == 128 + signal.SIGINT


def test_a_loop_blocked_past_the_stall_timeout_exits_1() -> None:
    clock = SetTime(100.0)
    monitor = LoopMonitor(blocked_limit=60, clock=clock)
    clock.now += 59
    assert monitor.check() is None
    clock.now += 1
    verdict = monitor.check()
    assert verdict is not None and verdict[1] == 1
    assert "blocked for 60 s" in verdict[0]


def _sigterm_once_reward_runs(tmp_path: Path, task_source: str) -> tuple[int, str]:
    """Run ``engine.run`` with the task ``TheTask`` defined by ``task_source`` (whose reward
    prints "in the reward" before it blocks); SIGTERM it once the reward runs. Returns the
    exit code and the rest of stderr."""
    (tmp_path / "the_task.py").write_text(textwrap.dedent(task_source))
    args = ["--task", "the_task:TheTask", "--steps", "2", "--batch", "2", "--group", "2"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine.run", *args, "--run-dir", str(tmp_path / "run")],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": f"{tmp_path}:{ROOT}"},
    )
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            if "in the reward" in line:
                break
        proc.send_signal(signal.SIGTERM)
        rest = proc.stderr.read()
        return proc.wait(timeout=120), rest
    finally:
        proc.kill()


@pytest.mark.slow
def test_sigterm_stops_a_run_whose_async_reward_never_awaits(tmp_path: Path) -> None:
    code, rest = _sigterm_once_reward_runs(
        tmp_path,
        """
        import sys
        from engine.tasks import ArithmeticTask

        class TheTask(ArithmeticTask):
            async def score(self, response, problem):
                print("in the reward", file=sys.stderr, flush=True)
                while True:
                    pass
        """,
    )
    assert code == 128 + signal.SIGTERM
    assert "SIGTERM received but the event loop has been blocked" in rest
    assert "Traceback" not in rest


@pytest.mark.slow
def test_sigterm_stops_a_run_whose_sync_reward_never_returns(tmp_path: Path) -> None:
    """The stop abandons the reward's worker thread (a daemon): the run writes its
    summary and the process exits instead of waiting for the thread forever."""
    code, rest = _sigterm_once_reward_runs(
        tmp_path,
        """
        import sys
        import threading
        from engine.tasks import ArithmeticTask

        class TheTask(ArithmeticTask):
            def score(self, response, problem):
                print("in the reward", file=sys.stderr, flush=True)
                threading.Event().wait()
        """,
    )
    assert code == 130
    assert "Traceback" not in rest
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "interrupted"
