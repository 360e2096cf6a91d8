"""The benchmarks' figures by definition: a pace over steady steps (never a median of
intervals), a clock floor no loop can beat, and an efficiency that cannot exceed 1."""

from __future__ import annotations

import dataclasses
import io

import pytest

from benchmarks import stamp
from benchmarks.measure import (
    RunRecord,
    StepRecord,
    clock_floor,
    pace,
    steps_per_two_cycles,
    summarize,
)
from benchmarks.stamp import stamp_steps


def _record(
    ends: list[float], *, cycle: float | None, per_two: int | None, datums: int = 6
) -> RunRecord:
    steps = [StepRecord(i + 1, end, 0.1, 0.01, 0.2, 6, 60, datums) for i, end in enumerate(ends)]
    return RunRecord("k1", 0.0, ends[-1], steps, cycle_s=cycle, per_two_cycles=per_two)


def test_pace_is_the_span_over_the_intervals_not_a_median() -> None:
    # steps in pairs: 0.05 s apart, then 1.45 s: the median interval (0.05 s) says
    # nothing; the pace is 0.75 s per step
    ends = [0.0, 0.05, 1.5, 1.55, 3.0, 3.05]
    assert pace(ends) == pytest.approx(3.05 / 5)
    with pytest.raises(ValueError):
        pace([1.0])


def test_steps_in_pairs_are_reported_at_their_pace_in_cycles() -> None:
    ends = [0.1, 0.2] + [1.0 + 1.5 * (i // 2) + 0.05 * (i % 2) for i in range(8)]
    s = summarize(_record(ends, cycle=0.5, per_two=2))
    assert s["steady_steps"] == 8  # the two warm-up steps are left out
    step_time = s["step_time_s"]
    assert step_time == pytest.approx((ends[-1] - ends[2]) / 7)
    assert step_time is not None
    assert s["cycles_per_step"] == pytest.approx(step_time / 0.5)
    assert s["efficiency"] is not None and 0 < s["efficiency"] <= 1


def test_the_clock_floor_follows_how_many_steps_fit_in_two_cycles() -> None:
    assert steps_per_two_cycles(off_policy=1, submit_ahead=1) == 2  # one step per cycle
    assert steps_per_two_cycles(off_policy=0, submit_ahead=1) == 1  # on-policy: two cycles
    assert steps_per_two_cycles(off_policy=2, submit_ahead=0) == 1  # each step awaited
    # 21 ends at one step per cycle span >= 20 cycles, less one for the first step's jitter
    assert clock_floor(21, 0.5, 2) == pytest.approx(19 * 0.5 / 20)
    assert clock_floor(21, 0.5, 1) == pytest.approx(39 * 0.5 / 20)
    assert clock_floor(21, 0.5, None) == pytest.approx(59 * 0.5 / 20)  # the quickstart
    assert clock_floor(2, 0.5, 2) == 0  # two steps can share a cycle
    # steps that trained nothing sent no call to wait on the clock
    assert clock_floor(21, 0.5, 1, trained=11) == pytest.approx(19 * 0.5 / 20)
    assert clock_floor(2, 0.5, 1, trained=1) == 0
    with pytest.raises(ValueError, match="between 0 and 21"):
        clock_floor(21, 0.5, 1, trained=22)


def test_a_step_that_trained_nothing_is_not_held_to_the_clock() -> None:
    # on-policy, 2 steps on a 0.1 s clock: the second step's groups all tied, so it sent
    # no training call and ended as soon as it was scored, 33 ms after the first
    record = _record([0.0, 0.033], cycle=0.1, per_two=1)
    record.steps[1] = dataclasses.replace(record.steps[1], datums=0)
    s = summarize(record)
    assert s["ideal_step_time_s"] == 0
    assert s["step_time_s"] == pytest.approx(0.033)


def test_a_pace_faster_than_the_clock_allows_is_refused() -> None:
    ends = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5]  # 0.1 s per step on a 0.5 s clock
    with pytest.raises(AssertionError, match="beats the clock floor"):
        summarize(_record(ends, cycle=0.5, per_two=2))


def test_without_a_latency_profile_there_is_no_floor_and_no_efficiency() -> None:
    s = summarize(_record([0.0, 0.1, 0.2, 0.3], cycle=None, per_two=2))
    assert s["ideal_step_time_s"] is None and s["efficiency"] is None
    assert s["cycles_per_step"] is None


def test_stamp_reads_the_cli_step_lines_at_their_arrival(
    capsys: pytest.CaptureFixture[str],
) -> None:
    lines = ["Connecting...\n", "Step 1: avg_reward=0.5\n", "  details\n", "Step 2: x\n"]
    times = iter([0.0, 1.0, 2.0, 2.5, 3.0])
    out = io.StringIO()
    steps = stamp_steps(lines, out, lambda: next(times))
    assert steps == {1: 2.0, 2: 3.0}
    assert out.getvalue().splitlines()[1] == "    2.000 Step 1: avg_reward=0.5"


def test_stamp_prints_the_pace_in_cycles(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    text = "".join(f"Step {i}: r\n" for i in range(1, 6))
    monkeypatch.setattr("sys.stdin", io.StringIO(text))
    assert stamp.main(["--cycle", "0.5", "--skip", "2"]) == 0
    assert "pace over steps 3..5:" in capsys.readouterr().out
