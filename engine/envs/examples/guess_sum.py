"""Guess the sum: the model answers ``What is A + B?``; a wrong guess is answered
``Too high.`` or ``Too low.`` and the model guesses again, up to ``max_turns`` guesses.

Reward: ``1 - (t - 1) / max_turns`` when the ``t``-th guess is right (1.0 on the first
guess), 0 when no guess is right or a reply holds no integer (the episode then ends).
The first turn is the default arithmetic task's question, so the game starts from what
the default model half-knows; what RL can learn is the first guess and how far to move
after each hint.
"""

from __future__ import annotations

import re
from typing import Final

__all__ = [
    "DEFAULT_MAX_TURNS",
    "TOO_HIGH",
    "TOO_LOW",
    "feedback",
    "parse_guess",
    "question",
    "solved_reward",
]

DEFAULT_MAX_TURNS: Final = 6
TOO_HIGH: Final = "Too high."
TOO_LOW: Final = "Too low."

_INTEGER = re.compile(r"-?\d+")


def question(a: int, b: int) -> str:
    """The first user message."""
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
