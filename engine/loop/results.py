"""What a run hands back: one :class:`StepResult` per trained step, one :class:`RunResult`.

Kept apart from the pipeline so an embedding service can import the result types without
the machinery that produces them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.core.datums import Datum
from engine.core.state import LoopState, ScoredGroup
from engine.session.api import PendingCheckpoint

__all__ = ["RunResult", "StepResult", "StepTimeline"]


@dataclass(frozen=True)
class StepTimeline:
    """``time.perf_counter()`` instants of one step: when its first group started
    sampling and its last one finished, and when training was submitted and done.
    With ``--max-steps-off-policy >= 1`` the next step's ``sample_start`` precedes this
    step's ``train_end``."""

    sample_start: float
    sample_end: float
    train_start: float
    train_end: float


@dataclass(frozen=True)
class StepResult:
    """One trained step. ``step`` is 1-based, as the quickstart prints it; ``metrics``
    is the event written to metrics.jsonl; ``datums`` are exactly what was sent to
    forward_backward, in order; ``groups`` are the step's groups in problem order and
    ``advantages`` each group's advantages in trajectory order (0 where nothing was
    trained: a masked trajectory, a group whose reward failed)."""

    step: int
    metrics: dict[str, Any]
    line: str
    datums: tuple[Datum, ...] = field(repr=False)
    groups: tuple[ScoredGroup, ...] = field(repr=False)
    advantages: tuple[tuple[float, ...], ...] = field(repr=False)
    timeline: StepTimeline
    state: LoopState = field(repr=False)
    checkpoint: PendingCheckpoint | None = field(default=None, repr=False, compare=False)
    """The periodic checkpoint submitted right behind this step (``--checkpoint-every``),
    for the checkpointer to await and record; None when none is due."""

    @property
    def sampler_versions(self) -> tuple[int, ...]:
        return tuple(g.version for g in self.groups)

    @property
    def staleness(self) -> int:
        """(0-based step) - (oldest sampler version among its groups); <= K."""
        return int(self.metrics["off_policy/staleness"])


@dataclass(frozen=True)
class RunResult:
    """A run that ended: the final sampler path (``Saved: <path>``), the run directory
    and every trained step's metrics (also those trained after the caller stopped
    looking). ``exhausted`` is True when the problem source ran out before ``steps``
    steps; ``stopped`` when the embedding code stopped it (``final_path`` is then the
    sampler of the stop checkpoint, or of the latest checkpoint when a step's outcome
    kept the stop from writing one; None when there is none)."""

    final_path: str | None
    run_dir: Path
    steps_completed: int
    metrics: tuple[dict[str, Any], ...] = field(repr=False)
    exhausted: bool = False
    stopped: bool = False
