"""Reward presets for dataset tasks: exact match, numeric with tolerance, ``\\boxed{}``
math answers (checked by ``math-verify``) and a regular expression.

``numeric`` reads one number of the response, at ``numeric_position``: ``first`` (the
default: the packaged arithmetic model answers with the number alone), ``last`` (chat
models that explain before they answer) or ``boxed`` (the number inside the last
``\\boxed{...}``).

Each preset is a function ``(response, answer) -> RewardBreakdown`` with one component,
``correct`` (1.0 or 0.0), so ``exact_rate`` in the step line and ``eval/correct/rate``
read as the fraction of correct responses.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, Final

from engine.errors import ConfigError
from engine.tasks.base import RewardBreakdown

__all__ = ["NUMERIC_POSITIONS", "REWARD_PRESETS", "RewardFn", "make_reward", "normalize_text"]

RewardFn = Callable[[str, Any], RewardBreakdown]

REWARD_PRESETS: Final = ("exact", "numeric", "boxed", "regex")
NUMERIC_POSITIONS: Final = ("first", "last", "boxed")

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?|-?\.\d+")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def normalize_text(text: str) -> str:
    """Lower-cased, whitespace collapsed, surrounding whitespace and a final period
    removed: what ``exact`` compares."""
    return " ".join(str(text).split()).lower().rstrip(".").strip()


def _verdict(correct: bool) -> RewardBreakdown:
    value = 1.0 if correct else 0.0
    return RewardBreakdown(value, {"correct": value})


def _number(text: str, position: str = "first") -> float | None:
    """The number at ``position`` of ``text`` (one of :data:`NUMERIC_POSITIONS`)."""
    if position == "boxed":
        boxes = _BOXED.findall(text)
        if not boxes:
            return None
        text = boxes[-1]
    matches = _NUMBER.findall(text)
    if not matches:
        return None
    try:
        return float((matches[-1] if position == "last" else matches[0]).replace(",", ""))
    except ValueError:
        return None


def _exact(response: str, answer: Any) -> RewardBreakdown:
    return _verdict(normalize_text(response) == normalize_text(str(answer)))


def _numeric(tolerance: float, position: str) -> RewardFn:
    def score(response: str, answer: Any) -> RewardBreakdown:
        guess, gold = _number(response, position), _number(str(answer))
        if guess is None or gold is None:
            return _verdict(False)
        return _verdict(abs(guess - gold) <= tolerance * max(1.0, abs(gold)))

    return score


def _regex(pattern: str) -> RewardFn:
    try:
        compiled = re.compile(pattern)
    except re.error as exc:
        raise ConfigError(f"invalid reward pattern {pattern!r}: {exc}") from None

    def score(response: str, answer: Any) -> RewardBreakdown:
        match = compiled.search(response)
        if match is None:
            return _verdict(False)
        found = match.group(1) if compiled.groups else match.group()
        return _verdict(normalize_text(found) == normalize_text(str(answer)))

    return score


def _boxed() -> RewardFn:
    try:
        import math_verify
    except ImportError:
        raise ConfigError(
            "reward=boxed needs math-verify: pip install 'engine[math]' (math-verify==0.9.0)"
        ) from None

    def score(response: str, answer: Any) -> RewardBreakdown:
        # No timeouts: math-verify's are signal-based, and rewards run in worker threads.
        gold = math_verify.parse(_as_boxed(str(answer)), parsing_timeout=None)
        guess = math_verify.parse(response, parsing_timeout=None)
        if not gold or not guess:
            return _verdict(False)
        return _verdict(bool(math_verify.verify(gold, guess, timeout_seconds=None)))

    return score


def _as_boxed(answer: str) -> str:
    return answer if "\\boxed" in answer else f"$\\boxed{{{answer}}}$"


def make_reward(preset: str, options: Mapping[str, str]) -> RewardFn:
    """The reward function of ``preset`` with its options (``tolerance`` and
    ``numeric_position`` for numeric, ``pattern`` for regex); a ConfigError names what is
    wrong."""
    if preset == "exact":
        return _exact
    if preset == "numeric":
        text = options.get("tolerance", "1e-6")
        try:
            tolerance = float(text)
        except ValueError:
            raise ConfigError(f"task argument tolerance must be a number, got {text!r}") from None
        if not tolerance >= 0:
            raise ConfigError(f"task argument tolerance must be >= 0, got {text!r}")
        position = options.get("numeric_position", "first")
        if position not in NUMERIC_POSITIONS:
            raise ConfigError(
                f"task argument numeric_position must be one of {', '.join(NUMERIC_POSITIONS)}, "
                f"got {position!r}"
            )
        return _numeric(tolerance, position)
    if preset == "regex":
        pattern = options.get("pattern")
        if not pattern:
            raise ConfigError("reward=regex needs the task argument pattern=REGEX")
        return _regex(pattern)
    if preset == "boxed":
        return _boxed()
    raise ConfigError(f"unknown reward {preset!r}; choose one of {', '.join(REWARD_PRESETS)}")
