"""``python -m engine.run --objective sft ... --then rl ...`` as a process, on the local
server it starts itself: one server for both stages, the second stage in
``<run dir>/rl`` from the first's final state, SIGINT during the second stage, then
``--resume RUN --then-steps N`` finishing it with every step once (the slow set; the
stops in either stage on the fake session: tests/test_stages.py)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.reliability_support import (
    checkpoints,
    metrics,
    read_json,
    run_cli,
    start_cli,
    wait_for_metrics,
)
from tests.tinker_env import REPO

pytestmark = pytest.mark.slow

DATA = REPO / "examples" / "sft_repeat.jsonl"
STARTED = "starting the local MinT server"


def test_sft_then_rl_is_one_command_that_resumes_in_its_second_stage(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    chain = (
        *("--objective", "sft", "--task", f"jsonl:{DATA}", "--steps", "3", "--batch", "4"),
        *("--lr", "2e-3", "--then", "rl", "--then-task", "arithmetic", "--then-steps", "30"),
        *("--then-batch", "2", "--group", "2", "--max-tokens", "4", "--checkpoint-every", "1"),
    )
    proc = start_cli([*chain, "--run-dir", str(run_dir)], cwd=tmp_path)
    try:
        wait_for_metrics(run_dir / "rl", 1, proc)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err[-3000:]
    assert out.count(STARTED) == 1 and "Stage 2 of 2: rl on arithmetic" in out
    assert [m["step"] for m in metrics(run_dir)] == [1, 2, 3]
    stopped = len(metrics(run_dir / "rl"))
    first_final = checkpoints(run_dir)[-1]
    assert first_final["reason"] == "final"
    second = read_json(run_dir / "rl" / "config.json")
    assert second["model"]["init_from"] == first_final["state_path"]

    resumed = run_cli(["--resume", str(run_dir), "--then-steps", str(stopped + 2)], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.stdout.count(STARTED) == 1 and "Stage 1" not in resumed.stdout
    assert [m["step"] for m in metrics(run_dir)] == [1, 2, 3]  # not trained again
    assert [m["step"] for m in metrics(run_dir / "rl")] == list(range(1, stopped + 3))
    final = checkpoints(run_dir / "rl")[-1]
    assert (final["reason"], final["step"]) == ("final", stopped + 2)
    assert resumed.stdout.splitlines()[-1] == f"Saved: {final['sampler_path']}"
    for stage in (run_dir, run_dir / "rl"):
        assert read_json(stage / "summary.json")["status"] == "finished"
