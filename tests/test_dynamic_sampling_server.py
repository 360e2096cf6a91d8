"""Dynamic sampling end to end on the local server (issue 34): a task whose even
problems tie makes every step sample reserves; the steps train ``--batch`` groups with
signal, within the staleness bound, and the tied groups stay in the run's files as
skipped."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks import refill
from engine.core.problems import Problem, RewardBreakdown
from engine.local import LocalServer
from engine.rundir.rollout_log import ROLLOUTS_FILE
from engine.tasks.arithmetic import ArithmeticTask
from tests.engine_support import run_engine, small_config

pytestmark = pytest.mark.slow


class HalfTiedArithmetic(ArithmeticTask):
    """Arithmetic whose even problems score 1 for any response (their groups tie)."""

    def score(self, response: str, problem: Problem) -> RewardBreakdown:
        if problem.id % 2 == 0:
            return RewardBreakdown(1.0)
        return super().score(response, problem)


@pytest.fixture(scope="module")
def server() -> Iterator[LocalServer]:
    with LocalServer() as s:
        yield s


def test_tied_groups_are_refilled_on_the_local_server(server: LocalServer, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    config = small_config(
        server, run_dir, steps=3, batch=4, group=4, refill_groups=6, log_rollouts=16
    )
    steps, _ = run_engine(config, task=HalfTiedArithmetic())
    for result in steps:
        m = result.metrics
        assert m["refill/extra_groups"] >= 2  # half the batch ties, and half the reserves
        assert m["groups/skipped"] >= 2 and m["off_policy/staleness"] <= 1
        if m["refill/short"]:  # every reserve spent, and still short
            assert m["groups/with_signal"] < 4 and m["refill/unused_reserves"] == 0
        else:
            assert m["groups/with_signal"] == 4
        assert len(result.groups) == 4 + m["refill/extra_groups"]
    records = [json.loads(line) for line in (run_dir / ROLLOUTS_FILE).read_text().splitlines()]
    assert {r["problem_id"] % 2 for r in records} == {0, 1}  # the tied groups are recorded too


def test_the_refill_benchmark_runs_quick(tmp_path: Path) -> None:
    out = tmp_path / "refill.json"
    assert refill.main(["--quick", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [s["refill_groups"] for s in report["summary"]] == [0, 4]
    assert all(r["steps"] == 2 and 0 <= r["exact_after"] <= 1 for r in report["runs"])
    assert "| --refill-groups |" in out.with_suffix(".md").read_text()
