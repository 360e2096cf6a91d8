"""The learning grid (benchmarks/learning_grid.py): its cells, its summary's figures on
hand-made runs, and a quick grid against the real local server (slow) that writes a
well-formed report, a plot and a markdown page, and resumes without repeating a run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import learning_grid
from benchmarks.learning_grid import BASELINE, cell_spec, summarize


def test_a_cell_is_a_correction_at_a_k(capsys: pytest.CaptureFixture[str]) -> None:
    spec = cell_spec("is-tis-temp@2")
    assert (spec.loss, spec.max_steps_off_policy) == ("importance_sampling", 2)
    assert spec.settings == {"temperature": 0.8, "tis_cap": 2.0, "loss_temperature": "sampling"}
    for bad in ("tis@1", "ppo", "ppo@x"):
        with pytest.raises(ValueError, match="not a cell"):
            cell_spec(bad)
    for argv, message in [
        (["--cells", "ppo@1"], "must include the baseline is@0"),
        (["--cells", "is@0,zz@1"], "not a cell: 'zz@1'"),
    ]:
        with pytest.raises(SystemExit) as info:
            learning_grid.parse_args(argv)
        assert info.value.code == 2
        assert message in capsys.readouterr().err


def _run(cell: str, seed: int, curve: dict[int, float], ends: list[float]) -> dict[str, Any]:
    spec = cell_spec(cell)
    return {
        "config": cell,
        "loss": spec.loss,
        "max_steps_off_policy": spec.max_steps_off_policy,
        "settings": dict(spec.settings),
        "seed": seed,
        "exact_before": 0.3,
        "exact_after": curve[max(curve)],
        "delta": curve[max(curve)] - 0.3,
        "curve": {str(k): v for k, v in curve.items()},
        "step_end_s": ends,
        "load_before": [2.0, 2.0, 2.0],
        "kl_sample_train_v2_mean": 0.01,
    }


def test_the_summary_compares_each_cell_with_k0_in_steps_and_seconds() -> None:
    # K=0: 0.3 -> 0.4 -> 0.5 over 4 steps of 10 s; ppo@1: the same per step, twice as fast
    k0 = [_run(BASELINE, s, {2: 0.4, 4: 0.5}, [10.0, 20.0, 30.0, 40.0]) for s in (1, 2)]
    fast = [_run("ppo@1", s, {2: 0.4, 4: 0.5}, [5.0, 10.0, 15.0, 20.0]) for s in (1, 2)]
    slow = [
        _run("ppo@2", 1, {2: 0.35, 4: 0.40}, [5.0, 10.0, 15.0, 20.0]),
        _run("ppo@2", 2, {2: 0.35, 4: 0.44}, [5.0, 10.0, 15.0, 20.0]),
    ]
    base, one, two = summarize([*k0, *fast, *slow])
    assert base["final_mean"] == pytest.approx(0.5) and base["final_se"] == 0.0
    assert base["wall_s_to_target"] == pytest.approx(40.0)
    assert one["gain_ratio"] == pytest.approx(1.0)
    assert one["wall_s_to_target"] == pytest.approx(20.0)
    assert one["time_ratio_to_baseline"] == pytest.approx(0.5)
    assert one["final_within_one_se"] is True
    assert [p["step"] for p in one["curve"]] == [0, 2, 4]
    assert [p["wall_s_mean"] for p in one["curve"]] == [0.0, 10.0, 20.0]
    assert two["final_mean"] == pytest.approx(0.42) and two["final_se"] == pytest.approx(0.02)
    assert two["gain_ratio"] == pytest.approx(0.12 / 0.2)
    assert two["wall_s_to_target"] is None and two["time_ratio_to_baseline"] is None
    assert two["final_within_one_se"] is False
    table = learning_grid.table([base, one, two])
    assert "| ppo@1 | 2 | 50.0% ± 0.0% |" in table


@pytest.mark.slow
def test_a_quick_grid_writes_its_report_and_resumes(tmp_path: Path) -> None:
    out = tmp_path / "grid.json"
    argv = ["--quick", "--latency", "off", "--out", str(out)]
    assert learning_grid.main(argv) == 0
    report = json.loads(out.read_text())
    assert [r["config"] for r in report["runs"]] == [BASELINE, "is-tis-temp@1"]
    assert report["command"] == "python -m benchmarks.learning_grid " + " ".join(argv)
    tis = report["runs"][1]
    assert tis["settings"] == {"temperature": 0.8, "tis_cap": 2.0, "loss_temperature": "sampling"}
    assert set(tis["curve"]) == {"1", "2"} and len(tis["step_end_s"]) == 2
    assert tis["load_before"] is not None
    assert [c["cell"] for c in report["summary"]] == [BASELINE, "is-tis-temp@1"]
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    assert "| is-tis-temp@1 | 1 |" in out.with_suffix(".md").read_text()
    # a resumed grid finds every run done and repeats none
    assert learning_grid.main([*argv, "--resume"]) == 0
    again = json.loads(out.read_text())
    assert [r["final_path"] for r in again["runs"]] == [r["final_path"] for r in report["runs"]]


def test_hosted_cells_take_only_what_a_hosted_service_does() -> None:
    """The cells the hosted grid runs send nothing the mint (or tinker) profile refuses:
    no local-only loss option, and the rollout correction only with importance_sampling."""
    for cell in ("is-rc@1", "ppo-t1@1", "is-t1@1", "is-rc-t1@2", "sr@1"):
        spec = cell_spec(cell)
        assert spec.settings["loss_temperature"] == "off"
        assert not {"tis_cap", "mask_low", "mask_high"} & set(spec.settings)
        if "rollout_correction" in spec.settings:
            assert spec.loss == "importance_sampling"


def test_the_chat_confirmation_summarizes_curves_and_time_to_the_baselines_final() -> None:
    from benchmarks.learning_chat import summarize as chat_summary

    def row(cell: str, seed: int, curve: dict[int, float], ends: list[float]) -> dict[str, Any]:
        return {
            "config": cell,
            "seed": seed,
            "curve": {str(k): v for k, v in curve.items()},
            "before": curve[0],
            "after": curve[max(curve)],
            "step_end_s": ends,
        }

    runs = [
        row(BASELINE, 1, {0: 0.1, 2: 0.3, 4: 0.5}, [10, 20, 30, 40]),
        row(BASELINE, 2, {0: 0.1, 2: 0.3, 4: 0.3}, [10, 20, 30, 40]),
        row("ppo-t1@1", 1, {0: 0.1, 2: 0.5, 4: 0.6}, [5, 10, 15, 20]),
    ]
    base, fast = chat_summary(runs)
    assert base["after_mean"] == pytest.approx(0.4) and base["after_se"] == pytest.approx(0.1)
    assert base["wall_s_to_target"] == pytest.approx(40.0)  # its mean reaches 0.4 at step 4
    assert fast["wall_s_to_target"] == pytest.approx(7.5)  # 0.1 at 0 s, 0.5 at 10 s
    assert fast["time_ratio_to_baseline"] == pytest.approx(7.5 / 40.0)
