"""Guess the sum: the model answers ``What is A + B?``; a wrong guess is answered
``Too high.`` or ``Too low.`` and the model guesses again, up to ``max_turns`` guesses.

Reward: ``1 - (t - 1) / max_turns`` when the ``t``-th guess is right (1.0 on the first
guess), 0 when no guess is right or a reply holds no integer (the episode then ends).
The first turn is the default arithmetic task's question (problems and held-out pairs
come from :class:`~engine.tasks.arithmetic.ArithmeticTask`), so the game starts from
what the packaged models half-know; RL learns the first guess and how far to move after
each hint. Episodes run 1 to ``max_turns`` turns.

Run: ``python -m engine.run --local --task engine.envs.examples.guess_sum:GuessSumTask``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Final

from engine.basemodels.catalogue import AGENT_MODEL_DIR
from engine.core.problems import Problem, SeededSource
from engine.envs.examples.stops import stop_at_eos
from engine.envs.messages import ChatGroup, MessageStep
from engine.envs.types import EnvContext, EnvGroupBuilder
from engine.tasks.arithmetic import ArithmeticTask
from engine.tasks.render import ChatMessage

__all__ = [
    "DEFAULT_MAX_TURNS",
    "MAX_REPLY_TOKENS",
    "TOO_HIGH",
    "TOO_LOW",
    "GuessSumEnv",
    "GuessSumTask",
    "feedback",
    "parse_guess",
    "question",
    "solved_reward",
]

DEFAULT_MAX_TURNS: Final = 6
MAX_REPLY_TOKENS: Final = 8
"""A guess is a number: a few bytes and EOS (six guesses then fit a 256-token context)."""
TOO_HIGH: Final = "Too high."
TOO_LOW: Final = "Too low."

_INTEGER = re.compile(r"-?\d+")


def question(a: int, b: int) -> str:
    """The first user message (the arithmetic task's question)."""
    return f"What is {a} + {b}?"


def parse_guess(reply: str) -> int | None:
    """The first integer of a reply, or None."""
    match = _INTEGER.search(reply)
    return int(match.group()) if match else None


def feedback(guess: int, target: int) -> str | None:
    """The user's hint after a guess, None when the guess is right."""
    if guess == target:
        return None
    return TOO_HIGH if guess > target else TOO_LOW


def solved_reward(turn: int, max_turns: int) -> float:
    """Reward of an episode solved on guess ``turn`` (1-based) of at most ``max_turns``."""
    if not 1 <= turn <= max_turns:
        raise ValueError(f"turn must be in 1..{max_turns}, got {turn}")
    return 1.0 - (turn - 1) / max_turns


class GuessSumEnv:
    """One game (a :class:`~engine.envs.messages.MessageEnv`)."""

    def __init__(self, problem: Problem, max_turns: int = DEFAULT_MAX_TURNS) -> None:
        self.problem = problem
        self.max_turns = max_turns
        self.guesses = 0

    async def initial_messages(self) -> Sequence[ChatMessage]:
        return [{"role": "user", "content": self.problem.question}]

    async def respond(self, messages: Sequence[ChatMessage]) -> MessageStep:
        self.guesses += 1
        guess = parse_guess(str(messages[-1].get("content", "")))
        hint = None if guess is None else feedback(guess, int(self.problem.answer))
        if guess is not None and hint is None:
            return MessageStep(
                reward=solved_reward(self.guesses, self.max_turns),
                done=True,
                metrics={"solved": 1.0, "guesses": float(self.guesses)},
            )
        if hint is None or self.guesses >= self.max_turns:
            return MessageStep(
                done=True,
                metrics={
                    "solved": 0.0,
                    "guesses": float(self.guesses),
                    "no_number": 1.0 * (guess is None),
                },
            )
        return MessageStep(messages=[{"role": "user", "content": hint}])


class GuessSumTask:
    """The game on two-digit sums; ``--task-arg`` values: ``max_turns`` (default 6),
    ``min_operand``/``max_operand`` (10..99) and ``eval_size`` (held-out pairs, default
    64), strings as the command line gives them."""

    local_model: ClassVar[Path] = AGENT_MODEL_DIR
    """The local server loads the packaged agent model for this task unless a model is
    given (``--local-model``): the default model does not know the game's format."""

    def __init__(
        self,
        max_turns: int | str = DEFAULT_MAX_TURNS,
        min_operand: int | str = 10,
        max_operand: int | str = 99,
        eval_size: int | str = 64,
    ) -> None:
        self.max_turns = _positive_int("max_turns", max_turns)
        self.problems = ArithmeticTask.from_args(
            {
                "op": "+",
                "min_operand": str(min_operand),
                "max_operand": str(max_operand),
                "eval_size": str(eval_size),
            }
        )
        self.name = "guess-sum"

    def source(self, seed: int, state: Mapping[str, Any] | None = None) -> SeededSource:
        return self.problems.source(seed, state)

    def eval_problems(self) -> list[Problem]:
        """The held-out pairs (the same for every seed; never drawn for training)."""
        return self.problems.eval_problems()

    def group_builder(
        self, problem: Problem, group_size: int, context: EnvContext
    ) -> EnvGroupBuilder:
        envs = [GuessSumEnv(problem, self.max_turns) for _ in range(group_size)]
        return ChatGroup(envs, stop_at_eos(context, MAX_REPLY_TOKENS))


def _positive_int(name: str, value: int | str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if number < 1:
        raise ValueError(f"{name} must be >= 1, got {number}")
    return number
