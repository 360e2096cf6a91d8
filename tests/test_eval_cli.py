"""engine.eval end to end: the default run (two steps) on the local server, then its
final checkpoint and its step-0 checkpoint evaluated by ``python -m engine.eval``, which
shows the difference, pass@k for a list of k, the reward components and each problem's
prompt and responses. Greedy sampling on the local server is deterministic, so the
step-0 checkpoint and the fresh-LoRA baseline (B = 0: the same weights) agree exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.eval import main
from tests.reliability_support import run_cli

# A real-server end-to-end set: deselected by default, run with -m slow (CI runs both).
pytestmark = pytest.mark.slow


def test_eval_shows_the_difference_between_the_final_and_step_0_checkpoints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    done = run_cli(["--steps", "2", "--run-dir", str(run), "--no-progress"], tmp_path)
    assert done.returncode == 0, done.stderr
    monkeypatch.delenv("MINT_API_KEY", raising=False)
    monkeypatch.delenv("MINT_BASE_URL", raising=False)

    # --k 1,2,3: three samples drawn (the largest k), the text of one kept per problem
    assert main([str(run), "--baseline", "--k", "1,2,3", "--response-texts", "1"]) == 0
    table = capsys.readouterr().out
    final = json.loads((run / "eval-step2.json").read_text())
    assert final["step"] == 2 and final["task"] == "arithmetic-add"
    assert final["samples"] == 3 and final["k"] == [1, 2, 3]
    metrics, baseline = final["metrics"], final["baseline"]
    assert metrics["problems"] == baseline["problems"] > 0
    passes = ["sampled/pass@1", "sampled/pass@2", "sampled/pass@3"]
    for key in ("reward/total", "pass_rate", "exact_bonus", "sampled/reward/total", *passes):
        assert 0.0 <= metrics[key] <= 1.0
        assert final["difference"][key] == pytest.approx(metrics[key] - baseline[key])
    assert metrics["sampled/pass@1"] <= metrics["sampled/pass@2"] <= metrics["sampled/pass@3"]
    assert "| metric | step 0 | step 2 | difference |" in table
    before, after = baseline["reward/total"], metrics["reward/total"]
    assert f"| reward/total | {before:.3f} | {after:.3f} |" in table
    for component in ("distance_reward", "exact_bonus", "format_reward"):  # their means
        assert f"| {component} | {baseline[component]:.3f} | {metrics[component]:.3f} |" in table
    assert table.index("| sampled/pass@2 |") < table.index("| sampled/pass@3 |")

    # each held-out problem: its prompt, the greedy response and 3 sampled ones, rewarded
    records = final["problems"]
    assert len(records) == metrics["problems"] and len(final["baseline_problems"]) == len(records)
    for record in records:
        assert record["prompt"].endswith("?\nAnswer:") and record["reward_error"] is None
        greedy, samples = record["greedy"], record["samples"]
        assert isinstance(greedy["response"], str) and len(samples) == 3
        assert "response" in samples[0] and all("response" not in s for s in samples[1:])
        for response in (greedy, *samples):
            assert set(response["components"]) == {
                "distance_reward",
                "exact_bonus",
                "format_reward",
            }
            assert response["passed"] == (response["reward"] >= 1.0)
    greedy_mean = sum(r["greedy"]["reward"] for r in records) / len(records)
    assert greedy_mean == pytest.approx(metrics["reward/total"])

    out = tmp_path / "step0.json"
    assert main([str(run), "--step", "0", "--samples", "0", "--out", str(out)]) == 0
    step0 = json.loads(out.read_text())["metrics"]
    greedy = {k: v for k, v in baseline.items() if not k.startswith("sampled/")}
    assert step0 == greedy


def test_eval_without_a_task_or_checkpoint_is_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "meta.json").write_text("{}")
    assert main([str(tmp_path / "ckpt")]) == 2
    assert "say which task (--task)" in capsys.readouterr().err


def test_a_run_on_another_server_is_evaluated_where_its_checkpoints_live(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine.local import LocalServer
    from tests.engine_support import API_KEY, run_engine, small_config

    with LocalServer(api_key=API_KEY) as server:
        _, result = run_engine(small_config(server, tmp_path / "run", steps=1))
        monkeypatch.setenv("MINT_API_KEY", API_KEY)
        monkeypatch.delenv("MINT_BASE_URL", raising=False)
        assert not (result.run_dir / "local-server").exists()  # nothing of it is here
        assert main([str(result.run_dir), "--samples", "0"]) == 0
    final = json.loads((result.run_dir / "eval-step1.json").read_text())
    assert final["step"] == 1 and final["metrics"]["problems"] > 0
    assert "| reward/total |" in capsys.readouterr().out
