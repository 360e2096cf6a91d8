"""Supervised fine-tuning (``--objective sft``) against the real local server: the
training and the held-out loss fall on examples/sft_repeat.jsonl, and on either SDK
generation a run checkpoints and resumes with each step once (the slow set)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from engine.local import LocalServer
from tests.engine_support import run_engine, small_config
from tests.test_sdk_matrix import KEY, engine_run, python_of
from tests.tinker_env import REPO

DATA = REPO / "examples" / "sft_repeat.jsonl"


@pytest.fixture(scope="module")
def server() -> Iterator[LocalServer]:
    with LocalServer(api_key=KEY) as running:
        yield running


def test_sft_lowers_the_training_and_the_held_out_loss(server: LocalServer, tmp_path: Path) -> None:
    config = small_config(
        server,
        tmp_path / "run",
        api_key=KEY,
        objective="sft",
        task=f"jsonl:{DATA}",
        task_args={"eval_size": "40"},
        steps=16,
        batch=8,
        eval_every=16,
    )
    steps, result = run_engine(config)
    assert [s.step for s in steps] == list(range(1, 17))
    for step in steps:  # weights on the assistant tokens: " NN</s>" of each conversation
        weights = np.concatenate([d.loss_fn_inputs["weights"] for d in step.datums])
        assert step.metrics["sft/tokens"] == weights.sum() == 4 * len(step.datums)
    losses = [s.metrics["sft/loss"] for s in steps]
    assert np.mean(losses[-4:]) < 0.7 * np.mean(losses[:4])
    evals = [json.loads(line) for line in (result.run_dir / "eval.jsonl").open()]
    assert [e["step"] for e in evals] == [0, 16]
    assert evals[1]["eval/sft/loss"] < 0.7 * evals[0]["eval/sft/loss"]
    assert result.final_path is not None and result.final_path.startswith("tinker://")


def metric_steps(run_dir: Path) -> list[int]:
    rows = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return [row["step"] for row in rows if "sft/loss" in row]


@pytest.mark.slow
@pytest.mark.parametrize("sdk", ["mint", "tinker"])
def test_sft_trains_checkpoints_and_resumes_on_either_sdk(
    server: LocalServer, sdk: str, tmp_path: Path
) -> None:
    python_of(sdk)  # skip before anything runs
    run_dir = tmp_path / "run"
    sft = ("--objective", "sft", "--task", f"jsonl:{DATA}", "--task-arg", "eval_size=20")
    done = engine_run(
        sdk, server, *sft, "--steps", "3", "--eval-every", "3", "--run-dir", str(run_dir)
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert metric_steps(run_dir) == [1, 2, 3]
    resumed = engine_run(sdk, server, "--resume", str(run_dir), "--steps", "5")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert metric_steps(run_dir) == [1, 2, 3, 4, 5]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [i for row in rows if "problem_ids" in row for i in row["problem_ids"]]
    assert trained == list(range(10))  # batch 2: the data cursor went on, nothing twice
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").open()]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 5
    assert evals[-1]["eval/sft/loss"] < evals[0]["eval/sft/loss"]
    assert "FutureWarning" not in done.stderr + resumed.stderr
