"""The learning benchmark runs end to end (``--quick``: 2 steps, 20 held-out problems) and
writes a well-formed report. No assertion on the gain: that is measured by the full run
(benchmarks/results/learning.json), not by the test suite."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import engine_cli, learning
from engine.session.preflight import local_server_profile


def test_quick_run_writes_a_well_formed_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "learning.json"
    assert learning.main(["--quick", "--out", str(out)]) == 0
    report = json.loads(out.read_text())

    assert report["eval"]["heldout"] == 20 and report["eval"]["temperature"] == 0.0
    assert report["eval"]["stop_at_eos"] is True
    assert report["train"]["steps"] == 2
    [run] = report["runs"]
    assert run["steps"] == 2 and run["seed"] == 42
    assert run["final_path"].startswith("tinker://")
    # the settings the server recommends, not the hosted ones
    recommended = local_server_profile(None)
    assert "arithmetic-add" in run["final_path"]
    assert (run["learning_rate"], run["lora_rank"]) == (
        recommended.learning_rate,
        recommended.lora_rank,
    )
    for key in ("exact_before", "exact_after"):
        assert 0.0 <= run[key] <= 1.0
        assert run[key] * 20 == pytest.approx(round(run[key] * 20))  # k of 20 problems
    assert run["delta"] == pytest.approx(run["exact_after"] - run["exact_before"])
    assert run["wall_s"] > 0
    # the held-out curve: step 1 from the run's version-1 snapshot, step 2 = "after"
    assert set(run["curve"]) == {"1", "2"}
    assert run["curve"]["2"] == run["exact_after"]
    summary, quickstart = report["summary"]
    assert set(summary["mean_gain_by_step"]) == {"1", "2"}
    # each step's end is timed; the quickstart loop's pace is measured beside it
    assert len(run["step_end_s"]) == 2 and 0 < run["step_end_s"][0] < run["step_end_s"][1]
    assert quickstart["config"] == "quickstart loop" and report["quickstart_timing"]["step_s"] > 0

    printed = capsys.readouterr().out
    assert "| config | seed | steps | exact before | exact after | delta | wall time |" in printed
    assert f"{run['exact_before']:.1%}" in printed


def test_heldout_problems_are_distinct_and_never_trained_on() -> None:
    steps, batch, seeds = 30, 8, [42, 7]
    task = learning.served_task(local_server_profile(None).task_args)
    problems = learning.heldout_problems(task, 200, seeds, steps, batch)
    assert len(set(problems)) == 200
    lo, hi = task.min_operand, task.max_operand
    assert all(lo <= a <= hi and lo <= b <= hi for a, b in problems)
    for seed in seeds:
        source = task.source(seed)
        trained = {learning._operands(source.next().question) for _ in range(steps * batch)}
        assert trained.isdisjoint(problems)


def test_bad_flags_are_refused_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, message in [
        (["--seeds", "4x"], "not a comma-separated list of integers"),
        (["--heldout", "0"], "must be positive"),
        (["--configs", "k9"], "unknown config k9"),
        (["--seeds", str(learning.HELDOUT_SEED)], "is the held-out seed"),
        (["--configs", "k1,gspo"], "--configs gspo needs --sdk tinker"),
        (["--sdk", "tinker", "--configs", "control"], "--configs control needs --sdk mint"),
        (["--sdk", "tinker", "--tinker-python", "/nonexistent/python"], "no /nonexistent/python"),
    ]:
        with pytest.raises(SystemExit) as info:
            learning.parse_args(argv)
        assert info.value.code == 2
        assert message in capsys.readouterr().err


def test_the_table_of_several_seeds_leaves_the_derived_quickstart_row_out() -> None:
    run = {"steps": 2, "exact_before": 0.3, "exact_after": 0.4, "delta": 0.1, "wall_s": 3}
    measured = {
        "config": "k0",
        "seeds": 2,
        "mean_exact_after": 0.4,
        "mean_delta": 0.1,
        "min_delta": 0.1,
        "seeds_improved": 2,
        "mean_gain_by_step": {"1": 0.1},
        "target_gain": 0.08,
        "steps_to_target_gain": 1,
        "wall_s_to_target_gain": 2.0,
    }
    derived = {
        "config": "quickstart loop",
        "seeds": 0,
        "target_gain": 0.08,
        "steps_to_target_gain": 1,
        "wall_s_to_target_gain": 4.0,
        "derived": "K=0's steps at the quickstart loop's pace",
    }
    report = {
        "latency": "mint",
        "runs": [{**run, "config": "k0", "seed": 1}, {**run, "config": "k0", "seed": 2}],
        "summary": [measured, derived],
    }
    table = learning.markdown_table(report)
    assert "| k0 | 2 | 40.0% | +10.0% | +10.0% | 2/2 |" in table
    quickstart = "| quickstart loop | K=0's steps at the quickstart loop's pace | 1 (+8%) | 4.0 s |"
    assert quickstart in table


def test_a_cli_runs_step_ends_count_from_its_first_step_start() -> None:
    steps = [
        {"time": "2026-12-01T12:00:10.500000Z", "time/step": 1.5},
        {"time": "2026-12-01T12:00:11.250000Z", "time/step": 0.75},
    ]
    assert engine_cli._step_ends(steps) == pytest.approx([1.5, 2.25])
    assert engine_cli._step_ends([]) == []
