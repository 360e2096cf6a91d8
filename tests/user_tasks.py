"""User tasks for the tests, loaded the way ``--task package.module:attr`` loads them."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import anyio

from engine.tasks import Problem, RewardBreakdown, SeededSource


class DigitCountTask:
    """Reward = the share of characters of the response that are digits (component
    ``digits``); ``async_score`` makes ``score`` a coroutine function."""

    name = "digit-count"

    def source(self, seed: int, state: Mapping[str, Any] | None = None) -> SeededSource:
        def make(rng: random.Random, index: int) -> Problem:
            n = rng.randint(1, 9)
            return Problem(index, f"Write {n} digits.", n)

        return SeededSource(make, seed, state)

    def prompt(self, problem: Problem) -> str:
        return f"Question: {problem.question}\nAnswer:"

    def score(self, response: str, problem: Problem) -> RewardBreakdown:
        share = sum(ch.isdigit() for ch in response) / max(1, len(response))
        return RewardBreakdown(share, {"digits": share})


class AsyncDigitCountTask(DigitCountTask):
    name = "digit-count-async"

    async def score(self, response: str, problem: Problem) -> RewardBreakdown:  # type: ignore[override]
        await anyio.lowlevel.checkpoint()
        return DigitCountTask.score(self, response, problem)


def make_task() -> DigitCountTask:
    """A zero-argument factory, as ``--task tests.user_tasks:make_task`` expects."""
    return DigitCountTask()


class ScaledDigitCountTask(DigitCountTask):
    """Takes a task argument (``--task-arg scale=2``): the reward is multiplied by it."""

    def __init__(self, scale: str = "1") -> None:
        self.scale = float(scale)
        self.name = f"digit-count-x{scale}"

    def score(self, response: str, problem: Problem) -> RewardBreakdown:
        share = DigitCountTask.score(self, response, problem).total * self.scale
        return RewardBreakdown(share, {"digits": share})


class ChatDigitCountTask(DigitCountTask):
    """The same task with a chat-message prompt."""

    name = "digit-count-chat"
    skip_special_tokens = True

    def prompt(self, problem: Problem) -> list[dict[str, str]]:  # type: ignore[override]
        return [{"role": "user", "content": problem.question}]


def digits_and_answer(response: str, problem: Problem) -> RewardBreakdown:
    """A reward for ``--task-arg reward=tests.user_tasks:digits_and_answer``: the share
    of digits, plus 1 for the answer (components ``digits`` and ``answer``)."""
    digits = sum(ch.isdigit() for ch in response) / max(1, len(response))
    answer = float(response.strip() == str(problem.answer))
    return RewardBreakdown(digits + answer, {"digits": digits, "answer": answer})


async def async_answer(response: str, problem: Problem) -> float:
    """The same as an ``async def`` returning a bare number (1 for the answer)."""
    await anyio.lowlevel.checkpoint()
    return float(response.strip() == str(problem.answer))


def not_finite(response: str, problem: Problem) -> float:
    return float("nan")


NOT_A_FUNCTION = 3
