"""``engine.report``: smoothing, reading run directories, the picture and the page, one
run and several overlaid, and the command line."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine.config import EngineConfig
from engine.errors import ConfigError
from engine.observe.run_data import load_run
from engine.observe.run_report import (
    REPORT_HTML,
    REPORT_PNG,
    draw_report,
    finished_run_report,
    smooth,
)
from engine.report import main
from engine.rundir.directory import config_record, write_config

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def step_metrics(step: int, reward: float, staleness: int = 0) -> dict[str, Any]:
    """A metrics.jsonl line with the names the engine writes."""
    return {
        "step": step,
        "avg_reward": reward,
        "exact_rate": reward / 2,
        "off_policy/staleness": staleness,
        "optim/kl_sample_train_v1": None if step == 1 else 0.01 * step,
        "optim/kl_sample_train_v2": 0.002,
        "time/sample": 0.2,
        "time/score": 0.01,
        "time/train": 0.3,
        "time/wait": 0.1,
        "time/step": 0.5,
        "throughput/samples_per_s": 90.0 + step,
        "problem_ids": [0, 1],
        "event": "step",
        "level": "info",
    }


def make_run(run_dir: Path, rewards: list[float], staleness: int = 0) -> Path:
    run_dir.mkdir(parents=True)
    lines = [json.dumps(step_metrics(i + 1, r, staleness)) for i, r in enumerate(rewards)]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return run_dir


def add_evals(run_dir: Path, steps: list[int]) -> Path:
    """eval.jsonl as --eval-every writes it (step 0 is the start)."""
    records = [
        {
            "step": step,
            "sampler_version": step,
            "eval/problems": 10,
            "eval/reward_errors": 0,
            "eval/reward/total": 0.3 + 0.01 * step,
            "eval/correct": 0.2 + 0.01 * step,
            "eval/correct/rate": 0.2 + 0.01 * step,
            "eval/format/rate": 0.9,
        }
        for step in steps
    ]
    (run_dir / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run_dir


def test_smoothing_is_a_debiased_moving_average_that_skips_gaps() -> None:
    assert smooth([2.0, 2.0, 2.0], 0.9) == pytest.approx([2.0, 2.0, 2.0])
    assert smooth([1.0, None, 3.0], 0.0) == [1.0, None, 3.0]
    smoothed = smooth([0.0, 1.0, 1.0, 1.0], 0.5)
    assert smoothed[0] == 0.0
    second, third, fourth = smoothed[1], smoothed[2], smoothed[3]
    assert second is not None and third is not None and fourth is not None
    assert 0.0 < second < third < fourth < 1.0


def test_a_run_directory_is_read_and_a_torn_last_line_is_ignored(tmp_path: Path) -> None:
    run = make_run(tmp_path / "a", [0.5, 0.6])
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "avg_rew')  # killed mid-write
    data = load_run(run)
    assert [m["step"] for m in data.steps] == [1, 2]
    assert data.series("optim/kl_sample_train_v1") == ([1, 2], [None, 0.02])
    assert data.summary is None


def test_a_directory_without_steps_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a run directory"):
        load_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ConfigError, match="holds no steps"):
        load_run(tmp_path)


def panels(fig: Any) -> dict[str, Any]:
    """The report's axes by panel key (each axes' gid)."""
    return {str(ax.get_gid()): ax for ax in fig.axes}


def test_several_runs_are_overlaid_one_colour_each(tmp_path: Path) -> None:
    runs = [
        load_run(make_run(tmp_path / "k0", [0.5, 0.6, 0.7])),
        load_run(make_run(tmp_path / "k1", [0.4, 0.5, 0.8, 0.9], staleness=1)),
    ]
    fig = draw_report(runs)
    reward_axes = fig.axes[0]
    assert reward_axes.get_gid() == "reward"
    lines = reward_axes.get_lines()
    assert len(lines) == 4  # raw and smoothed per run
    assert [len(np.asarray(line.get_xdata())) for line in lines] == [3, 3, 4, 4]
    assert lines[0].get_color() == lines[1].get_color() != lines[2].get_color()
    legend = reward_axes.get_legend()
    assert legend is not None
    assert [t.get_text() for t in legend.get_texts()] == [
        "k0",
        "k1",
        "faint: each step",
        "bold: smoothed (weight 0.6)",
    ]
    assert len(panels(fig)["stage_medians"].patches) == 2 * 5  # five stage bars per run


def test_a_panel_is_drawn_only_when_its_metrics_are_logged(tmp_path: Path) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": i, "avg_reward": 0.1 * i}) + "\n" for i in (1, 2, 3))
    )
    assert set(panels(draw_report([load_run(bare)]))) == {"reward"}
    plain = load_run(make_run(tmp_path / "plain", [0.5, 0.6, 0.7]))
    assert set(panels(draw_report([plain]))) == {
        "reward",
        "kl",
        "staleness",
        "stage_medians",
        "throughput",
    }
    logged = make_run(tmp_path / "logged", [0.5, 0.6, 0.7])
    lines = [json.loads(line) for line in (logged / "metrics.jsonl").read_text().splitlines()]
    for m in lines:
        m.update({"optim/entropy": 0.8, "optim/grad_norm": 1.5, "optim/loss": 0.2})
        m.update({"optim/trained_tokens": 40})
    (logged / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    drawn = panels(draw_report([load_run(logged)]))
    assert {"entropy", "grad_norm", "loss"} <= set(drawn)
    assert list(np.asarray(drawn["grad_norm"].get_lines()[0].get_ydata())) == [1.5] * 3


def test_a_component_that_is_the_whole_reward_is_named_not_drawn_twice(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path / "jsonl", [0.25, 0.5])
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for m in lines:  # a dataset task's reward preset: correct is 0 or 1, the whole reward
        m.update({"env/all/correct": m["avg_reward"], "env/all/correct/rate": m["avg_reward"]})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    evals = [json.loads(line) for line in add_evals(run_dir, [0, 2]).joinpath("eval.jsonl").open()]
    for e in evals:
        e["eval/correct"] = e["eval/correct/rate"] = e["eval/reward/total"]
    (run_dir / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    drawn = panels(draw_report([load_run(run_dir)]))
    assert not {"components", "component_rates"} & set(drawn)
    assert drawn["reward"].get_title() == "mean reward per step (= correct)"
    assert [line.get_label() for line in drawn["held_out"].get_lines()] == ["reward"]
    assert "(= correct)" in drawn["held_out"].get_title()


def test_held_out_evaluations_get_their_own_panel_of_means(tmp_path: Path) -> None:
    plain = load_run(make_run(tmp_path / "plain", [0.5, 0.6, 0.7, 0.8]))
    assert plain.evals == [] and "held_out" not in panels(draw_report([plain]))
    evaluated = add_evals(make_run(tmp_path / "eval", [0.5, 0.6, 0.7, 0.8]), [0, 2, 4])
    with (evaluated / "eval.jsonl").open("a") as f:
        f.write('{"step": 6, "eval/rew')  # killed mid-write
    runs = [load_run(evaluated), plain]
    steps, rewards = runs[0].eval_series("eval/reward/total")
    assert steps == [0, 2, 4] and rewards == pytest.approx([0.3, 0.32, 0.34])
    fig = draw_report(runs)
    held_out = panels(fig)["held_out"]
    [line] = held_out.get_lines()  # the run without evaluations draws none; no components
    assert list(np.asarray(line.get_xdata())) == [0, 2, 4]
    assert list(np.asarray(line.get_ydata())) == pytest.approx([0.3, 0.32, 0.34])
    assert list(line.get_color()) == list(fig.axes[0].get_lines()[0].get_color())


def test_the_command_writes_a_picture_and_a_self_contained_page(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = make_run(tmp_path / "one" / "run", [0.5, 0.6, 0.7])
    second = add_evals(make_run(tmp_path / "two" / "run", [0.4, 0.8]), [0, 2])
    (second / "summary.json").write_text(json.dumps({"status": "finished"}))
    out = tmp_path / "cmp"
    assert main([str(first), str(second), "--out", str(out)]) == 0
    assert capsys.readouterr().out.split() == [str(out / REPORT_PNG), str(out / REPORT_HTML)]
    png = (out / REPORT_PNG).read_bytes()
    assert png.startswith(PNG_MAGIC)
    page = (out / REPORT_HTML).read_text()
    embedded = page.split("data:image/png;base64,")[1].split("'")[0]
    assert base64.b64decode(embedded) == png
    assert "src='http" not in page and "<link" not in page  # nothing fetched
    # Same directory names: the labels are the paths; the summary's status is shown.
    assert str(first) in page and str(second) in page and "finished" in page
    assert "<td>0.300 / 0.320</td>" in page  # held-out reward, first / last evaluation


def test_one_run_is_drawn_into_its_own_directory(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", [0.5, 0.6])
    assert main([str(run)]) == 0
    assert (run / REPORT_PNG).read_bytes().startswith(PNG_MAGIC)
    assert (run / REPORT_HTML).exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["{missing}"], "is not a run directory"),
        (["{run}", "--smoothing", "1"], "--smoothing must be in [0, 1)"),
        ([], "the following arguments are required: RUN_DIR"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    run = make_run(tmp_path / "run", [0.5])
    argv = [a.format(missing=tmp_path / "nope", run=run) for a in args]
    try:
        status = main(argv)
    except SystemExit as exc:  # argparse's errors
        status = int(str(exc.code))
    assert status == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_a_finished_run_report_never_raises(tmp_path: Path) -> None:
    note = finished_run_report(tmp_path)
    assert note is not None
    assert note.startswith("No report.png: ") and "python -m engine.report" in note


def test_response_panels_label_what_each_run_has_and_a_run_that_trained_nothing_says_so(
    tmp_path: Path,
) -> None:
    trained = make_run(tmp_path / "trained", [0.5, 0.6])
    lines = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
    for metrics in lines:
        metrics.update({"datums": 8, "response_len/mean": 4.0, "response_len/max": 6})
        metrics.update({"groups/trained_frac": 0.5, "response_len/truncated_frac": 0.25})
    (trained / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    idle = make_run(tmp_path / "idle", [0.0, 0.0])
    lines = [json.loads(line) for line in (idle / "metrics.jsonl").read_text().splitlines()]
    for metrics in lines:
        metrics.update({"datums": 0, "groups/trained_frac": 0.0, "response_len/empty_frac": 1.0})
        metrics.update({"optim/kl_sample_train_v1": None, "optim/kl_sample_train_v2": None})
    (idle / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    runs = [load_run(trained), load_run(idle)]
    assert runs[0].trained_nothing is None
    assert (
        runs[1].trained_nothing is not None
        and "every response was empty" in runs[1].trained_nothing
    )

    fig = draw_report(runs)
    drawn = panels(fig)
    ax_len, ax_frac = drawn["length"], drawn["fractions"]
    len_legend, frac_legend = ax_len.get_legend(), ax_frac.get_legend()
    assert len_legend is not None and frac_legend is not None
    assert [t.get_text() for t in len_legend.get_texts()] == [
        "trained: mean",
        "trained: max",
    ]
    assert [t.get_text() for t in frac_legend.get_texts()] == [
        "trained: trained groups",
        "trained: truncated responses",
        "idle: trained groups",
        "idle: empty responses",
    ]
    assert "idle trained nothing: every response was empty" in fig.get_suptitle()
    assert "kl" not in panels(draw_report([runs[1]]))  # no trained step: no KL panel


def with_config(run_dir: Path, **settings: Any) -> Path:
    """The run's config.json as the engine writes it."""
    write_config(run_dir, config_record(EngineConfig(**settings), None))
    return run_dir


