"""What the engine needs from a task: problems, a prompt per problem, and a reward.

Why a protocol and not a base class: a user task (``--task package.module:attr``) should
be a few plain functions on any object; the engine only calls the four members below.
Problems come from a *seeded, resumable* source so a run is reproducible from its seed
and a checkpoint can record exactly where the source stands (``ProblemSource.state``).
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "Problem",
    "ProblemSource",
    "RewardBreakdown",
    "SeededSource",
    "Task",
]


@dataclass(frozen=True)
class Problem:
    """One problem. ``id`` is its 0-based position in the seeded source (so problem ``i``
    of step ``s`` has id ``s * (batch + R) + i``, ``R`` the step's ``--refill-groups``
    reserves); ``answer`` and ``data`` must be JSON-friendly
    so untrained groups can be checkpointed."""

    id: int
    question: str
    answer: Any
    data: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RewardBreakdown:
    """A response's reward: ``total`` drives the advantage; ``components`` are logged
    (``env/all/<name>`` means and ``env/all/<name>/rate``, the fraction > 0)."""

    total: float
    components: Mapping[str, float] = field(default_factory=dict)


@runtime_checkable
class ProblemSource(Protocol):
    """An ordered stream of problems that can say where it stands."""

    def next(self) -> Problem | None:
        """The next problem, or None once the source is exhausted (the run then ends
        after the last complete step instead of hanging)."""
        ...

    def state(self) -> dict[str, Any]:
        """A JSON-serialisable snapshot; ``Task.source(seed, state)`` resumes from it."""
        ...


@runtime_checkable
class Task(Protocol):
    """A reinforcement-learning task scored on the client."""

    name: str

    def source(self, seed: int, state: Mapping[str, Any] | None = None) -> ProblemSource:
        """A problem source for ``seed``, resumed from ``state`` when given."""
        ...

    def prompt(self, problem: Problem) -> str | Sequence[Mapping[str, Any]]:
        """The prompt: a string (encoded as is with the model's tokenizer) or a list of
        chat messages (rendered by the served model's chat template, see
        :mod:`engine.tasks.render` for the optional members that control it)."""
        ...

    def score(
        self, response: str, problem: Problem
    ) -> RewardBreakdown | Awaitable[RewardBreakdown]:
        """Reward of one decoded response. A plain function runs in a worker thread (it
        may be slow); a coroutine function runs on the event loop."""
        ...


class SeededSource:
    """A ProblemSource drawing problems one after another from ``random.Random(seed)``.

    ``make(rng, index)`` builds problem ``index``. Drawing sequentially from one RNG (not
    re-seeding per problem) is what the MinT quickstart does, so the same seed yields the
    same problems. The state is the RNG state plus the cursor, both JSON-serialisable.
    """

    def __init__(
        self,
        make: Callable[[random.Random, int], Problem],
        seed: int,
        state: Mapping[str, Any] | None = None,
    ) -> None:
        self._make = make
        self._rng = random.Random(seed)
        self._cursor = 0
        if state is not None:
            self._restore(state)

    def next(self) -> Problem:
        problem = self._make(self._rng, self._cursor)
        self._cursor += 1
        return problem

    def state(self) -> dict[str, Any]:
        version, internal, gauss = self._rng.getstate()
        return {"cursor": self._cursor, "rng": [version, list(internal), gauss]}

    def _restore(self, state: Mapping[str, Any]) -> None:
        try:
            version, internal, gauss = state["rng"]
            self._rng.setstate((version, tuple(internal), gauss))
            self._cursor = int(state["cursor"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a SeededSource state: {exc}") from exc
