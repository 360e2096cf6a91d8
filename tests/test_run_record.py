"""The run's record (engine/rundir/record.py): a trained step is recorded exactly once and
in order; a rewind takes every per-step log and the summary's steps back to a
checkpoint, and the redone steps are then recorded once more, nothing lost."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from engine.core.state import LoopState
from engine.loop.results import StepResult, StepTimeline
from engine.objectives.rl import RL
from engine.observe.metrics import RunLog
from engine.rundir.checkpoint_log import CheckpointRecord
from engine.rundir.events import EventLog
from engine.rundir.record import RunRecord


def trained(step: int, reward: float = 0.5) -> StepResult:
    return StepResult(
        step=step,
        metrics={"step": step, "avg_reward": reward},
        line=f"step {step}",
        datums=(),
        groups=(),
        advantages=(),
        timeline=StepTimeline(0.0, 0.0, 0.0, 0.0),
        state=LoopState(step, {}, step),
    )


def lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def steps_in(path: Path) -> list[int]:
    return [line["step"] for line in lines(path)]


@pytest.fixture
def logs(tmp_path: Path) -> Iterator[tuple[RunLog, EventLog]]:
    log = RunLog(tmp_path / "metrics.jsonl", None, "console", step_detail=RL.step_detail)
    events = EventLog(tmp_path)
    yield log, events
    log.close()
    events.close()


def test_a_step_is_recorded_once_and_in_order(
    tmp_path: Path, logs: tuple[RunLog, EventLog]
) -> None:
    record = RunRecord(tmp_path, *logs)
    record.append(trained(1))
    record.append(trained(2))
    with pytest.raises(ValueError, match="step 2 is already recorded"):
        record.append(trained(2))
    with pytest.raises(ValueError, match="step 4 skips a step"):
        record.append(trained(4))
    assert steps_in(tmp_path / "metrics.jsonl") == [1, 2]  # the refused ones wrote nothing
    assert [m["step"] for m in record.steps] == [1, 2] and record.through == 2


def test_a_rewind_cuts_every_per_step_log_and_the_redone_steps_are_recorded_once(
    tmp_path: Path, logs: tuple[RunLog, EventLog]
) -> None:
    record = RunRecord(tmp_path, *logs)
    for step in (1, 2, 3, 4):
        record.append(trained(step, reward=0.1))
        for name in ("rollouts.jsonl", "eval.jsonl"):  # as the rollouts and the evaluator do
            with (tmp_path / name).open("a") as f:
                f.write(json.dumps({"step": step}) + "\n")

    record.rewind(2)
    assert record.through == 2 and [m["step"] for m in record.steps] == [1, 2]
    for name in ("metrics.jsonl", "rollouts.jsonl", "eval.jsonl"):
        assert steps_in(tmp_path / name) == [1, 2], name

    record.append(trained(3, reward=0.9))
    record.append(trained(4, reward=0.9))
    metrics = lines(tmp_path / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]  # each once, none lost
    assert [m["avg_reward"] for m in metrics] == [0.1, 0.1, 0.9, 0.9]  # the redone ones
    assert [m["avg_reward"] for m in record.steps] == [0.1, 0.1, 0.9, 0.9]


def test_a_rewind_goes_back_only(tmp_path: Path, logs: tuple[RunLog, EventLog]) -> None:
    record = RunRecord(tmp_path, *logs)
    record.append(trained(1))
    with pytest.raises(ValueError, match="cannot rewind to step 2"):
        record.rewind(2)
    record.rewind(0)
    assert record.steps == () and steps_in(tmp_path / "metrics.jsonl") == []
    record.append(trained(1))
    assert steps_in(tmp_path / "metrics.jsonl") == [1]


def test_a_resumed_record_starts_at_its_checkpoint_with_the_earlier_steps(
    tmp_path: Path,
) -> None:
    log = RunLog(tmp_path / "metrics.jsonl", None, "console", step_detail=RL.step_detail)
    events = EventLog(tmp_path)
    first = RunRecord(tmp_path, log, events)
    checkpoint = CheckpointRecord(step=2, state_path="tinker://s/2", reason="periodic")
    for step in (1, 2, 3):  # step 3 trained, then the process was killed
        first.append(trained(step))
        if step == 2:
            anyio.run(first.add_checkpoint, checkpoint)
    (tmp_path / "rollouts.jsonl").write_text('{"step": 2}\n{"step": 3}\n')
    log.close()
    events.close()

    log = RunLog(tmp_path / "metrics.jsonl", None, "console", step_detail=RL.step_detail)
    events = EventLog(tmp_path)
    resumed = RunRecord(tmp_path, log, events, resumed=first.latest_checkpoint())
    assert resumed.through == 2 and [m["step"] for m in resumed.steps] == [1, 2]
    assert steps_in(tmp_path / "rollouts.jsonl") == [2]
    resumed.append(trained(3))
    log.close()
    events.close()
    assert steps_in(tmp_path / "metrics.jsonl") == [1, 2, 3]
    assert [e["step"] for e in lines(tmp_path / "events.jsonl") if e["event"] == "resume"] == [2]


def test_a_stop_is_recorded_with_the_checkpoint_a_resume_continues_from(
    tmp_path: Path, logs: tuple[RunLog, EventLog]
) -> None:
    record = RunRecord(tmp_path, *logs)
    assert record.stopped is None
    checkpoint = CheckpointRecord(step=0, state_path="tinker://s/0", reason="periodic")
    record.stop("interrupt", checkpoint=checkpoint, written=False)
    assert record.stopped == {
        "reason": "interrupt",
        "checkpoint_step": 0,
        "checkpoint_written": False,
    }
