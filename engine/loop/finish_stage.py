"""The finisher: awaits each submitted step in order, publishes its policy, records it.

For each step it awaits the training result and the snapshot, publishes the snapshot to
:class:`~engine.loop.policy.PolicyVersions` (admitting the steps that wait on it), checks
the staleness bound, builds the step's metrics and hands the
:class:`~engine.loop.results.StepResult` to ``on_step``; its loop state keeps every filed
group it has not trained, so nothing sampled is lost on resume. A step is "in flight" from
its first submission until ``on_step`` returns (:class:`~engine.loop.stopping.StopGate`),
so a stop only lands between steps; each recorded step gives the submitter a credit.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Awaitable, Callable

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from engine.core.state import LoopState, ScoredGroup
from engine.errors import EngineError
from engine.loop.messages import SubmittedStep, steps_done
from engine.loop.recipe import FinishedStep, HeldOut, StageContext, StepRecipe
from engine.loop.results import StepResult, StepTimeline
from engine.loop.step_metrics import StepTiming
from engine.session.api import SamplerHandle, TrainResult
from engine.session.retry import tally_retries
from engine.session.usage import spending_for

__all__ = ["FinishStage"]

_NO_TRAINING = TrainResult([], {}, {})
"""A step without datums: nothing was submitted (the quickstart skips its optim_step)."""


class FinishStage:
    """Finishes every step the submitter sends; ``run`` returns how many it recorded and
    the loop state after the last."""

    def __init__(
        self,
        context: StageContext,
        recipe: StepRecipe,
        on_step: Callable[[StepResult], Awaitable[None]],
        *,
        evaluate: HeldOut | None,
    ) -> None:
        self._pipeline = context.pipeline
        self._session = context.session
        self._state = context.state
        self._versions = context.versions
        self._meter = context.meter
        self._on_step = on_step
        self._gate = context.gate
        self._clock = context.clock
        self._progress = context.progress
        self._evaluate = evaluate
        self._recipe = recipe

    def evaluates(self, completed_steps: int) -> bool:
        """Whether the weights after ``completed_steps`` are evaluated."""
        return self._evaluate is not None and self._evaluate.due(completed_steps)

    async def run(
        self,
        receive: MemoryObjectReceiveStream[SubmittedStep],
        filed: MemoryObjectReceiveStream[ScoredGroup],
        credits: MemoryObjectSendStream[None],
    ) -> tuple[int, LoopState]:
        completed = 0
        state = self._state
        last_end = self._clock()
        untrained = {(g.step, g.index): g for g in self._state.pending_groups}
        async with receive, filed, credits:
            async for submitted in receive:
                done = steps_done(submitted.step)
                try:
                    result = (
                        await self._session.finish_train_step(submitted.ticket)
                        if submitted.ticket.submitted
                        else _NO_TRAINING
                    )
                    with tally_retries() as snapshot_retries:
                        if submitted.snapshot is not None:
                            handle = await self._session.finish_snapshot(submitted.snapshot)
                        else:  # no update: the weights (and the sampler) are unchanged
                            handle = SamplerHandle(done, self._versions.current.client)
                except BaseException:
                    self._gate.step_failed()
                    raise
                # Trained now, before the next version lets a step sample: progress is
                # never marked after the samples it admits were sent.
                self._progress(f"step {done} trained")
                if done < self._pipeline.steps:
                    self._versions.publish(handle)
                end = self._clock()
                state = dataclasses.replace(
                    submitted.state,
                    sampler_version=self._versions.current.version,
                    pending_groups=_untrained(submitted.state, untrained, filed),
                )
                timing = StepTiming(submitted.train_start, end, last_end, submitted.wait)
                step_result = self._step_result(
                    submitted, result, state, timing, snapshot_retries.count
                )
                if self.evaluates(done):
                    assert self._evaluate is not None
                    with spending_for(done):
                        step_result.metrics.update(await self._evaluate(done, handle))
                await self._on_step(step_result)
                self._gate.end_step(done)
                with contextlib.suppress(anyio.BrokenResourceError):
                    credits.send_nowait(None)  # room for one more step in flight
                last_end = end
                completed += 1
        return completed, state

    def _step_result(
        self,
        submitted: SubmittedStep,
        result: TrainResult,
        state: LoopState,
        timing: StepTiming,
        snapshot_retries: int,
    ) -> StepResult:
        done = steps_done(submitted.step)
        groups = submitted.groups
        staleness = submitted.step - min(g.version for g in groups)
        bound = self._pipeline.max_steps_off_policy
        if staleness > bound:
            raise EngineError(
                f"internal error: step {done} trained on data {staleness} versions old "
                f"(bound {bound})"
            )
        metrics, line = self._recipe.step_metrics(
            FinishedStep(
                done,
                groups,
                submitted.assembled,
                result,
                timing,
                self._meter,
                staleness,
                snapshot_retries,
            )
        )
        return StepResult(
            step=done,
            metrics=metrics,
            line=line,
            datums=submitted.assembled.datums,
            groups=groups,
            advantages=submitted.assembled.advantages,
            timeline=StepTimeline(
                sample_start=min(g.sample_started for g in groups),
                sample_end=max(g.sample_finished for g in groups),
                train_start=timing.train_start,
                train_end=timing.train_end,
            ),
            state=state,
            checkpoint=submitted.checkpoint,
        )


def _untrained(
    state: LoopState,
    untrained: dict[tuple[int, int], ScoredGroup],
    filed: MemoryObjectReceiveStream[ScoredGroup],
) -> tuple[ScoredGroup, ...]:
    """Every group filed by the submitter so far that ``state`` has not trained (what
    its checkpoint must keep, so nothing sampled is lost on resume)."""
    while True:
        try:
            group = filed.receive_nowait()
        except (anyio.WouldBlock, anyio.EndOfStream):
            break
        untrained[(group.step, group.index)] = group
    for key in [k for k, g in untrained.items() if state.trained(g)]:
        del untrained[key]
    return tuple(untrained[k] for k in sorted(untrained))
