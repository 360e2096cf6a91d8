"""What the pipeline asks of a run's objective (:mod:`engine.objectives` builds it): the
stage that makes each step's groups, each group's datums and the step's forward_backward,
the step's metrics and console line, and the held-out evaluator. The stages themselves
know no objective by name.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectSendStream

from engine.common.clock import Stopwatch
from engine.config.loop_settings import PipelineSettings
from engine.core.datums import Datum, GroupDatums
from engine.core.problems import ProblemSource
from engine.core.state import LoopState, ScoredGroup
from engine.envs.executors import Workers
from engine.envs.scoring import RewardError
from engine.loop.messages import RolledOut
from engine.loop.policy import PolicyVersions, Watermark
from engine.loop.step_metrics import ActivityMeter, Assembled, StepTiming
from engine.loop.stopping import StopGate
from engine.session.api import SamplerHandle, Session, StepTicket, TrainResult

__all__ = ["FinishedStep", "FirstStage", "HeldOut", "StageContext", "StepRecipe"]


class HeldOut(Protocol):
    """The held-out evaluator (``--eval-every``): whether the weights after a number of
    steps are evaluated, and their evaluation's metrics."""

    def due(self, step: int) -> bool: ...

    async def __call__(self, step: int, sampler: SamplerHandle) -> dict[str, float]: ...


class FirstStage(Protocol):
    """The stage that sends each step's groups to the submitter; ``exhausted`` once its
    source ran out before the last step."""

    exhausted: bool

    async def run(self, tg: TaskGroup, send: MemoryObjectSendStream[RolledOut]) -> None: ...


@dataclass(frozen=True)
class StageContext:
    """What the stages of one pipeline share: its settings, the session, the problem
    source and the loop state it starts from, the policy versions the finisher publishes
    (the rollout waits on them), the submitter's count of submitted steps, the sampling
    meter, the stop gate, the clock, and where progress and reward errors go."""

    pipeline: PipelineSettings
    session: Session
    source: ProblemSource
    state: LoopState
    versions: PolicyVersions
    submitted: Watermark
    meter: ActivityMeter
    gate: StopGate
    clock: Stopwatch = time.perf_counter
    progress: Callable[[str], None] = lambda what: None
    on_reward_error: Callable[[RewardError], None] = lambda error: None

    @classmethod
    def start(
        cls,
        pipeline: PipelineSettings,
        session: Session,
        source: ProblemSource,
        state: LoopState,
        sampler: SamplerHandle,
        gate: StopGate,
        *,
        clock: Stopwatch = time.perf_counter,
        progress: Callable[[str], None] = lambda what: None,
        on_reward_error: Callable[[RewardError], None] = lambda error: None,
    ) -> StageContext:
        """The context of a pipeline that starts at ``state``, sampling from ``sampler``."""
        return cls(
            pipeline,
            session,
            source,
            state,
            PolicyVersions(sampler),
            Watermark(state.next_step),
            ActivityMeter(clock),
            gate,
            clock,
            progress,
            on_reward_error,
        )


@dataclass(frozen=True)
class FinishedStep:
    """What the finisher knows of a trained step ``done`` (1-based): its metrics' input."""

    done: int
    groups: tuple[ScoredGroup, ...]
    assembled: Assembled
    result: TrainResult
    timing: StepTiming
    meter: ActivityMeter
    staleness: int
    snapshot_retries: int


class StepRecipe(Protocol):
    """An objective's part in the pipeline. ``samples``: its steps sample from the policy
    (a snapshot after every step; else only before an eval); ``episodic``: its groups are
    environment episodes; ``workers``: entered for the run (``--score-workers``)."""

    @property
    def samples(self) -> bool: ...

    @property
    def episodic(self) -> bool: ...

    @property
    def workers(self) -> Workers | None: ...

    def first_stage(self, context: StageContext) -> FirstStage: ...

    def datums(self, group: ScoredGroup) -> GroupDatums:
        """A trainable group's datums."""
        ...

    async def forward_backward(
        self,
        session: Session,
        ticket: StepTicket,
        groups: Sequence[ScoredGroup],
        datums: Sequence[Datum],
    ) -> None:
        """Submit ``datums`` (of ``groups``, in order) to ``ticket``'s step."""
        ...

    def step_metrics(self, step: FinishedStep) -> tuple[dict[str, Any], str]:
        """The step's metrics.jsonl event and its console line."""
        ...