def test_the_title_says_what_each_run_trained_so_two_reports_differ(tmp_path: Path) -> None:
    common = {"base_model": "Qwen/Qwen3-0.6B", "loss": "cispo", "batch": 4, "group": 3}
    k0 = with_config(
        make_run(tmp_path / "a" / "run", [0.5, 0.6]),
        **common,
        learning_rate=4e-5,
        max_steps_off_policy=0,
    )
    k2 = with_config(
        make_run(tmp_path / "b" / "run", [0.5, 0.6]),
        **common,
        learning_rate=1e-4,
        max_steps_off_policy=2,
    )
    titles = [draw_report([load_run(d)]).get_suptitle() for d in (k0, k2)]
    assert titles[0] == (
        "run\nmodel Qwen/Qwen3-0.6B, task arithmetic, objective rl (loss cispo), lr 4e-05, "
        "K=0, batch 4, group 3"
    )
    assert titles[1].endswith("lr 0.0001, K=2, batch 4, group 3")
    overlaid = draw_report([load_run(k0, "k0"), load_run(k2, "k2")]).get_suptitle()
    assert overlaid.splitlines() == [
        "k0: " + titles[0].splitlines()[1],
        "k2: " + titles[1].splitlines()[1],
    ]


def test_a_run_that_samples_nothing_shows_no_k_and_a_bad_config_shows_nothing(
    tmp_path: Path,
) -> None:
    sft = with_config(make_run(tmp_path / "sft", [0.5]), objective="sft", learning_rate=1e-3)
    title = draw_report([load_run(sft)]).get_suptitle()
    assert title.endswith("objective sft, lr 0.001") and "K=" not in title
    odd = make_run(tmp_path / "odd", [0.5, 0.6])
    (odd / "config.json").write_text(
        json.dumps(
            {"model": {"base_model": "x\n" * 500}, "training": {"learning_rate": float("nan")}}
        )
    )
    assert draw_report([load_run(odd)]).get_suptitle() == "odd\nmodel " + "x " * 29 + "x"
    (odd / "config.json").write_text("[1, 2]")
    assert draw_report([load_run(odd)]).get_suptitle() == "odd"


