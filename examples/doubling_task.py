"""A user task in one file: doubling numbers, with an exact-match reward.

Run it with ``python -m engine.run --task examples.doubling_task:DoublingTask`` from the
checkout (the README's "Your own reward" section shows this file verbatim).
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from engine.tasks import Problem, RewardBreakdown, SeededSource, extract_prediction


class DoublingTask:
    """``What is a + a?`` for a in 10..49; reward 1 for the exact answer, else 0.1 for
    any number (so the model keeps answering with numbers)."""

    name = "doubling"

    def source(self, seed: int, state: Mapping[str, Any] | None = None) -> SeededSource:
        # Seeded and resumable: a checkpoint stores source.state() and passes it back.
        return SeededSource(self._make, seed, state)

    def prompt(self, problem: Problem) -> str:
        return f"Question: {problem.question}\nAnswer:"

    def score(self, response: str, problem: Problem) -> RewardBreakdown:
        guess = extract_prediction(response)
        exact = 1.0 if guess == problem.answer else 0.0
        number = 0.0 if guess is None else 1.0
        return RewardBreakdown(max(exact, 0.1 * number), {"exact": exact, "number": number})

    def _make(self, rng: random.Random, index: int) -> Problem:
        a = rng.randint(10, 49)
        return Problem(id=index, question=f"What is {a} + {a}?", answer=2 * a)
