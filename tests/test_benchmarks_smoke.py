"""The benchmarks run end to end at a tiny size and write well-formed results.

They exist so the benchmarks cannot rot: every configuration runs against a real local
server, the JSON holds every figure the tables and README quote, the plots are real PNG
files. No assertion is about speed (wall-clock figures belong to the benchmark runs).
The quickstart loop is also checked against the tests' own re-implementation of the
quickstart, datum for datum, since the benchmarks' speedups are only meaningful if the
baseline is the quickstart's loop.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks import (
    code_learning,
    code_pace,
    scaling,
    scoring,
    sft_pace,
    startup,
    throughput,
    train_stage,
)
from benchmarks.quickstart_loop import run_quickstart_loop
from engine.local import LocalServer
from tests.engine_support import quickstart_task_knobs
from tests.sandbox_support import require_isolation

# A real-server end-to-end set: deselected by default, run with -m slow (CI runs both).
pytestmark = pytest.mark.slow

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
API_KEY = "tml-benchmarks-smoke"


@pytest.fixture(scope="module")
def server() -> Iterator[LocalServer]:
    with LocalServer() as s:
        yield s


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG"
    assert len(data) > 5_000, f"{path} is suspiciously small ({len(data)} bytes)"


def test_quickstart_loop_records_its_steps_stage_by_stage(server: LocalServer) -> None:
    knobs: dict[str, Any] = {
        "rank": 8,
        "steps": 2,
        "batch": 3,
        "group": 4,
        "lr": 3e-3,
        "max_tokens": 6,
        "temperature": 1.0,
        "seed": 7,
        **quickstart_task_knobs(server),
        "lora_seed": 3,
        "sampling_seed": 99,
    }
    common: dict[str, Any] = {
        "base_url": server.base_url,
        "api_key": API_KEY,
        "base_model": server.model_name,
    }
    ours = run_quickstart_loop(**common, **knobs)

    # Its datums are checked against the engine's in tests/test_engine_parity.py.
    assert len(ours.lines) == len(ours.questions) == len(ours.datums) == 2
    assert sum(len(d) for d in ours.datums) > 0, "the quickstart loop trained on nothing"
    assert ours.saved_path.startswith("tinker://")
    # Timings are recorded per step, stage by stage, in order.
    assert [s.step for s in ours.steps] == [1, 2]
    for step in ours.steps:
        assert step.end > step.start
        assert step.samples == 3 * 4
        trained = {"train"} if step.datums else set()  # none when every group tied
        assert {sp.stage for sp in step.spans} == {"snapshot", "sample", "score", *trained}
        assert all(step.start <= sp.start <= sp.end <= step.end for sp in step.spans)
        assert step.step_s >= step.snapshot_s + step.sample_s + step.train_s
    assert ours.finished > ours.started
    assert ours.cpu_s > 0


def test_quickstart_loop_rejects_a_bad_size() -> None:
    with pytest.raises(ValueError, match="batch must be >= 1"):
        run_quickstart_loop(base_url="http://127.0.0.1:9", api_key=API_KEY, base_model="m", batch=0)


def test_throughput_quick_run_writes_every_configuration(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = throughput.main(
        ["--quick", "--steps", "2", "--workloads", "2x3x4", "--out", str(tmp_path)]
    )
    assert code == 0
    data = json.loads((tmp_path / "throughput.json").read_text())
    assert data["context"]["args"]["steps"] == 2
    runs = data["runs"]
    assert [r["config"] for r in runs] == list(throughput.CONFIGS)
    for run in runs:
        s = run["summary"]
        assert run["workload"] == "2x3x4"
        assert s["steps"] == 2
        assert s["samples"] == 2 * 2 * 3
        for key in (
            "steps_per_s",
            "samples_per_s",
            "step_time_s",
            "cycles_per_step",
            "client_cpu_s",
        ):
            assert _finite(s[key]) and s[key] > 0, (run["config"], key, s[key])
        # two steps may share a clock cycle: the engine's floor over two ends can be 0
        assert 0 <= s["ideal_step_time_s"] <= s["step_time_s"]
        assert 0 <= s["efficiency"] <= 1
        assert run["server_timeline"]["cycle_starts"] and run["server_timeline"]["compute"]
        assert _finite(run["speedup"]) and _finite(run["speedup_steady"])
        stages = {span["stage"] for span in run["spans"]}
        # the quickstart trains (and records a train span) only when a group did not tie
        assert stages - {"train"} == {"sample", "score"}, run["config"]
        assert "train" in stages or s["datums"] == 0, run["config"]
        assert all(span["end"] >= span["start"] for span in run["spans"])
        ends = [step["end"] for step in run["steps"]]
        assert ends == sorted(ends)
    quickstart = runs[0]
    assert quickstart["speedup"] == pytest.approx(1.0)
    assert quickstart["stages_alone_from"] == "own run"
    for run in runs[1:]:
        assert run["stages_alone_from"] == "k0 run + trainer alone"
        assert run["summary"]["train_alone_s"] == run["trainer_alone"]["mean_step_s"]
        assert run["summary"]["sample_alone_s"] == runs[1]["summary"]["sample_alone_s"]

    table = (tmp_path / "throughput.md").read_text()
    assert table.count("\n") == 2 + len(runs)
    assert "engine K=1" in table and "quickstart loop" in table
    assert table in capsys.readouterr().out
    plots = ["throughput_step_time.png", "throughput_timeline.png", "throughput_cycles.png"]
    for name in plots:
        _assert_png(tmp_path / name)
    assert sorted(Path(p).name for p in data["plots"]) == sorted(plots)
    # the plots can be redrawn from the JSON alone
    replot = tmp_path / "replot"
    assert (
        throughput.main(["--replot", str(tmp_path / "throughput.json"), "--out", str(replot)]) == 0
    )
    for name in plots:
        _assert_png(replot / name)


def test_scaling_quick_run_writes_points_fit_and_profile(tmp_path: Path) -> None:
    code = scaling.main(
        [
            "--sizes",
            "2x2",
            "4x2",
            "--steps",
            "1",
            "--max-tokens",
            "2",
            "--profile",
            "2x2",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 0
    data = json.loads((tmp_path / "scaling.json").read_text())
    points = data["points"]
    assert [p["workload"] for p in points] == ["2x2", "4x2"]
    for p in points:
        assert p["samples"] == p["samples_per_step"] * p["steps"]
        assert p["cpu_s"] > 0 and _finite(p["cpu_ms_per_1k_samples"])
        # per thread role; a role's CPU is read in 10 ms ticks, so in a run this short
        # one (the engine's event loop too) may read 0 and be left out
        assert sum(p["threads_ms_per_1k_samples"].values()) > 0
        assert p["rss_peak_mb"] >= p["rss_start_mb"] > 0
        assert p["server_cpu_share"] is not None and p["server_cpu_share"] > 0
        assert set(p["run"]["gc"]) >= {"gen2_passes", "total_s"}
    roles = {role for p in points for role in p["threads_ms_per_1k_samples"]}
    assert set(data["fit"]) >= {"client", *roles}
    assert all(_finite(f["marginal_ms_per_1k_samples"]) for f in data["fit"].values())
    profile = data["profile"]
    assert profile["size"] == "2x2"
    assert profile["own_s_by_origin"].get("engine", 0) > 0
    assert any(r["origin"] == "engine" for r in profile["top_engine_cumulative"])
    assert (tmp_path / "scaling_profile.pstats").stat().st_size > 0
    assert "| 4x2 |" in (tmp_path / "scaling.md").read_text()
    _assert_png(tmp_path / "scaling.png")
    replot = tmp_path / "replot"
    assert scaling.main(["--replot", str(tmp_path / "scaling.json"), "--out", str(replot)]) == 0
    _assert_png(replot / "scaling.png")


@pytest.mark.parametrize(
    ("module", "argv", "message"),
    [
        (throughput, ["--workloads", "8x6"], "must be BATCHxGROUPxMAX_TOKENS"),
        (throughput, ["--latency", "hosted"], "unknown latency profile 'hosted'"),
        (throughput, ["--steps", "1"], "--steps must be at least 2"),
        (throughput, ["--configs", "k9"], "invalid choice: 'k9'"),
        (throughput, ["--replot", "/nonexistent/throughput.json"], "not a throughput.json"),
        (scaling, ["--sizes", "8x6x16"], "must be BATCHxGROUP"),
        (scaling, ["--steps", "0"], "--steps must be >= 1"),
        (scaling, ["--replot", "/nonexistent/scaling.json"], "not a scaling.json"),
    ],
)
def test_bad_arguments_stop_with_one_line(
    module: Any, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        module.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1, err


def test_train_stage_quick_run_compares_both_trainers(tmp_path: Path) -> None:
    code = train_stage.main(["--quick", "--batch", "2", "--group", "3", "--out", str(tmp_path)])
    assert code == 0
    data = json.loads((tmp_path / "train_stage.json").read_text())
    assert data["cycle_s"] == pytest.approx(0.1)
    assert set(data["modes"]) == {"await", "submit-ahead"}
    for mode in data["modes"].values():
        assert mode["datums"] > 0
        assert len(mode["step_times_s"]) == 3
        assert all(t > 0 for t in mode["step_times_s"])
        assert _finite(mode["mean_step_s"])
    text = (tmp_path / "train_stage.md").read_text()
    assert "| await |" in text and "| submit-ahead |" in text


def test_sft_pace_quick_run_measures_each_submit_ahead_in_cycles(tmp_path: Path) -> None:
    assert sft_pace.main(["--quick", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "sft_pace.json").read_text())
    assert data["cycle_s"] == pytest.approx(0.1)
    assert [r["submit_ahead"] for r in data["runs"]] == [1, 0]
    for run in data["runs"]:
        assert run["steps"] == 4 and run["steady_steps"] == 2
        assert _finite(run["pace_s"]) and _finite(run["cycles_per_step"])
        assert run["pace_s"] >= run["clock_floor_s"]
    assert (tmp_path / "sft_pace.md").read_text().count("\n") == 4


def test_code_pace_quick_run_paces_both_tasks_in_cycles(tmp_path: Path) -> None:
    require_isolation()
    assert code_pace.main(["--quick", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "code_pace_2x2x8.json").read_text())
    assert [r["task"] for r in data["runs"]] == ["arithmetic", "code"]
    for run in data["runs"]:
        assert run["steps"] == 4 and _finite(run["pace_s"]) and _finite(run["cycles_per_step"])
        assert 0.0 <= run["reward_mean"] <= 1.0
    assert _finite(data["ratio"])


def test_code_learning_quick_run_records_a_held_out_curve(tmp_path: Path) -> None:
    require_isolation()
    assert code_learning.main(["--quick", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "code_learning.json").read_text())
    (run,) = data["runs"]
    assert [step for step, _ in run["curve"]] == [0, 2]
    assert all(0.0 <= share <= 1.0 for _, share in run["curve"] + run["sampled_curve"])
    assert [step for step, _ in run["sampled_curve"]] == [0, 2]
    assert (tmp_path / "code_learning.png").stat().st_size > 0


def test_scoring_quick_run_reports_each_reward_against_its_ideal(tmp_path: Path) -> None:
    assert scoring.main(["--quick", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "scoring.json").read_text())
    results = {r["workers"]: r for r in report["results"] if "cpu" in r["config"]}
    assert set(results) == {"threads", "processes:2"}
    judge = next(r for r in report["results"] if "judge" in r["config"])
    assert judge["ideal_s"] == 0.25 and len(judge["times_s"]) == 1
    assert (tmp_path / "scoring.md").read_text().count("\n") == 5


def test_startup_quick_run_times_both_loops_from_process_start(tmp_path: Path) -> None:
    code = startup.main(
        [
            "--steps",
            "3",
            "--workload",
            "2x3x4",
            "--latency",
            "mint:scale=0.01",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 0
    data = json.loads((tmp_path / "startup.json").read_text())
    rows = {r["loop"]: r for r in data["rows"]}
    assert set(rows) == {"quickstart loop", "engine CLI"}
    for row in rows.values():
        ends = row["step_ends_s"]
        assert len(ends) == 3 and ends == sorted(ends) and ends[0] > 0
        assert row["last_step_s"] == ends[-1] and _finite(row["speedup_to_last"])
    assert rows["quickstart loop"]["speedup_to_last"] == pytest.approx(1.0)
    assert (tmp_path / "startup.md").read_text().count("\n") == 4


def test_agents_quick_run_compares_the_endpoint_with_the_environment(tmp_path: Path) -> None:
    from benchmarks import agents

    agents.main(["--quick", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "agents.json").read_text())
    names = {"environment", "openai agent", "openai agent, processes:2"}
    assert set(data["per_call_ms"]) == set(data["per_call_cpu_ms"]) == set(data["steps_per_s"])
    assert set(data["steps_per_s"]) == names
    figures = ("per_call_ms", "per_call_cpu_ms", "steps_per_s")
    assert all(v > 0 for key in figures for v in data[key].values())
    assert "ms per call" in (tmp_path / "agents.md").read_text()
