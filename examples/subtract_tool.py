"""Your own tool, learned: subtraction questions with a ``subtract`` tool the packaged
agent model never saw in training. It reads the tool from the schema its chat template
lists, calls it on some questions, and RL raises how often (the reward is 1 for the exact
difference, which the model cannot compute itself).

Run it with ``python -m engine.run --local --task examples.subtract_tool:SubtractTask``
from the checkout (docs/environments.md, "Your own tool"), then watch
``env/all/tool_calls`` (calls per episode) rise in ``metrics.jsonl``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from engine.basemodels.catalogue import AGENT_MODEL_DIR
from engine.envs import ChatGroup, EnvContext, MessageStep, tool
from engine.envs.examples.stops import stop_at_eos
from engine.tasks import ArithmeticTask, Problem, SeededSource
from engine.tasks.render import ChatMessage


@tool
def subtract(a: int, b: int) -> str:
    """Subtract b from a."""
    return str(a - b)


class SubtractEnv:
    """One question; the message layer runs the tool calls and asks :meth:`respond` about
    the reply that calls none."""

    def __init__(self, problem: Problem) -> None:
        self.problem = problem

    async def initial_messages(self) -> Sequence[ChatMessage]:
        return [{"role": "user", "content": self.problem.question}]

    async def respond(self, messages: Sequence[ChatMessage]) -> MessageStep:
        solved = str(messages[-1].get("content", "")).strip() == str(self.problem.answer)
        return MessageStep(reward=float(solved), done=True, metrics={"solved": float(solved)})


class SubtractTask:
    """``What is A - B?`` for A, B in 10..99, with the ``subtract`` tool."""

    name = "subtract-tool"
    local_model: ClassVar[Path] = AGENT_MODEL_DIR  # the model that reads tool schemas

    def __init__(self) -> None:
        self.problems = ArithmeticTask("-", min_operand=10, max_operand=99, eval_size=64)

    def source(self, seed: int, state: Mapping[str, Any] | None = None) -> SeededSource:
        return self.problems.source(seed, state)

    def eval_problems(self) -> list[Problem]:
        return self.problems.eval_problems()

    def group_builder(self, problem: Problem, group_size: int, context: EnvContext) -> ChatGroup:
        context = stop_at_eos(context, max_tokens=96)  # a call is about 60 tokens
        return ChatGroup([SubtractEnv(problem) for _ in range(group_size)], context, [subtract])
