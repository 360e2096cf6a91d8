"""The quickstart's arithmetic task with its partial-credit reward, made configurable.

With ``op="*"`` and operands in 10..199 (the defaults of the MinT quickstart
``custom_reward.py``) it draws the same problems from the same seed and scores every
response exactly as the quickstart does: format 0.2 when an integer can be parsed,
distance ``0.5 * max(0, 1 - min(|err| / max(|answer|, 20), 1))``, exact 0.3, total
capped at 1.0; no integer scores 0 in every component.

Held-out problems (what ``--eval-every`` evaluates): ``eval_size`` distinct ``(a, b)``
pairs drawn from ``Random("arithmetic-eval:{min}:{max}")`` -- the same pairs for every run
seed, so evaluations compare across runs. The training source never draws them: a draw
that lands on a held-out pair is drawn again from the same RNG. The default is none
(``eval_size=0``: exactly the quickstart's problems); the engine asks for
:func:`default_eval_size` pairs when a run evaluates (``--eval-every``) without an
``eval_size``, which departs from the quickstart's sequence at the first redraw (one draw
in about 130 on the local range 10..99, one in 560 on the hosted 10..199).
"""

from __future__ import annotations

import operator
import random
import re
from collections.abc import Callable, Mapping
from typing import Any, Final

from engine.config.task_settings import (
    ARITHMETIC_OPS,
    DEFAULT_EVAL_SIZE,
    ArithmeticSettings,
    default_eval_size,
)
from engine.core.problems import Problem, RewardBreakdown, SeededSource

__all__ = [
    "ARITHMETIC_ARGS",
    "DEFAULT_EVAL_SIZE",
    "OPS",
    "ArithmeticSettings",
    "ArithmeticTask",
    "default_eval_size",
    "extract_prediction",
    "score_arithmetic",
]

_OP_NAMES: Final = {"+": "add", "-": "sub", "*": "mul"}

OPS: Final[Mapping[str, Callable[[int, int], int]]] = dict(
    zip(ARITHMETIC_OPS, (operator.add, operator.sub, operator.mul), strict=True)
)

ARITHMETIC_ARGS: Final = ("op", "min_operand", "max_operand", "eval_size")

_INTEGER = re.compile(r"-?\d+")

FORMAT_REWARD: Final = 0.2
DISTANCE_WEIGHT: Final = 0.5
EXACT_BONUS: Final = 0.3
MIN_DISTANCE_SCALE: Final = 20


def extract_prediction(response: str) -> int | None:
    """The first (optionally negative) integer in ``response``, or None."""
    match = _INTEGER.search(response)
    return int(match.group()) if match else None


def score_arithmetic(response: str, answer: int) -> RewardBreakdown:
    """The quickstart's reward, component by component."""
    prediction = extract_prediction(response)
    if prediction is None:
        return RewardBreakdown(
            0.0, {"format_reward": 0.0, "distance_reward": 0.0, "exact_bonus": 0.0}
        )
    error = abs(prediction - answer)
    scale = max(abs(answer), MIN_DISTANCE_SCALE)
    closeness = max(0.0, 1.0 - min(error / scale, 1.0))
    distance = DISTANCE_WEIGHT * closeness
    exact = EXACT_BONUS if prediction == answer else 0.0
    total = min(1.0, FORMAT_REWARD + distance + exact)
    return RewardBreakdown(
        total, {"format_reward": FORMAT_REWARD, "distance_reward": distance, "exact_bonus": exact}
    )


class ArithmeticTask:
    """``What is {a} {op} {b}?`` with ``a`` and ``b`` drawn uniformly from
    ``min_operand..max_operand`` (inclusive), ``a`` first, as the quickstart draws them,
    except the ``eval_size`` held-out pairs (default none)."""

    def __init__(
        self,
        op: str = "*",
        min_operand: int = 10,
        max_operand: int = 199,
        eval_size: int = 0,
    ) -> None:
        if op not in OPS:
            raise ValueError(f"unknown operation {op!r}; choose one of {', '.join(OPS)}")
        if min_operand > max_operand:
            raise ValueError(f"min operand {min_operand} is greater than max operand {max_operand}")
        pairs = (max_operand - min_operand + 1) ** 2
        if not 0 <= eval_size <= pairs // 2:
            raise ValueError(
                f"eval_size must be in 0..{pairs // 2} (half of the {pairs} operand pairs: the "
                f"rest are for training), got {eval_size}"
            )
        self.op = op
        self.min_operand = min_operand
        self.max_operand = max_operand
        self.eval_size = eval_size
        self.name = f"arithmetic-{_OP_NAMES[op]}"
        self._apply = OPS[op]
        self._held_out = self._held_out_pairs(eval_size)
        self._held_out_set = frozenset(self._held_out)
        self.spec = (
            "arithmetic",
            {
                "op": op,
                "min_operand": str(min_operand),
                "max_operand": str(max_operand),
                "eval_size": str(eval_size),
            },
        )

    @classmethod
    def from_args(cls, args: Mapping[str, str]) -> ArithmeticTask:
        """Build from ``--task-arg`` strings: ``op``, ``min_operand``, ``max_operand``
        (ValueError with a one-line reason)."""
        unknown = sorted(set(args) - set(ARITHMETIC_ARGS))
        if unknown:
            raise ValueError(
                f"unknown task argument {unknown[0]!r}; known: {', '.join(ARITHMETIC_ARGS)}"
            )
        numbers: dict[str, int] = {}
        for key in ("min_operand", "max_operand", "eval_size"):
            if key in args:
                try:
                    numbers[key] = int(args[key])
                except ValueError:
                    raise ValueError(f"{key} must be an integer, got {args[key]!r}") from None
        return cls(args.get("op", "*"), **numbers)

    def __repr__(self) -> str:
        return (
            f"ArithmeticTask(op={self.op!r}, {self.min_operand}..{self.max_operand}, "
            f"{self.eval_size} held out)"
        )

    def source(self, seed: int, state: Mapping[str, Any] | None = None) -> SeededSource:
        return SeededSource(self._make, seed, state)

    def eval_problems(self) -> list[Problem]:
        """The held-out problems, ids from 0 (the same for every run seed)."""
        return [self._problem(i, a, b) for i, (a, b) in enumerate(self._held_out)]

    def prompt(self, problem: Problem) -> str:
        return f"Question: {problem.question}\nAnswer:"

    def score(self, response: str, problem: Problem) -> RewardBreakdown:
        return score_arithmetic(response, int(problem.answer))

    def _draw(self, rng: random.Random) -> tuple[int, int]:
        a = rng.randint(self.min_operand, self.max_operand)
        b = rng.randint(self.min_operand, self.max_operand)
        return a, b

    def _held_out_pairs(self, count: int) -> list[tuple[int, int]]:
        rng = random.Random(f"arithmetic-eval:{self.min_operand}:{self.max_operand}")
        pairs: dict[tuple[int, int], None] = {}  # insertion-ordered set
        while len(pairs) < count:
            pairs[self._draw(rng)] = None
        return list(pairs)

    def _make(self, rng: random.Random, index: int) -> Problem:
        a, b = self._draw(rng)
        while (a, b) in self._held_out_set:
            a, b = self._draw(rng)
        return self._problem(index, a, b)

    def _problem(self, index: int, a: int, b: int) -> Problem:
        return Problem(id=index, question=f"What is {a} {self.op} {b}?", answer=self._apply(a, b))
