"""The multi-turn benchmarks: the shares they report (pure functions of intervals), and
one tiny end-to-end run of each against a real local server (no assertion on speed)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from benchmarks import episode_runs, learning_envs, multiturn


def test_busy_share_counts_the_union_or_the_overlap_inside_the_window() -> None:
    intervals = [(0.0, 2.0), (1.0, 3.0), (5.0, 6.0), (9.0, 20.0)]
    assert episode_runs.busy_share(intervals, 0.0, 10.0) == pytest.approx(0.5)
    assert episode_runs.busy_share(intervals, 0.0, 10.0, at_least=2) == pytest.approx(0.1)
    assert episode_runs.busy_share([], 0.0, 10.0) == 0.0
    assert episode_runs.overlapping(intervals, 2) == [(1.0, 2.0)]
    assert episode_runs.overlapping(intervals, 1) == [(0.0, 3.0), (5.0, 6.0), (9.0, 20.0)]


def test_uneven_episodes_are_seeded_per_problem_and_episode() -> None:
    from engine.envs import EnvContext, StopCondition
    from engine.tasks.render import TaskContext
    from scripts.make_model import build_tokenizer

    task = multiturn.UnevenTask(tool_s=0.0)
    ctx = EnvContext(TaskContext(build_tokenizer()), StopCondition())
    problem = task.source(0).next()
    assert problem is not None
    first = task.group_builder(problem, 8, ctx)
    again = task.group_builder(problem, 8, ctx)
    lengths = [e.length for e in first.envs]  # type: ignore[attr-defined]
    assert lengths == [e.length for e in again.envs]  # type: ignore[attr-defined]
    assert all(1 <= n <= 6 for n in lengths) and len(set(lengths)) > 1


@pytest.mark.slow
def test_multiturn_quick_run_writes_results(tmp_path: Path) -> None:
    multiturn.main(
        ["--quick", "--steps", "3", "--batch", "2", "--group", "2", "--out", str(tmp_path)]
    )
    data = json.loads((tmp_path / "multiturn.json").read_text())
    assert set(data["runs"]) == set(multiturn.CONFIGS)
    for row in data["runs"].values():
        assert math.isfinite(row["steps_per_s"]) and row["steps_per_s"] > 0
        assert 0 <= row["server_idle"] <= 1 and 0 <= row["straggler_wait"] <= 1
        assert row["episodes"] == 3 * 2 * 2
    assert "batch-synchronous" in (tmp_path / "multiturn.md").read_text()


@pytest.mark.slow
def test_learning_envs_quick_run_writes_results(tmp_path: Path) -> None:
    learning_envs.main(["--quick", "--steps", "1", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "learning_envs.json").read_text())
    assert [r["env"] for r in data["runs"]] == list(learning_envs.ENVS)
    for row in data["runs"]:
        for side in ("before", "after"):
            assert 0 <= row[side]["reward"] <= 1 and 0 <= row[side]["solved"] <= 1
        assert row["held_out"] == 64


@pytest.mark.slow
def test_learning_envs_grid_evaluates_each_runs_snapshots(tmp_path: Path) -> None:
    argv = ["--envs", "calculator", "--steps", "2", "--seeds", "1", "--ks", "0,2"]
    learning_envs.main([*argv, "--curve-every", "1", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "learning_envs.json").read_text())
    assert [(r["k"], list(r["curve"])) for r in data["runs"]] == [
        (0, ["0", "1", "2"]),
        (2, ["0", "1", "2"]),
    ]
    assert [c["cell"] for c in data["summary"]] == ["ppo K=0", "ppo K=2"]
    assert all(len(r["step_end_s"]) == 2 and r["load_before"] for r in data["runs"])
    assert "ppo K=2" in (tmp_path / "learning_envs.md").read_text()
    assert (tmp_path / "learning_envs.png").stat().st_size > 0


def _grid_row(k: int, seed: int, rewards: dict[int, float], ends: list[float]) -> dict[str, Any]:
    curve = {str(step): {"reward": r, "solved": r, "tool_use": 0.0} for step, r in rewards.items()}
    last = max(rewards)
    return {
        "env": "calculator",
        "config": "ppo",
        "k": k,
        "seed": seed,
        "steps": last,
        "held_out": 64,
        "before": curve["0"],
        "after": curve[str(last)],
        "gain": rewards[last] - rewards[0],
        "curve": curve,
        "wall_s": ends[-1],
        "step_end_s": ends,
        "load_before": [1.0, 1.0, 1.0],
    }


def test_learning_grid_summary_compares_each_cell_with_k0_of_its_config() -> None:
    # K=0: 0.5 -> 0.7 -> 0.9 at steps 0, 2, 4, 2 s per step; K=2: 0.5 -> 0.9 -> 0.9 at
    # 1 s per step (reaches K=0's final 0.9 at step 2, 2 s, against K=0's 8 s).
    rows = [
        _grid_row(0, seed, {0: 0.5, 2: 0.7, 4: 0.9}, [2.0, 4.0, 6.0, 8.0]) for seed in (1, 2)
    ] + [
        _grid_row(2, 1, {0: 0.5, 2: 0.9, 4: 0.8}, [1.0, 2.0, 3.0, 4.0]),
        _grid_row(2, 2, {0: 0.5, 2: 0.9, 4: 1.0}, [1.0, 2.0, 3.0, 4.0]),
    ]
    k0, k2 = learning_envs.summarize(rows)
    assert (k0["cell"], k2["cell"]) == ("ppo K=0", "ppo K=2")
    assert k0["gain_mean"] == pytest.approx(0.4) and k0["gain_se"] == pytest.approx(0.0)
    assert k2["gain_se"] == pytest.approx(0.1)  # gains 0.3 and 0.5: sd 0.1 * sqrt(2)
    assert k2["gain_mean_vs_k0"] == pytest.approx(1.0)
    # The curve's mean gain: K=0 (0.2 + 0.4) / 2, K=2 (0.4 + 0.4) / 2.
    assert k2["curve_gain_mean_vs_k0"] == pytest.approx(0.4 / 0.3)
    assert k0["target"] == k2["target"] == pytest.approx(0.9)
    assert (k0["steps_to_target"], k0["wall_s_to_target"]) == (4, 8.0)
    assert (k2["steps_to_target"], k2["wall_s_to_target"]) == (2, 2.0)
    assert k2["wall_s_to_target_vs_k0"] == pytest.approx(0.25)
    assert k0["pace_s"] == pytest.approx(2.0) and k2["pace_s"] == pytest.approx(1.0)
    assert [p["wall_s"] for p in k2["curve"]] == [0.0, 2.0, 4.0]
    k0, k2 = learning_envs.summarize(rows, target_reward=0.6)  # a level below saturation
    assert (k0["wall_s_to_reward"], k2["wall_s_to_reward"]) == (4.0, 2.0)
    assert k2["wall_s_to_reward_vs_k0"] == pytest.approx(0.5)


def test_learning_grid_resume_keeps_the_saved_runs_measured_alike(tmp_path: Path) -> None:
    rows = [_grid_row(k, seed, {0: 0.5, 2: 0.7}, [1.0, 2.0]) for k in (0, 1) for seed in (1, 2)]
    saved = {"context": {"args": {"curve_every": 2, "latency": "mint"}}, "runs": rows}
    (tmp_path / "learning_envs.json").write_text(json.dumps({**saved, "commands": ["first"]}))
    parser = learning_envs.build_parser()
    base = ["--envs", "calculator", "--curve-every", "2", "--latency", "mint"]
    args = parser.parse_args([*base, "--ks", "0,2", "--out", str(tmp_path)])
    assert learning_envs._resumed(parser, args, 2) == (rows, ["first"])
    with pytest.raises(SystemExit) as stopped:
        learning_envs._resumed(parser, args, 4)  # other steps: refused
    assert stopped.value.code == 2
