"""A multi-turn environment in one file: addition with a second chance.

The model is asked ``What is A + B?``; a right answer ends the episode with reward 1; a
wrong one gets "try again" and a second attempt worth 0.5; two wrong answers end it with
0. Run it against the local server from the checkout::

    python -m engine.run --local --task examples.retry_addition:RetryAdditionTask \\
        --steps 20 --stop-at-eos

docs/environments.md walks through it.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from engine.envs import ChatGroup, EnvContext, MessageStep
from engine.tasks import Problem, SeededSource, extract_prediction
from engine.tasks.render import ChatMessage


class RetryAdditionEnv:
    """One episode: at most two attempts at one sum."""

    def __init__(self, a: int, b: int) -> None:
        self.question = f"What is {a} + {b}?"
        self.answer = a + b

    async def initial_messages(self) -> list[ChatMessage]:
        return [{"role": "user", "content": self.question}]

    async def respond(self, messages: Sequence[ChatMessage]) -> MessageStep:
        attempts = sum(1 for m in messages if m["role"] == "assistant")
        if extract_prediction(str(messages[-1]["content"])) == self.answer:
            return MessageStep(reward=1.0 if attempts == 1 else 0.5, done=True)
        if attempts >= 2:
            return MessageStep(done=True)
        return MessageStep([{"role": "user", "content": f"Wrong. {self.question}"}])


class RetryAdditionTask:
    """Two-digit sums, each a group of independent two-attempt episodes."""

    name = "retry-addition"

    def source(self, seed: int, state: Mapping[str, Any] | None = None) -> SeededSource:
        return SeededSource(self._make, seed, state)

    def group_builder(self, problem: Problem, group_size: int, context: EnvContext) -> ChatGroup:
        a, b = problem.data["a"], problem.data["b"]
        return ChatGroup([RetryAdditionEnv(a, b) for _ in range(group_size)], context)

    def _make(self, rng: random.Random, index: int) -> Problem:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        return Problem(index, f"What is {a} + {b}?", a + b, {"a": a, "b": b})
