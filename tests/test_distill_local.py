"""On-policy distillation (``--objective distill``) against the real local server: a
teacher trained by RL scores every token the student samples, and on either SDK
generation a distillation run checkpoints and resumes with each step once; a teacher
the server cannot open with the student's tokenizer is refused in one line (exit 2)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from engine.local import LocalServer
from tests.engine_support import run_engine, small_config
from tests.test_sdk_matrix import KEY, engine_run, python_of


@pytest.fixture(scope="module")
def server() -> Iterator[LocalServer]:
    with LocalServer(api_key=KEY) as running:
        yield running


@pytest.fixture(scope="module")
def teacher(server: LocalServer, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The sampler weights of a short RL run (a teacher that differs from the base)."""
    config = small_config(server, tmp_path_factory.mktemp("teacher") / "run", api_key=KEY)
    _, result = run_engine(config.replace(steps=4))
    assert result.final_path is not None
    return result.final_path


@pytest.mark.slow
def test_every_sampled_token_is_scored_by_the_teacher_and_trained_toward_it(
    server: LocalServer, teacher: str, tmp_path: Path
) -> None:
    config = small_config(
        server, tmp_path / "run", api_key=KEY, objective="distill", teacher=teacher
    )
    steps, result = run_engine(config)
    assert [s.step for s in steps] == [1, 2, 3]
    for step in steps:
        turns = [t for g in step.groups for e in g.trajectories for t in e.turns]
        assert all(
            t.teacher_logprobs is not None and len(t.teacher_logprobs) == len(t.action)
            for t in turns
        )
        assert all(lp <= 0.0 for t in turns for lp in t.teacher_logprobs or ())
        sampled = sum(len(t.action) for t in turns)
        assert step.metrics["distill/tokens"] == sampled
        pairs = [
            (s, t)
            for turn in turns
            for s, t in zip(turn.logprobs or (), turn.teacher_logprobs or (), strict=True)
        ]
        expected = np.mean([s - t for s, t in pairs])
        assert step.metrics["distill/reverse_kl"] == pytest.approx(expected, abs=1e-6)
        assert step.metrics["distill/teacher_s"] > 0.0
        advantages = np.concatenate([d.loss_fn_inputs["advantages"] for d in step.datums])
        weights = np.concatenate([d.loss_fn_inputs["weights"] for d in step.datums])
        assert np.all(advantages[weights == 0] == 0)
        assert len(np.unique(advantages[weights > 0])) > 2  # per token, not per response
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").open()]
    assert all("distill/teacher_frac" in row for row in rows)


def test_a_teacher_of_another_model_is_refused_in_one_line(
    server: LocalServer, tmp_path: Path
) -> None:
    done = engine_run(
        "mint",
        server,
        "--objective",
        "distill",
        "--teacher",
        "some-org/another-model",
        "--steps",
        "1",
        "--run-dir",
        str(tmp_path / "run"),
    )
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "--teacher some-org/another-model" in errors[0]
    assert "tokenizer" in errors[0]


def distilled_steps(run_dir: Path) -> list[int]:
    rows = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return [row["step"] for row in rows if "distill/reverse_kl" in row]


@pytest.mark.slow
@pytest.mark.parametrize("sdk", ["mint", "tinker"])
def test_distillation_trains_checkpoints_and_resumes_on_either_sdk(
    server: LocalServer, teacher: str, sdk: str, tmp_path: Path
) -> None:
    python_of(sdk)  # skip before anything runs
    run_dir = tmp_path / "run"
    distill = ("--objective", "distill", "--teacher", teacher, "--checkpoint-every", "1")
    done = engine_run(sdk, server, *distill, "--steps", "3", "--run-dir", str(run_dir))
    assert done.returncode == 0, done.stderr[-4000:]
    assert distilled_steps(run_dir) == [1, 2, 3]
    assert "reverse_kl=" in done.stdout
    resumed = engine_run(sdk, server, "--resume", str(run_dir), "--steps", "5")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert distilled_steps(run_dir) == [1, 2, 3, 4, 5]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [i for row in rows if "problem_ids" in row for i in row["problem_ids"]]
    assert trained == list(range(10))  # batch 2: each problem once across the resume
    assert "FutureWarning" not in done.stderr + resumed.stderr