def test_step_axes_of_a_short_run_have_whole_step_ticks(tmp_path: Path) -> None:
    fig = draw_report([load_run(make_run(tmp_path / "short", [0.5, 0.6, 0.7]))])
    step_axes = [ax for ax in fig.axes if ax.get_xlabel() == "step"]
    assert len(step_axes) >= 4
    for ax in step_axes:
        ticks = [t for t in ax.get_xticks() if 1 <= t <= 3]
        assert ticks == [1.0, 2.0, 3.0], (ax.get_gid(), list(ax.get_xticks()))


def test_one_run_draws_each_line_of_a_panel_in_its_own_colour_and_keys_faint_and_bold(
    tmp_path: Path,
) -> None:
    fig = draw_report([load_run(make_run(tmp_path / "one", [0.5, 0.6, 0.7]))])
    kl = panels(fig)["kl"].get_lines()
    colours = [line.get_color() for line in kl if line.get_label() in ("v1", "v2")]
    assert len(colours) == 2 and colours[0] != colours[1]
    legend = panels(fig)["reward"].get_legend()
    assert legend is not None  # one run: the title names it, the legend the two lines
    assert [t.get_text() for t in legend.get_texts()] == [
        "faint: each step",
        "bold: smoothed (weight 0.6)",
    ]
    faint, bold = legend.get_lines()
    assert faint.get_linewidth() < bold.get_linewidth()


def test_the_rl_loss_is_drawn_per_trained_token(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path / "run", [0.5, 0.6])
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for metrics, (loss, tokens) in zip(lines, [(-780.0, 1560), (120.0, 400)], strict=True):
        metrics.update({"optim/loss": loss, "optim/trained_tokens": tokens})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    ax = panels(draw_report([load_run(run_dir)]))["loss"]
    assert "per trained token" in ax.get_title() and "loss:sum" in ax.get_title()
    assert list(np.asarray(ax.get_lines()[0].get_ydata())) == pytest.approx([-0.5, 0.3])
