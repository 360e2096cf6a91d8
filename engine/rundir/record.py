"""What one run has recorded, owned in one place: its trained steps, its checkpoints and
how it stopped.

Why one object: a trained step lands in several files (``metrics.jsonl``,
``rollouts.jsonl``, ``eval.jsonl``) and in the summary's list of steps, and a resume or
a recovery must take ALL of them back to the same checkpoint, or a redone step would
appear twice in one and not at all in another. :class:`RunRecord` is the only writer of
a trained step (:meth:`RunRecord.append`, exactly once, in order) and the only thing
that takes the run back (:meth:`RunRecord.rewind`). The file formats are those of
:mod:`engine.rundir.checkpoint_log` (checkpoints, the truncation of per-step logs),
:mod:`engine.observe.metrics`, :mod:`engine.rollouts` and :mod:`engine.loop.evaluation`
(which appends each held-out result itself; the record takes it back with the rest).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.common.files import truncate_metrics
from engine.loop.evaluation import EVAL_FILE
from engine.loop.results import StepResult
from engine.observe.metrics import RunLog
from engine.rundir.checkpoint_log import CheckpointLog, CheckpointReason, CheckpointRecord
from engine.rundir.events import EventLog
from engine.rundir.rollout_log import ROLLOUTS_FILE, RolloutLog

__all__ = ["RunRecord"]

STEP_LOGS = (ROLLOUTS_FILE, EVAL_FILE)
"""The per-step logs besides metrics.jsonl (which :class:`RunLog` keeps open) that a
rewind cuts back."""


class RunRecord:
    """One run's record in ``run_dir``. A resumed run's record (``resumed``: the
    checkpoint it continues from) starts rewound to that checkpoint, with the metrics of
    the steps before it; a new run's starts at step 0."""

    def __init__(
        self,
        run_dir: Path,
        log: RunLog,
        events: EventLog,
        *,
        resumed: CheckpointRecord | None = None,
    ) -> None:
        self.path = run_dir
        self.resumed_from = resumed
        """The checkpoint a resumed run continues from (None: a new run)."""
        self._log = log
        self._events = events
        self._checkpoints = CheckpointLog(run_dir, log=events)
        self._rollouts: RolloutLog | None = None
        self._steps: list[dict[str, Any]] = []
        self._through = 0
        self._stopped: dict[str, Any] | None = None
        if resumed is not None:
            self._through = resumed.step
            self.rewind(resumed.step)
            self._steps = _recorded_steps(log.path)
            events.info("resume", step=resumed.step, state_path=resumed.state_path)

    @property
    def log(self) -> RunLog:
        """Where the run's steps and lines go (metrics.jsonl, the console, the trackers)."""
        return self._log

    @property
    def events(self) -> EventLog:
        """The run's events.jsonl."""
        return self._events

    @property
    def steps(self) -> tuple[dict[str, Any], ...]:
        """The metrics of every recorded step, in order (a resumed run's earlier ones too)."""
        return tuple(self._steps)

    @property
    def through(self) -> int:
        """The last recorded step (1-based; 0: none yet): the next one must be one more."""
        return self._through

    @property
    def stopped(self) -> dict[str, Any] | None:
        """How a stopped run stopped (``summary.json``'s ``stopped``); None otherwise."""
        return self._stopped

    def keep_rollouts(self, rollouts: RolloutLog) -> None:
        """Also write each appended step's first groups to ``rollouts.jsonl``."""
        self._rollouts = rollouts

    def append(self, result: StepResult) -> None:
        """Record a trained step: metrics.jsonl (and the console, the trackers),
        rollouts.jsonl, the summary's steps. Exactly once and in order: a step that is
        not the one after :attr:`through` is a ValueError and nothing is written."""
        expected = self._through + 1
        if result.step != expected:
            done = "is already recorded" if result.step <= self._through else "skips a step"
            raise ValueError(
                f"step {result.step} {done}: the run's record is at step {self._through}, "
                f"so the next step to record is {expected}"
            )
        self._log.step(result.metrics, result.line)
        if self._rollouts is not None:
            self._rollouts.write(result)
        self._steps.append(result.metrics)
        self._through = result.step

    def rewind(self, to_step: int) -> None:
        """Forget every step after ``to_step`` (a checkpoint's step) in every per-step log
        and in :attr:`steps`: a resume or a recovery redoes them, and each is recorded
        again once. ValueError for a step after :attr:`through` (nothing to go back
        to)."""
        if not 0 <= to_step <= self._through:
            raise ValueError(
                f"cannot rewind to step {to_step}: the run's record holds steps 1 to "
                f"{self._through}"
            )
        self._log.rewind(to_step, log=self._events)
        for name in STEP_LOGS:
            truncate_metrics(self.path / name, to_step, log=self._events)
        self._steps = [m for m in self._steps if m["step"] <= to_step]
        self._through = to_step

    def latest_checkpoint(self) -> CheckpointRecord | None:
        """The latest record of ``checkpoints.jsonl`` (None: no checkpoint yet)."""
        return self._checkpoints.latest()

    def initial_checkpoint(self) -> CheckpointRecord | None:
        """The first record of ``checkpoints.jsonl`` with sampler weights of step 0: the
        run's initial weights (None: none)."""
        return self._checkpoints.first_of_step(0)

    async def add_checkpoint(self, checkpoint: CheckpointRecord) -> None:
        """Append ``checkpoint`` to ``checkpoints.jsonl`` durably (one line, fsync'd)."""
        await self._checkpoints.aappend(checkpoint)

    def stop(
        self, reason: CheckpointReason, *, checkpoint: CheckpointRecord | None, written: bool
    ) -> None:
        """Record that the run stopped for ``reason``; ``checkpoint`` is the one a resume
        continues from, ``written`` whether the stop wrote it."""
        self._stopped = {
            "reason": reason,
            "checkpoint_step": checkpoint.step if checkpoint is not None else None,
            "checkpoint_written": written,
        }


def _recorded_steps(metrics_path: Path) -> list[dict[str, Any]]:
    """The step lines of ``metrics.jsonl`` (other and undecodable lines skipped)."""
    steps: list[dict[str, Any]] = []
    for line in metrics_path.read_text(encoding="utf-8").splitlines():
        try:
            data = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(data, dict) and isinstance(data.get("step"), int):
            steps.append(data)
    return steps
