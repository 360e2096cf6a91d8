"""The source stage of supervised fine-tuning (``--objective sft``): conversations ->
ready groups, in place of the rollout stage.

Nothing is sampled: each step draws ``--batch`` conversations from the task's source,
announces the step (:class:`~engine.loop.messages.StepOpened`, with the source's state
after it: the data cursor a checkpoint keeps) and sends one group per conversation,
rendered by :class:`ConversationPlan`. The submitter and the finisher are the RL
loop's: the submitter turns a group into its ``cross_entropy`` datums
(:func:`~engine.core.datums.supervised_datums`) and keeps ``--submit-ahead`` steps in
flight, so the server never waits for the client (docs/sft.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import anyio
from anyio.streams.memory import MemoryObjectSendStream

from engine.common.clock import Stopwatch
from engine.config import EngineConfig
from engine.core.problems import Problem, ProblemSource
from engine.core.state import LoopState, ScoredGroup
from engine.core.trajectory import Trajectory, Turn
from engine.errors import ConfigError
from engine.loop.groups import NotSampled
from engine.loop.messages import RolledOut, StepClosed, StepOpened, steps_done
from engine.loop.rollout_stage import draw_step
from engine.tasks.conversations import render_conversation
from engine.tasks.render import ChatMessage, PromptRenderer

__all__ = ["ConversationPlan", "ConversationSource", "SftStage", "check_conversation_task"]


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

    def build(self, problem: Problem, version: int) -> Trajectory | NotSampled:
        turns = render_conversation(self._renderer.context, self._task.conversation(problem))
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
    """Sends the groups of steps ``state.next_step`` to ``config.pipeline.steps`` (those
    a checkpoint kept are not sent again); ``exhausted`` is set when the source ran out
    first (``--task-arg epochs=N``)."""

    def __init__(
        self,
        config: EngineConfig,
        plan: ConversationPlan,
        source: ProblemSource,
        state: LoopState,
        *,
        clock: Stopwatch,
        progress: Callable[[str], None],
    ) -> None:
        self._config = config
        self._plan = plan
        self._source = source
        self._state = state
        self._clock = clock
        self._progress = progress
        self.exhausted = False

    async def run(self, send: MemoryObjectSendStream[RolledOut]) -> None:
        cfg = self._config.pipeline
        pending = {(g.step, g.index) for g in self._state.pending_groups}
        async with send:
            for step in range(self._state.next_step, cfg.steps):
                problems = draw_step(self._source, cfg.batch)
                if problems is None:
                    self.exhausted = True
                    return
                await send.send(StepOpened(step, self._source.state()))
                await send.send(StepClosed(step, cfg.batch))
                for index, problem in enumerate(problems):
                    if (step, index) in pending:
                        continue  # sent before a resume: reused as is
                    now = self._clock()
                    built = self._plan.build(problem, step)
                    if isinstance(built, NotSampled):
                        group = ScoredGroup(
                            step,
                            index,
                            problem,
                            step,
                            (),
                            now,
                            now,
                            now,
                            now,
                            too_long=built.reason,
                        )
                    else:
                        done = self._clock()
                        group = ScoredGroup(
                            step, index, problem, step, (built,), now, done, done, done
                        )
                    await send.send(group)
                    await anyio.lowlevel.checkpoint()
                self._progress(f"step {steps_done(step)} conversations rendered")
