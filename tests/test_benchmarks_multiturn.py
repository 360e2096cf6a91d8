"""The multi-turn benchmarks: the shares they report (pure functions of intervals), and
one tiny end-to-end run of each against a real local server (no assertion on speed)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks import learning_envs, multiturn


def test_busy_share_counts_the_union_or_the_overlap_inside_the_window() -> None:
    intervals = [(0.0, 2.0), (1.0, 3.0), (5.0, 6.0), (9.0, 20.0)]
    assert multiturn.busy_share(intervals, 0.0, 10.0) == pytest.approx(0.5)
    assert multiturn.busy_share(intervals, 0.0, 10.0, at_least=2) == pytest.approx(0.1)
    assert multiturn.busy_share([], 0.0, 10.0) == 0.0
    assert multiturn._overlapping(intervals, 2) == [(1.0, 2.0)]
    assert multiturn._overlapping(intervals, 1) == [(0.0, 3.0), (5.0, 6.0), (9.0, 20.0)]


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
