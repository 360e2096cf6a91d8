"""The pipelined loop: rollout -> submitter -> finisher, in one anyio task group (the
run's objective says which stage makes the groups: :mod:`~engine.loop.recipe`; with
``--objective sft`` or ``dpo`` the SFT stage, :mod:`~engine.loop.sft_stage`, in place of
the rollout).

The stages (:mod:`~engine.loop.rollout_stage`, :mod:`~engine.loop.submit_stage`,
:mod:`~engine.loop.finish_stage`) are joined by bounded memory streams and pass each
other messages (:mod:`~engine.loop.messages`); the only thing that flows back is the
policy: the finisher publishes each new sampler version, which admits the steps that wait
for it (the staleness bound, docs/architecture.md), and the finisher's credits, which
bound the steps in flight. docs/architecture.md, "The stages and what flows between
them", and docs/reliability.md explain the rest.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import anyio

from engine.core.state import LoopState, ScoredGroup
from engine.loop.finish_stage import FinishStage
from engine.loop.messages import RolledOut, SubmittedStep
from engine.loop.recipe import HeldOut, StageContext, StepRecipe
from engine.loop.results import StepResult
from engine.loop.submit_stage import SubmitStage, checkpoint_name

__all__ = ["Pipeline", "PipelineOutcome", "checkpoint_name"]


@dataclass(frozen=True)
class PipelineOutcome:
    steps_completed: int
    exhausted: bool
    state: LoopState


class Pipeline:
    """One run of the loop from the context's ``state`` to ``--steps``, on the groups
    and the training ``recipe`` makes (the run's objective, :mod:`engine.objectives`).
    ``learning_rate`` and ``checkpoint_due`` are the config's (the submitter's);
    ``before_training`` is awaited once, right before the first call that trains."""

    def __init__(
        self,
        context: StageContext,
        recipe: StepRecipe,
        on_step: Callable[[StepResult], Awaitable[None]],
        *,
        learning_rate: float | None,
        checkpoint_due: Callable[[int], bool],
        evaluate: HeldOut | None = None,
        before_training: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self._pipeline = context.pipeline
        self._recipe = recipe
        self._first = recipe.first_stage(context)
        self._finish = FinishStage(context, recipe, on_step, evaluate=evaluate)
        self._submit = SubmitStage(
            context,
            recipe,
            learning_rate=learning_rate,
            checkpoint_due=checkpoint_due,
            sample_ahead=recipe.samples
            and (context.pipeline.sample_ahead is not None or not recipe.episodic),
            evaluates=self._finish.evaluates,
            before_training=before_training,
        )

    async def run(self) -> PipelineOutcome:
        cfg = self._pipeline
        # At most K + 1 steps of groups (with their reserves) are untrained at once, well
        # within the bound.
        bound = (cfg.max_steps_off_policy + 2) * (cfg.batch + cfg.refill_groups + 2)
        rolled_send, rolled_recv = anyio.create_memory_object_stream[RolledOut](bound)
        submitted_send, submitted_recv = anyio.create_memory_object_stream[SubmittedStep](
            cfg.submit_ahead + 1
        )
        # Every group the submitter files, for the finisher's checkpoints.
        filed_send, filed_recv = anyio.create_memory_object_stream[ScoredGroup](bound)
        credit_send, credit_recv = anyio.create_memory_object_stream[None](cfg.submit_ahead + 1)
        for _ in range(cfg.submit_ahead + 1):  # the steps that may be in flight at once
            credit_send.send_nowait(None)
        async with contextlib.AsyncExitStack() as workers:
            if self._recipe.workers is not None:  # a pool or a Ray cluster, for this run
                await workers.enter_async_context(self._recipe.workers)
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._first.run, tg, rolled_send)
                tg.start_soon(
                    self._submit.run, rolled_recv, submitted_send, filed_send, credit_recv
                )
                completed, state = await self._finish.run(submitted_recv, filed_recv, credit_send)
        return PipelineOutcome(completed, self._first.exhausted, state)
