"""The one rollout form (issue 31): every task's groups are trajectories, from sampling to
the run directory. Run directories written before it still resume and read
(tests/fixtures/rundir_v1), and ``python -m engine.rollouts`` prints whole episodes of a
single-turn run and an environment run alike."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from engine.core.state import GROUP_FORMAT, LoopState
from engine.rollouts import main as rollouts_main

FIXTURES = Path(__file__).parent / "fixtures" / "rundir_v1"


def _run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MINT_", "TINKER_"))}
    env["HF_HUB_OFFLINE"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "engine.run", "--no-progress", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=cwd,
    )


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _pending_of(run_dir: Path) -> list[dict[str, Any]]:
    (checkpoint,) = _lines(run_dir / "checkpoints.jsonl")
    pending: list[dict[str, Any]] = checkpoint["loop_state"]["pending_groups"]
    return pending


@pytest.mark.parametrize("kind", ["arithmetic", "guess_sum"])
def test_a_checkpoint_of_the_previous_format_reads_as_trajectories(kind: str) -> None:
    pending = _pending_of(FIXTURES / kind)
    assert pending and all("format" not in g for g in pending)  # written before format 2
    state = LoopState.from_dict(_lines(FIXTURES / kind / "checkpoints.jsonl")[0]["loop_state"])
    for group, record in zip(state.pending_groups, pending, strict=True):
        if kind == "arithmetic":  # completions: one-turn trajectories of the prompt
            assert [t.turns[0].action for t in group.trajectories] == [
                tuple(c["tokens"]) for c in record["completions"]
            ]
            assert {t.turns[0].observation for t in group.trajectories} == {
                tuple(record["prompt_tokens"])
            }
            assert group.totals == [r["total"] for r in record["rewards"]]
        else:
            assert [len(t.turns) for t in group.trajectories] == [
                len(e["turns"]) for e in record["episodes"]
            ]
        assert all(t.version == record["version"] for t in group.trajectories)
        again = group.to_dict()
        assert again["format"] == GROUP_FORMAT and "completions" not in again
        assert LoopState.from_dict({**state.to_dict(), "pending_groups": [again]}).pending_groups[
            0
        ] == type(group).from_dict(again)


def _resume_trains_the_pending_step_as_the_previous_main_did(
    tmp_path: Path, kind: str, expected: dict[str, Any]
) -> None:
    run_dir = tmp_path / kind
    shutil.copytree(FIXTURES / kind, run_dir)
    # config.json names the served model by the path it had on the machine that wrote it
    # (the packaged agent model of the time, engine-local/tiny-agent, kept beside the run:
    # its checkpoints name that base model): point it at that copy.
    config = json.loads((run_dir / "config.json").read_text())
    if config["session"]["local_model"] is not None:
        config["session"]["local_model"] = str(run_dir / "agent_model")
        (run_dir / "config.json").write_text(json.dumps(config, indent=2))
    proc = _run_cli("--resume", str(run_dir), "--steps", "3", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    steps = {m["step"]: m for m in _lines(run_dir / "metrics.jsonl")}
    assert sorted(steps) == [1, 2, 3]
    step2 = steps[2]
    # what the previous main trained at step 2 from the same checkpoint (fixtures README)
    assert step2["problem_ids"] == [2, 3]
    assert step2["datums"] == expected["datums"]
    assert step2["avg_reward"] == pytest.approx(expected["avg_reward"], abs=1e-6)
    # the resumed run's own checkpoints are written in the one form
    last = _lines(run_dir / "checkpoints.jsonl")[-1]
    assert all(g["format"] == GROUP_FORMAT for g in last["loop_state"]["pending_groups"])
    assert rollouts_main([str(run_dir), "--step", "3"]) == 0


def test_an_arithmetic_run_dir_of_the_previous_main_resumes(tmp_path: Path) -> None:
    _resume_trains_the_pending_step_as_the_previous_main_did(
        tmp_path, "arithmetic", {"datums": 3, "avg_reward": 0.6923417721518988}
    )


@pytest.mark.slow
def test_a_guess_sum_run_dir_of_the_previous_main_resumes(tmp_path: Path) -> None:
    _resume_trains_the_pending_step_as_the_previous_main_did(
        tmp_path, "guess_sum", {"datums": 8, "avg_reward": 0.22916666666666669}
    )


def test_rollouts_of_the_previous_main_still_print(capsys: pytest.CaptureFixture[str]) -> None:
    assert rollouts_main([str(FIXTURES / "arithmetic"), "--step", "1"]) == 0
    out = capsys.readouterr().out
    assert out.count("step 1 - problem") == 2 and "prompt: '<s>Question: What is" in out
    assert rollouts_main([str(FIXTURES / "guess_sum"), "--step", "1"]) == 0
    out = capsys.readouterr().out
    assert "episode 0:" in out and "turn 0 (v0) new context" in out


@pytest.mark.slow
@pytest.mark.parametrize(
    ("task", "marks"),
    [
        ("arithmetic", ["prompt: '<s>Question: What is", "reward +", "adv "]),
        # one-turn episodes of one prompt print as one line each, longer ones turn by turn
        ("calculator", ["reward +", "adv "]),
    ],
)
def test_rollouts_print_whole_episodes_for_every_task_kind(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], task: str, marks: list[str]
) -> None:
    run_dir = tmp_path / "run"
    args = ("--task", task, "--steps", "2", "--batch", "2", "--group", "3")
    proc = _run_cli(*args, "--run-dir", str(run_dir), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    records = _lines(run_dir / "rollouts.jsonl")
    assert {r["format"] for r in records} == {GROUP_FORMAT}
    assert all(len(r["episodes"]) == 3 for r in records)
    turns = [t for r in records for e in r["episodes"] for t in e["turns"]]
    assert all({"observation", "action", "sampler_version"} <= t.keys() for t in turns)
    assert rollouts_main([str(run_dir), "--step", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("step 2 - problem") == 2
    for mark in marks:
        assert mark in out
