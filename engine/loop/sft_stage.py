"""The source stage of supervised fine-tuning (``--objective sft``) and of preference
pairs (``--objective dpo``): data -> ready groups, in place of the rollout stage.

Nothing is sampled: each step draws ``--batch`` rows from the task's source, announces
the step (:class:`~engine.loop.messages.StepOpened`, with the source's state after it:
the data cursor a checkpoint keeps) and sends one group per row: a conversation rendered
by :class:`ConversationPlan`, or a pair rendered by :class:`~engine.loop.dpo.PairPlan`
with the reference's logprobs of its responses (:class:`~engine.loop.reference.Reference`,
a step's pairs at once). The submitter and the finisher are the RL loop's: the submitter
turns a group into its datums (:func:`~engine.core.datums.supervised_datums`) and keeps
``--submit-ahead`` steps in flight, so the server never waits for the client
(docs/sft.md, docs/dpo.md).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import anyio
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectSendStream

from engine.core.problems import Problem
from engine.core.state import ScoredGroup
from engine.core.trajectory import Trajectory, Turn
from engine.errors import ConfigError
from engine.loop.groups import NotSampled
from engine.loop.messages import RolledOut, StepClosed, StepOpened, steps_done
from engine.loop.recipe import StageContext
from engine.loop.rollout_stage import draw_step
from engine.tasks.conversations import (
    ConversationTooLong,
    max_context_chars,
    render_conversation,
)
from engine.tasks.render import ChatMessage, PromptRenderer

__all__ = [
    "BuildGroup",
    "ConversationPlan",
    "ConversationSource",
    "SftStage",
    "check_conversation_task",
]

BuildGroup = Callable[[Problem, int], Awaitable["tuple[Trajectory, ...] | NotSampled"]]
"""A ready group's trajectories of a problem for 0-based step ``step``, or why it has none."""


class ConversationSource(Protocol):
    """What ``--objective sft`` needs of a task beyond a source: each problem's
    conversation (:class:`~engine.tasks.conversations.ConversationTask` has it)."""

    def conversation(self, problem: Problem) -> list[ChatMessage]: ...


def check_conversation_task(task: Any) -> None:
    """ConfigError unless ``task`` gives each problem a conversation."""
    if not callable(getattr(task, "conversation", None)):
        raise ConfigError(
            f"--objective sft trains on conversations, and task {task.name!r} has none "
            '(--task jsonl:PATH of {"messages": [...]} lines; your own task: a '
            "conversation(problem) method)"
        )


class ConversationPlan:
    """How a conversation becomes a group: one trajectory whose turns are its assistant
    messages (the context before each, the message's tokens; no logprobs, version =
    the step that trains it)."""

    episodic = False
    workers = None

    def __init__(self, task: Any, renderer: PromptRenderer, max_context: int | None) -> None:
        check_conversation_task(task)
        self._task: ConversationSource = task
        self._renderer = renderer
        self._max_context = max_context
        self._max_chars = max_context_chars(renderer.context.tokenizer, max_context)

    def build(self, problem: Problem, version: int) -> Trajectory | NotSampled:
        try:
            turns = render_conversation(
                self._renderer.context,
                self._task.conversation(problem),
                max_chars=self._max_chars,
            )
        except ConversationTooLong as too_long:  # found before a token of it was computed
            return NotSampled(
                f"conversation {problem.id} of {too_long.chars} characters exceeds the "
                f"model's context of {self._max_context} tokens (at most {self._max_chars} "
                "characters fit in it)"
            )
        longest = max(len(context) + len(message) for context, message in turns)
        if self._max_context is not None and longest > self._max_context:
            return NotSampled(
                f"conversation {problem.id} of {longest} tokens exceeds the model's context "
                f"of {self._max_context} tokens"
            )
        return Trajectory(
            tuple(
                Turn(tuple(context), tuple(message), None, version, "stop")
                for context, message in turns
            )
        )


class SftStage:
    """Sends the groups of steps ``state.next_step`` to ``--steps`` (those a
    checkpoint kept are not sent again), each built by ``build`` (a conversation, or a
    pair with its reference logprobs); ``exhausted`` is set when the source ran out first
    (``--task-arg epochs=N``)."""

    def __init__(self, context: StageContext, build: BuildGroup) -> None:
        self._pipeline = context.pipeline
        self._build = build
        self._source = context.source
        self._state = context.state
        self._clock = context.clock
        self._progress = context.progress
        self.exhausted = False

    async def run(self, tg: TaskGroup, send: MemoryObjectSendStream[RolledOut]) -> None:
        # Each step's groups are built in a task group of their own: ``tg`` is the
        # pipeline's, which the rollout stage uses.
        cfg = self._pipeline
        pending = {(g.step, g.index) for g in self._state.pending_groups}
        async with send:
            for step in range(self._state.next_step, cfg.steps):
                problems = draw_step(self._source, cfg.batch)
                if problems is None:
                    self.exhausted = True
                    return
                await send.send(StepOpened(step, self._source.state()))
                await send.send(StepClosed(step, cfg.batch))
                groups: dict[int, ScoredGroup] = {}
                async with anyio.create_task_group() as builds:
                    for index, problem in enumerate(problems):
                        if (step, index) not in pending:  # else sent before a resume
                            builds.start_soon(self._ready, step, index, problem, groups)
                for index in sorted(groups):
                    await send.send(groups[index])
                    await anyio.lowlevel.checkpoint()
                self._progress(f"step {steps_done(step)} groups ready")

    async def _ready(
        self, step: int, index: int, problem: Problem, groups: dict[int, ScoredGroup]
    ) -> None:
        """The group of ``problem``, in ``groups[index]``."""
        now = self._clock()
        built = await self._build(problem, step)
        if isinstance(built, NotSampled):
            groups[index] = ScoredGroup(
                step, index, problem, step, (), now, now, now, now, too_long=built.reason
            )
        else:
            done = self._clock()
            groups[index] = ScoredGroup(step, index, problem, step, built, now, done, done, done)
