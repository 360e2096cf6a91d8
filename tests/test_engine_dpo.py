"""Preference pairs (``--objective dpo``) against the real local server: the margin and
the accuracy rise on examples/dpo_repeat.jsonl through the mint SDK's
forward_backward_custom; a CLI run checkpoints and resumes with each step once; tinker
0.38 without torch refuses in one line (the slow set)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from engine.local import LocalServer
from tests.engine_support import run_engine, small_config
from tests.test_sdk_matrix import KEY, engine_run, python_of
from tests.tinker_env import REPO

DATA = REPO / "examples" / "dpo_repeat.jsonl"


@pytest.fixture(scope="module")
def server() -> Iterator[LocalServer]:
    with LocalServer(api_key=KEY) as running:
        yield running


def test_dpo_raises_the_margin_through_the_custom_loss(server: LocalServer, tmp_path: Path) -> None:
    config = small_config(
        server,
        tmp_path / "run",
        api_key=KEY,
        objective="dpo",
        task=f"jsonl:{DATA}",
        steps=6,
        batch=8,
        learning_rate=5e-3,
    )
    steps, result = run_engine(config)
    assert [s.step for s in steps] == list(range(1, 7))
    for step in steps:  # weights on the response tokens: " NN</s>" of each response
        weights = np.concatenate([d.loss_fn_inputs["weights"] for d in step.datums])
        assert step.metrics["dpo/tokens"] == weights.sum() == 4 * len(step.datums)
    first, last = steps[0].metrics, steps[-1].metrics
    assert first["dpo/margin"] == pytest.approx(0.0, abs=1e-3)  # the policy is the reference
    assert last["dpo/margin"] > 0.05 and last["dpo/accuracy"] > 0.5
    assert last["dpo/loss"] < first["dpo/loss"]
    assert result.final_path is not None and result.final_path.startswith("tinker://")


def metric_steps(run_dir: Path) -> list[int]:
    rows = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return [row["step"] for row in rows if "dpo/loss" in row]


@pytest.mark.slow
def test_dpo_trains_checkpoints_and_resumes_from_the_cli(
    server: LocalServer, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    dpo = ("--objective", "dpo", "--task", f"jsonl:{DATA}", "--task-arg", "eval_size=20")
    done = engine_run(
        "mint", server, *dpo, "--steps", "3", "--eval-every", "3", "--run-dir", str(run_dir)
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert metric_steps(run_dir) == [1, 2, 3]
    resumed = engine_run("mint", server, "--resume", str(run_dir), "--steps", "5")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert metric_steps(run_dir) == [1, 2, 3, 4, 5]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [i for row in rows if "problem_ids" in row for i in row["problem_ids"]]
    assert trained == list(range(10))  # batch 2: the data cursor went on, nothing twice
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").open()]
    assert [e["step"] for e in evals] == [0, 3, 5]
    assert evals[0]["eval/dpo/margin"] == pytest.approx(0.0, abs=1e-3)
    assert "Eval after step 5: eval/dpo/accuracy=" in resumed.stdout


@pytest.mark.slow
def test_tinker_without_torch_refuses_dpo_in_one_line(server: LocalServer, tmp_path: Path) -> None:
    has_torch = subprocess.run(
        [str(python_of("tinker")), "-c", "import torch"],  # skips without the environment
        capture_output=True,
        check=False,
    )
    if has_torch.returncode == 0:
        pytest.skip("the tinker environment has torch: forward_backward_custom can run there")
    done = engine_run(
        "tinker",
        server,
        "--objective",
        "dpo",
        "--task",
        f"jsonl:{DATA}",
        "--run-dir",
        str(tmp_path / "run"),
    )
    assert done.returncode == 2, done.stderr[-4000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1
    assert "forward_backward_custom" in errors[0] and "torch is not installed" in errors[0]
