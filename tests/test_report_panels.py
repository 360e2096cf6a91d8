"""The report follows the task: the Engine runs on the fake session (tests/fake_session.py,
the real metrics and eval writers), and its picture has a panel for each kind of metric
the run logged (the task's reward components, an environment's episode counts and
endings, held-out means) and none for what it did not log; no panel is drawn empty;
summary.md gives the held-out first and last figures."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fake_session import FakeSession
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from test_engine_fake_session import HeldOutCountdown, fake_config, run
from test_pipeline_stages import ToyProblems

from engine.core.problems import Problem, RewardBreakdown
from engine.observe.report import REPORT_PNG, draw_report, load_run

pytestmark = pytest.mark.anyio

ALWAYS = {"reward", "loss", "staleness", "length", "fractions", "stage_medians", "wall_clock"}
ENVIRONMENT = {"episodes", "endings"}


class ComponentTask(ToyProblems):
    """A user's task with two components: ``exact`` (0/1: the response's number is odd)
    and ``close`` (shaped: 0.5 for an even number, 1 for an odd one); held-out
    problems 0..3."""

    def score(self, response: str, problem: Problem) -> RewardBreakdown:
        exact = float(int(response.split()[1]) % 2)
        close = 0.5 + 0.5 * exact
        return RewardBreakdown(exact + close, {"exact": exact, "close": close})

    def eval_problems(self) -> list[Problem]:
        return [Problem(i, f"held out {i}", i) for i in range(4)]


def panels(fig: Figure) -> dict[str, Any]:
    """The report's axes by panel key (each axes' gid)."""
    return {str(ax.get_gid()): ax for ax in fig.axes}


def assert_none_empty(fig: Figure) -> None:
    for ax in fig.axes:
        values = [y for line in ax.get_lines() for y in np.asarray(line.get_ydata(), float)]
        values += [bar.get_height() for bar in ax.patches if isinstance(bar, Rectangle)]
        finite = [v for v in values if math.isfinite(v)]
        assert finite, f"panel {ax.get_gid()!r} is empty"
        assert ax.get_title(), f"panel {ax.get_gid()!r} has no title"


async def test_a_task_with_components_gets_their_panels_and_held_out_means(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    await run(fake_config(run_dir, eval_every=2), ComponentTask(), FakeSession())
    assert (run_dir / REPORT_PNG).is_file()  # drawn when the run finished
    fig = draw_report([load_run(run_dir)])
    drawn = panels(fig)
    assert ALWAYS | {"components", "component_rates", "held_out", "kl"} <= set(drawn)
    assert not ENVIRONMENT & set(drawn)  # no episodes: no environment panels
    assert_none_empty(fig)
    means = drawn["components"].get_legend()
    assert means is not None and [t.get_text() for t in means.get_texts()] == ["close", "exact"]
    rates = drawn["component_rates"].get_legend()  # exact's rate is its mean: drawn once
    assert rates is None and len(drawn["component_rates"].get_lines()) == 1

    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    held_out = {line.get_label(): line for line in drawn["held_out"].get_lines()}
    assert set(held_out) == {"reward", "close", "exact"}
    for label, name in (("reward", "eval/reward/total"), ("close", "eval/close")):
        line = held_out[label]
        assert list(np.asarray(line.get_xdata())) == [e["step"] for e in evals]
        assert list(np.asarray(line.get_ydata())) == pytest.approx([e[name] for e in evals])
    assert any(e["eval/close/rate"] != e["eval/close"] for e in evals)  # means, not rates

    summary = (run_dir / "summary.md").read_text()
    first, last = evals[0], evals[-1]
    assert (
        f"- held-out (greedy, 4 problems), step 0 -> {last['step']}: "
        f"reward {first['eval/reward/total']:.3f} -> {last['eval/reward/total']:.3f}, "
        f"close {first['eval/close']:.3f} -> {last['eval/close']:.3f}"
    ) in summary
    recorded = json.loads((run_dir / "summary.json").read_text())["held_out"]
    assert recorded["first"]["step"] == 0 and recorded["last"]["exact"] == last["eval/exact"]


async def test_an_environment_gets_its_episode_panels_and_no_component_panels(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    await run(fake_config(run_dir, eval_every=2), HeldOutCountdown(), FakeSession())
    fig = draw_report([load_run(run_dir)])
    drawn = panels(fig)
    assert ALWAYS | ENVIRONMENT | {"held_out"} <= set(drawn)
    assert not {"components", "component_rates"} & set(drawn)
    assert_none_empty(fig)
    episodes = drawn["episodes"].get_lines()
    assert episodes[0].get_label() == "turns_per_episode"
    endings = {line.get_label() for line in drawn["endings"].get_lines()}
    assert "done" in endings and "timeout" not in endings  # the outcomes that happened
    held_out = drawn["held_out"].get_lines()
    assert [line.get_label() for line in held_out] == [
        "reward",
        "reward, sampled (--eval-samples)",
    ][: len(held_out)]
    assert (
        "- held-out (greedy, 3 problems), step 0 -> 4: reward 2.000 -> 2.000"
        in (run_dir / "summary.md").read_text()
    )


async def test_a_run_without_evaluations_has_no_held_out_panel_or_line(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    await run(fake_config(run_dir), ComponentTask(), FakeSession())
    fig = draw_report([load_run(run_dir)])
    assert "held_out" not in panels(fig)
    assert_none_empty(fig)
    assert "held-out" not in (run_dir / "summary.md").read_text()
    assert json.loads((run_dir / "summary.json").read_text())["held_out"] is None
