"""What the pipeline's stages send each other: each message carries everything the next
stage needs, so no stage reads another's state (docs/architecture.md, "The stages")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.core.state import LoopState, ScoredGroup
from engine.loop.step_metrics import Assembled
from engine.session.api import PendingCheckpoint, PendingSnapshot, StepTicket

__all__ = [
    "GroupsStarted",
    "RolledOut",
    "StepClosed",
    "StepOpened",
    "SubmittedStep",
    "steps_done",
]


@dataclass(frozen=True)
class StepOpened:
    """The rollout stage drew step ``step``'s problems; ``source_after`` is the source's
    state after them (= before the next step's): the loop state once the step is
    trained."""

    step: int
    source_after: dict[str, Any]


@dataclass(frozen=True)
class StepClosed:
    """Step ``step`` has ``groups`` groups, indices ``0..groups-1`` (``--batch``, plus
    the reserves dynamic sampling sampled: :mod:`~engine.loop.refill`); sent once that
    number is final, before or after the groups themselves."""

    step: int
    groups: int


@dataclass(frozen=True)
class GroupsStarted:
    """``--step-order completion``: the groups ``indices`` of step ``step`` start now,
    each at sampler version ``admitted`` or newer (so none may train after step
    ``admitted + K``); sent before any of them finishes."""

    step: int
    indices: tuple[int, ...]
    admitted: int


RolledOut = StepOpened | StepClosed | GroupsStarted | ScoredGroup
"""Rollout -> submitter: a step's opening, its groups as they start (completion order)
and finish, and its size."""


@dataclass(frozen=True)
class SubmittedStep:
    """Submitter -> finisher: a step whose training calls are submitted, with everything
    the finisher needs to finish it (``step`` is 0-based, see :func:`steps_done`)."""

    step: int
    groups: tuple[ScoredGroup, ...]
    assembled: Assembled
    ticket: StepTicket
    snapshot: PendingSnapshot | None
    checkpoint: PendingCheckpoint | None
    state: LoopState
    train_start: float
    wait: float


def steps_done(step: int) -> int:
    """The steps trained once 0-based ``step`` is: the number that tickets, the stop
    gate, metrics, logs and checkpoints give the step (they count from 1), the policy
    version its update produces, and the index of the next step."""
    return step + 1
