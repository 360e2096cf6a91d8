"""Length control of a training group's trajectories (DAPO): overlong filtering and the
soft overlong penalty, applied once a group is scored and before anything reads its
rewards (the tie check of ``--refill-groups``, the advantages, checkpoints, rollouts).

A response is *overlong* when the sampler cut it at its token budget: its stop reason is
``"length"`` (no stop string, no EOS). An episode is overlong when any of its turns was
cut so, or when it ended because its context ran out (outcome ``"max_tokens"``).

- ``--overlong-filter`` marks overlong trajectories masked: no datums, and out of the
  group's baseline (the episode limits' ``mask`` rule; rollouts show them masked).
- ``--overlong-buffer L`` (with ``--overlong-penalty F``) adds to each response of
  ``n`` tokens, with budget ``N = --max-tokens``, the reward
  ``-F * min(1, max(0, n - (N - L)) / L)``: 0 up to ``N - L`` tokens, falling linearly
  to ``-F`` at ``N``. An episode's penalty is the sum over its turns. It is the reward
  component ``overlong_penalty`` (``env/all/overlong_penalty``), added to the group
  reward's total; a zeroed episode (``on_limit = zero``) stays at 0.

docs/losses.md, "Length control", gives the formulas and when to use them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.core.problems import RewardBreakdown
from engine.core.trajectory import Trajectory

__all__ = ["PENALTY_COMPONENT", "LengthControl", "is_overlong", "overlong_penalty"]

PENALTY_COMPONENT = "overlong_penalty"
"""The reward component the soft overlong penalty is logged as."""


def is_overlong(trajectory: Trajectory) -> bool:
    """Whether a turn of ``trajectory`` was cut at its token budget, or the episode ran
    out of context."""
    return trajectory.outcome == "max_tokens" or any(
        t.stop_reason == "length" for t in trajectory.turns
    )


def overlong_penalty(tokens: int, budget: int, buffer: int, factor: float) -> float:
    """DAPO's soft overlong punishment of a response of ``tokens`` tokens under a
    ``budget``: 0 up to ``budget - buffer``, then linear down to ``-factor`` at the
    budget (``buffer`` 0: no penalty)."""
    if buffer <= 0:
        return 0.0
    over = tokens - (budget - buffer)
    return -factor * min(1.0, max(0.0, over / buffer))


@dataclass(frozen=True)
class LengthControl:
    """The run's length rules: ``filter`` (mask overlong trajectories) and the soft
    penalty over the last ``buffer`` tokens of ``budget`` (``--max-tokens``)."""

    filter: bool
    budget: int
    buffer: int
    factor: float

    @classmethod
    def of(cls, config: EngineConfig) -> LengthControl:
        return cls(
            filter=config.training.overlong_filter,
            budget=config.sampling.max_tokens,
            buffer=config.scoring.overlong_buffer,
            factor=config.scoring.overlong_penalty,
        )

    @property
    def active(self) -> bool:
        return self.filter or self.buffer > 0

    def apply(self, trajectories: Sequence[Trajectory]) -> tuple[Trajectory, ...]:
        """``trajectories`` with the penalty added to their group rewards and the
        overlong ones masked (unchanged when neither rule is on)."""
        if not self.active:
            return tuple(trajectories)
        return tuple(self._one(t) for t in trajectories)

    def _one(self, trajectory: Trajectory) -> Trajectory:
        reward = trajectory.group_reward
        if self.buffer > 0:
            penalty = sum(
                overlong_penalty(len(t.action), self.budget, self.buffer, self.factor)
                for t in trajectory.turns
            )
            reward = RewardBreakdown(
                reward.total + penalty, {**reward.components, PENALTY_COMPONENT: penalty}
            )
        masked = trajectory.masked or (self.filter and is_overlong(trajectory))
        return dataclasses.replace(trajectory, group_reward=reward, masked=masked)
