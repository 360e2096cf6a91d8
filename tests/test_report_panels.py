"""The report follows the task and the objective: the Engine runs on the fake session
(tests/fake_session.py, the real metrics and eval writers), and its picture has a panel
for each kind of metric the run logged (the task's reward components, an environment's
episode counts and endings, held-out means; SFT's loss, distillation's reverse KL and
teacher time, preference pairs' loss, accuracy and rewards) and none for what it did not
log; no panel is drawn empty; summary.md gives the held-out first and last figures and
each objective's headline."""

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
from test_pipeline_stages import ToyProblems, ToyTask
from test_sft import ChatSession, conversations, sft_config

from engine.core.problems import Problem, RewardBreakdown
from engine.observe.headline import headline_figures
from engine.observe.run_data import load_run
from engine.observe.run_report import REPORT_PNG, draw_report, plot_report, write_html

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
    assert means is not None and [t.get_text() for t in means.get_texts()] == [
        "close",
        "exact",
        "faint: each step",
        "bold: smoothed (weight 0.6)",
    ]
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


def lines_of(ax: Any) -> dict[str, tuple[list[float], list[float]]]:
    """A panel's labelled lines: label -> (xs, ys); the faint raw line of a smoothed
    curve has no label of its own and is left out."""
    return {
        str(line.get_label()): (
            list(np.asarray(line.get_xdata(), float)),
            list(np.asarray(line.get_ydata(), float)),
        )
        for line in ax.get_lines()
        if not str(line.get_label()).startswith("_")
    }


async def test_an_sft_run_gets_its_loss_panel_and_summary_headline(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    data = conversations(tmp_path / "c.jsonl", 20)
    cfg = sft_config(run_dir, data, eval_every=2, task_args={"eval_size": "4"})
    await run(cfg, None, ChatSession())
    fig = draw_report([load_run(run_dir)])
    drawn = panels(fig)
    assert {"sft_loss", "held_out", "stage_medians", "wall_clock", "throughput"} <= set(drawn)
    # no reward, nothing sampled: no reward, staleness, loss:sum or sampling panels
    assert not {"reward", "staleness", "loss", "kl", "length", "distill_kl"} & set(drawn)
    assert_none_empty(fig)
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    loss = lines_of(drawn["sft_loss"])
    assert set(loss) == {"training", "held out"}
    assert loss["held out"] == (
        [float(e["step"]) for e in evals],
        pytest.approx([e["eval/sft/loss"] for e in evals]),
    )
    assert "tokens" in drawn["throughput"].get_title()
    # the held-out first replies: the reward of a conversation task is its `correct`
    assert drawn["held_out"].get_title().startswith("held-out means (= correct), greedy")
    bars = [t.get_text() for t in drawn["stage_medians"].get_xticklabels()]
    assert bars == ["train", "trainer\nwaits", "whole\nstep"]  # the stages it logged

    summary = (run_dir / "summary.md").read_text()
    first, last = evals[0]["eval/sft/loss"], evals[-1]["eval/sft/loss"]
    assert (
        f"- held-out loss per assistant token (eval/sft/loss), step 0 -> 4: "
        f"{first:.4f} -> {last:.4f}\n"
        f"- training loss per assistant token (sft/loss), step 1 -> 4: "
        f"{steps[0]['sft/loss']:.4f} -> {steps[-1]['sft/loss']:.4f}\n"
    ) in summary
    assert "avg reward" not in summary
    [headline, _] = json.loads((run_dir / "summary.json").read_text())["headlines"]
    assert headline == {
        "metric": "eval/sft/loss",
        "first_step": 0,
        "first": first,
        "last_step": 4,
        "last": last,
    }


async def test_a_distillation_run_gets_its_kl_and_teacher_panels(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cfg = fake_config(run_dir, objective="distill", teacher="fake-model")
    await run(cfg, ToyTask(), FakeSession())
    fig = draw_report([load_run(run_dir)])
    drawn = panels(fig)
    assert ALWAYS | {"distill_kl", "teacher"} <= set(drawn)
    assert list(drawn)[:2] == ["reward", "distill_kl"]  # the objective's signal next
    assert_none_empty(fig)
    [kl] = lines_of(drawn["distill_kl"]).values()
    assert kl[1] == pytest.approx([0.5] * 4)  # the fake student -0.5, the teacher -1.0
    assert set(lines_of(drawn["teacher"])) == {"teacher in flight", "trainer idle"}
    summary = (run_dir / "summary.md").read_text()
    assert (
        "- reverse KL to the teacher per sampled token (distill/reverse_kl), step 1 -> 4: "
        "0.5000 -> 0.5000\n- avg reward: first"
    ) in summary


def dpo_run(run_dir: Path) -> Path:
    """A preference-pair run's files, with the names ``--objective dpo`` logs."""
    run_dir.mkdir()
    steps = [
        {
            "step": i,
            "dpo/loss": 0.69 - 0.1 * i,
            "dpo/accuracy": 0.5 + 0.1 * i,
            "dpo/margin": 0.2 * i,
            "dpo/chosen_reward": 0.1 * i,
            "dpo/rejected_reward": -0.1 * i,
            "time/train": 0.3,
            "time/step": 0.4,
        }
        for i in (1, 2, 3)
    ]
    evals = [{"step": i, "eval/dpo/accuracy": 0.5 + 0.125 * i} for i in (0, 3)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in steps))
    (run_dir / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    return run_dir


def test_preference_pairs_get_loss_accuracy_and_reward_panels_and_headlines(
    tmp_path: Path,
) -> None:
    run = load_run(dpo_run(tmp_path / "dpo"))
    fig = draw_report([run])
    drawn = panels(fig)
    assert list(drawn)[:3] == ["dpo_loss", "dpo_accuracy", "dpo_rewards"]
    assert not {"reward", "held_out", "staleness", "sft_loss"} & set(drawn)
    assert_none_empty(fig)
    accuracy = lines_of(drawn["dpo_accuracy"])
    assert accuracy["held out"] == ([0.0, 3.0], pytest.approx([50.0, 87.5]))  # in %
    assert set(lines_of(drawn["dpo_rewards"])) == {"chosen", "rejected", "margin"}
    assert [f.line for f in headline_figures(run.steps, run.evals)] == [
        "held-out preference accuracy (eval/dpo/accuracy), step 0 -> 3: 50.0% -> 87.5%",
        "preference accuracy (dpo/accuracy), step 1 -> 3: 60.0% -> 80.0%",
        "reward margin, chosen - rejected (dpo/margin), step 1 -> 3: 0.2000 -> 0.6000",
    ]
    page = write_html([run], plot_report([run], tmp_path / REPORT_PNG), tmp_path / "r.html")
    assert "held-out preference accuracy (eval/dpo/accuracy)" in page.read_text()
