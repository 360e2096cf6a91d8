"""The submitter: assembles each step from exactly its groups and submits its training.

Step ``s`` is problem ``s * (batch + R) + i`` of the source for each group ``i`` the
rollout stage announced (:class:`~engine.loop.messages.StepClosed`: ``batch``, plus the
reserves it sampled of the ``R = --refill-groups`` drawn), in problem order whatever
versions sampled its groups and whatever order they finished in; with
``--step-order completion`` it is the first ``batch`` groups to finish that the
staleness window lets it train (:mod:`~engine.loop.step_order`). Its
forward_backward, optim_step and the snapshot of the weights after it (version
``s + 1``) are submitted back to back without awaiting anything: while step ``s``'s
results are outstanding step ``s + 1`` is already submitted (``--submit-ahead`` steps
at most: a credit from the finisher per recorded step), so the server's clock never
idles between steps. A due checkpoint is submitted right behind the optim step, so it
holds exactly the steps before it. Every group received is filed with the finisher (it
keeps the untrained ones in its checkpoints).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Sequence

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from engine.core.datums import Datum, GroupDatums
from engine.core.state import LoopState, ScoredGroup
from engine.loop.messages import RolledOut, SubmittedStep, steps_done
from engine.loop.recipe import StageContext, StepRecipe
from engine.loop.step_metrics import Assembled
from engine.loop.step_order import CompletionOrder, GroupKey, ProblemOrder, StepOrder
from engine.session.api import PendingCheckpoint, PendingSnapshot, StepTicket

__all__ = ["SubmitStage", "checkpoint_name"]


def checkpoint_name(completed_steps: int) -> str:
    """The server-side name of the checkpoint after ``completed_steps`` steps."""
    return f"step-{completed_steps}"


class _StepAssembly:
    """The step being assembled: the datums of each group (built once), the datums in
    submission order (the order of the trainer's outputs) and the step's ticket."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.ticket = StepTicket(steps_done(step))
        self.built: dict[GroupKey, GroupDatums] = {}
        self.datums: list[Datum] = []
        self.train_start: float | None = None

    def assembled(self, groups: Sequence[ScoredGroup]) -> Assembled:
        built = [(g, self.built[(g.step, g.index)]) for g in groups]
        return Assembled(
            datums=tuple(self.datums),
            advantages=tuple(tuple(b.advantages) for _, b in built),
            empty=sum(b.skipped_empty for _, b in built),
            zero_advantage=sum(b.skipped_zero_advantage for _, b in built),
            missing_logprobs=sum(b.dropped_missing_logprobs for _, b in built),
            masked=sum(b.masked for _, b in built),
            constant_groups=sum(1 for g, b in built if g.trainable and b.constant_reward),
            used_groups=sum(1 for _, b in built if b.datums),
        )


class SubmitStage:
    """Submits steps ``state.next_step`` to ``--steps``, each optim step at
    ``learning_rate``. ``evaluates`` says whether the weights after a step are evaluated
    (then snapshotted), ``checkpoint_due`` whether a checkpoint follows it;
    ``before_training`` is awaited once, right before the first call that trains."""

    def __init__(
        self,
        context: StageContext,
        recipe: StepRecipe,
        *,
        learning_rate: float | None,
        checkpoint_due: Callable[[int], bool],
        sample_ahead: bool,
        evaluates: Callable[[int], bool],
        before_training: Callable[[], Awaitable[None]] | None,
    ) -> None:
        if learning_rate is None:
            raise ValueError("the config must be resolved before it runs")
        self._pipeline = context.pipeline
        self._lr: float = learning_rate
        self._checkpoint_due = checkpoint_due
        self._recipe = recipe
        self._session = context.session
        self._state = context.state
        self._submitted = context.submitted
        self._gate = context.gate
        self._clock = context.clock
        self._sample_ahead = sample_ahead
        self._evaluates = evaluates
        self._before_training = before_training

    async def run(
        self,
        receive: MemoryObjectReceiveStream[RolledOut],
        send: MemoryObjectSendStream[SubmittedStep],
        filed: MemoryObjectSendStream[ScoredGroup],
        credits: MemoryObjectReceiveStream[None],
    ) -> None:
        cfg = self._pipeline
        now = self._clock()
        # Restored from a checkpoint: ready now (their old clock values mean nothing).
        restored = [
            dataclasses.replace(
                g, sample_started=now, sample_finished=now, score_started=now, score_finished=now
            )
            for g in self._state.pending_groups
        ]
        order: StepOrder = (
            CompletionOrder(cfg, self._state, restored)
            if cfg.step_order == "completion"
            else ProblemOrder(restored)
        )
        trained = self._state.trained_problem_ids
        submitted_at = complete_at = now
        async with receive, send, filed, credits:
            for step in range(self._state.next_step, cfg.steps):
                assembly = _StepAssembly(step)
                while True:
                    complete = order.complete(step)
                    if not await self._submit_ready(
                        assembly, order.arrived(step), credits, complete
                    ):
                        return  # the finisher has stopped
                    if complete:
                        break
                    try:
                        message = await receive.receive()
                    except anyio.EndOfStream:
                        return  # the source ran out
                    if isinstance(message, ScoredGroup):
                        await filed.send(message)
                    if order.receive(message, step):
                        complete_at = self._clock()
                closed = order.close(step)
                groups = closed.groups
                if not await self._open(assembly, credits):
                    return
                done = steps_done(step)
                snapshot: PendingSnapshot | None = None
                if assembly.datums:
                    await self._session.submit_optim_step(assembly.ticket, self._lr)
                    # Steps that sample nothing (SFT, DPO) snapshot only for an eval.
                    samples_next = done < cfg.steps and self._recipe.samples
                    if samples_next or self._evaluates(done):
                        # Right behind the optim step: it snapshots the new weights.
                        snapshot = await self._session.submit_snapshot(done)
                checkpoint: PendingCheckpoint | None = None
                if self._checkpoint_due(done):
                    # Behind it too: it saves exactly the steps trained so far.
                    checkpoint = await self._session.submit_checkpoint(done, checkpoint_name(done))
                trained = (*trained, *(g.problem.id for g in groups))
                if self._sample_ahead:
                    # The next step's sample requests would queue in the SDK ahead of this
                    # step's calls, which it posts a round trip apart: let them land first.
                    await self._session.delivered(done)
                self._submitted.reached(done)
                state = LoopState(
                    next_step=done,
                    source_state=closed.source_state,
                    sampler_version=done,
                    trained_problem_ids=trained,
                    next_draw=closed.next_draw,
                    trained_ahead=closed.trained_ahead,
                )
                assert assembly.train_start is not None
                await send.send(
                    SubmittedStep(
                        step,
                        groups,
                        assembly.assembled(groups),
                        assembly.ticket,
                        snapshot,
                        checkpoint,
                        state,
                        assembly.train_start,
                        max(0.0, complete_at - submitted_at),
                    )
                )
                submitted_at = self._clock()

    async def _submit_ready(
        self,
        assembly: _StepAssembly,
        arrived: dict[GroupKey, ScoredGroup],
        credits: MemoryObjectReceiveStream[None],
        complete: bool,
    ) -> bool:
        """Submit forward_backward for what is ready: every group once the step is
        complete; with ``--stream-minibatches M`` each ``M`` arrived groups before that.
        False when the finisher has stopped."""
        m = self._pipeline.stream_minibatches
        waiting = [i for i in sorted(arrived) if i not in assembly.built]
        size = len(waiting) if complete else (m or 0)
        while size and len(waiting) >= size:
            chunk, waiting = waiting[:size], waiting[size:]
            datums: list[Datum] = []
            for i in chunk:
                built = self._datums(arrived[i])
                assembly.built[i] = built
                datums.extend(built.datums)
            if datums:
                if not await self._open(assembly, credits):
                    return False
                await self._recipe.forward_backward(
                    self._session, assembly.ticket, [arrived[i] for i in chunk], datums
                )
                assembly.datums.extend(datums)
        return True

    async def _open(
        self, assembly: _StepAssembly, credits: MemoryObjectReceiveStream[None]
    ) -> bool:
        """Mark the step in flight before its first submission: a credit (room among the
        steps in flight), and no stop pending. False when the finisher has stopped."""
        if assembly.train_start is not None:
            return True
        try:
            await credits.receive()
        except anyio.EndOfStream:
            return False
        await self._gate.begin_step(assembly.ticket.step)
        if self._before_training is not None:
            before, self._before_training = self._before_training, None
            await before()
        assembly.train_start = self._clock()
        return True

    def _datums(self, group: ScoredGroup) -> GroupDatums:
        """The group's datums (the objective's; none of an untrainable group)."""
        if not group.trainable:
            return GroupDatums([], [0.0] * len(group.trajectories), 0, 0, 0)
        return self._recipe.datums(group)
