"""Reward presets for dataset tasks: exact match, numeric with tolerance, ``\\boxed{}``
math answers (checked by ``math-verify``) and a regular expression.

``numeric`` reads one number of the response, at ``numeric_position``: ``first`` (the
default: the packaged arithmetic model answers with the number alone), ``last`` (chat
models that explain before they answer) or ``boxed`` (the number inside the last
``\\boxed{...}``).

Each preset is a function ``(response, answer) -> RewardBreakdown`` with one component,
``correct`` (1.0 or 0.0), so ``exact_rate`` in the step line and ``eval/correct/rate``
read as the fraction of correct responses.

A reward named ``module:function`` is the user's own (:func:`user_reward`): ``(response,
problem)``, sync or ``async def``, returning a number or a RewardBreakdown; what it
returns is checked as any task's reward is (:func:`engine.envs.scoring.check_reward`).
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import regex

from engine.common.imports import import_attr
from engine.core.problems import RewardBreakdown
from engine.errors import ConfigError

__all__ = [
    "NUMERIC_POSITIONS",
    "PATTERN_TIMEOUT_S",
    "REWARD_PRESETS",
    "RewardFn",
    "make_reward",
    "normalize_text",
    "user_reward",
]

RewardFn = Callable[[str, Any], RewardBreakdown]

REWARD_PRESETS: Final = ("exact", "numeric", "boxed", "regex")
NUMERIC_POSITIONS: Final = ("first", "last", "boxed")

PATTERN_TIMEOUT_S: Final = 1.0
"""How long the ``regex`` preset may match one response before it is a reward error."""

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


@dataclass(frozen=True)
class _Numeric:
    """The number at ``position`` of the response within ``tolerance`` of the answer's.
    A class, not a closure: presets must pickle for ``--score-workers processes:N``."""

    tolerance: float
    position: str = "first"

    def __call__(self, response: str, answer: Any) -> RewardBreakdown:
        guess, gold = _number(response, self.position), _number(str(answer))
        if guess is None or gold is None:
            return _verdict(False)
        return _verdict(abs(guess - gold) <= self.tolerance * max(1.0, abs(gold)))


@dataclass(frozen=True)
class _Regex:
    """The answer is group 1 (or the whole match) of the pattern's first match.

    Why the ``regex`` package: a catastrophic pattern (``(.|.)*#``) can backtrack for
    hours, and ``re`` holds the interpreter lock all along, so no signal, stop or
    watchdog gets through. ``regex`` releases the lock while it matches
    (``concurrent=True``) and gives up after ``timeout`` seconds (a TimeoutError: a
    reward error for the group, which ``--on-reward-error`` handles)."""

    pattern: str
    timeout: float

    def __post_init__(self) -> None:
        _compiled(self.pattern)  # a bad pattern is a ConfigError now, not mid-run

    def __call__(self, response: str, answer: Any) -> RewardBreakdown:
        compiled = _compiled(self.pattern)
        try:
            match = compiled.search(response, concurrent=True, timeout=self.timeout)
        except TimeoutError:
            raise TimeoutError(
                f"reward pattern {self.pattern!r} took over {self.timeout:g}s on a "
                f"{len(response)}-character response (task argument pattern_timeout)"
            ) from None
        if match is None:
            return _verdict(False)
        found = match.group(1) if compiled.groups else match.group()
        return _verdict(normalize_text(found) == normalize_text(str(answer)))


@functools.lru_cache(maxsize=64)
def _compiled(pattern: str) -> regex.Pattern[str]:
    try:
        return regex.compile(pattern)
    except regex.error as exc:
        raise ConfigError(f"invalid reward pattern {pattern!r}: {exc}") from None


@dataclass(frozen=True)
class _Boxed:
    """``\\boxed{}`` answers checked by math-verify."""

    def __post_init__(self) -> None:
        try:
            import math_verify  # noqa: F401
        except ImportError:
            raise ConfigError(
                "reward=boxed needs math-verify: pip install 'engine[math]' (math-verify==0.9.0)"
            ) from None

    def __call__(self, response: str, answer: Any) -> RewardBreakdown:
        import math_verify

        # No timeouts: math-verify's are signal-based, and rewards run in worker threads.
        gold = math_verify.parse(_as_boxed(str(answer)), parsing_timeout=None)
        guess = math_verify.parse(response, parsing_timeout=None)
        if not gold or not guess:
            return _verdict(False)
        return _verdict(bool(math_verify.verify(gold, guess, timeout_seconds=None)))


def _positive(options: Mapping[str, str], key: str, default: str, *, allow_zero: bool) -> float:
    text = options.get(key, default)
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"task argument {key} must be a number, got {text!r}") from None
    if not (value >= 0 if allow_zero else value > 0) or not math.isfinite(value):
        raise ConfigError(
            f"task argument {key} must be {'>= 0' if allow_zero else '> 0'}, got {text!r}"
        )
    return value


def _as_boxed(answer: str) -> str:
    return answer if "\\boxed" in answer else f"$\\boxed{{{answer}}}$"


def make_reward(preset: str, options: Mapping[str, str]) -> RewardFn:
    """The reward function of ``preset`` with its options (``tolerance`` and
    ``numeric_position`` for numeric, ``pattern`` and ``pattern_timeout`` for regex); a
    ConfigError names what is wrong. Every preset pickles (``--score-workers
    processes:N``)."""
    if preset == "exact":
        return _exact
    if preset == "numeric":
        position = options.get("numeric_position", "first")
        if position not in NUMERIC_POSITIONS:
            raise ConfigError(
                f"task argument numeric_position must be one of {', '.join(NUMERIC_POSITIONS)}, "
                f"got {position!r}"
            )
        return _Numeric(_positive(options, "tolerance", "1e-6", allow_zero=True), position)
    if preset == "regex":
        pattern = options.get("pattern")
        if not pattern:
            raise ConfigError("reward=regex needs the task argument pattern=REGEX")
        timeout = _positive(options, "pattern_timeout", str(PATTERN_TIMEOUT_S), allow_zero=False)
        return _Regex(pattern, timeout)
    if preset == "boxed":
        return _Boxed()
    raise ConfigError(
        f"unknown reward {preset!r}; choose one of {', '.join(REWARD_PRESETS)}, or name "
        "your own function as module:function"
    )


def user_reward(spec: str) -> Callable[..., Any]:
    """The reward function ``module:function`` names (it must be importable: from the
    working directory or an installed package); a ConfigError in one line otherwise."""
    fn = import_attr(spec, "reward")
    if not callable(fn):
        raise ConfigError(f"invalid reward {spec!r}: {type(fn).__name__} is not callable")
    return fn  # type: ignore[no-any-return]
