"""From trajectories to training datums, from the exact sampled tokens (never re-rendered).

One datum holds as many consecutive turns as share one growing context: a turn joins
the current datum while its observation extends the previous observation plus action
(token for token); observation tokens get weight 0, logprob 0 and advantage 0, action
tokens weight 1, the sampler's logprobs and the trajectory's advantage. A turn whose
observation does not extend them (a chat template that rewrites history, a summarised
context) starts a new datum. A single-turn trajectory gives exactly
:func:`engine.loop.rl.build_datum`'s datum.

The group rules are :func:`engine.loop.rl.group_datums`'s: advantage = total reward -
group mean; trajectories without action tokens, without logprobs, or with a zero
advantage yield no datum. Masked trajectories (a limit with ``on_limit = mask``) yield
no datum and stay out of the baseline.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine.envs.types import Trajectory, Turn
from engine.loop.rl import (
    ADVANTAGE_EPSILON,
    Datum,
    GroupDatums,
    MissingLogprobsError,
    OnMissingLogprobs,
    group_advantages,
)

__all__ = ["episode_group_datums", "trajectory_datums"]


def trajectory_datums(trajectory: Trajectory, advantage: float) -> list[Datum]:
    """The datums of one trajectory (one per run of turns sharing a prefix)."""
    datums: list[Datum] = []
    tokens: list[int] = []
    trained: list[float] = []  # per token: 1.0 for an action token
    logprobs: list[float] = []
    for turn in trajectory.turns:
        if not _extends(turn.observation, tokens):
            datums.extend(_datum(tokens, trained, logprobs, advantage))
            tokens, trained, logprobs = [], [], []
        added = len(turn.observation) - len(tokens)
        tokens.extend(turn.observation[len(tokens) :])
        trained.extend([0.0] * added)
        logprobs.extend([0.0] * added)
        tokens.extend(turn.action)
        trained.extend([1.0] * len(turn.action))
        logprobs.extend(_logprobs(turn))
    datums.extend(_datum(tokens, trained, logprobs, advantage))
    return datums


def episode_group_datums(
    trajectories: Sequence[Trajectory], *, on_missing_logprobs: OnMissingLogprobs = "error"
) -> GroupDatums:
    """Advantages and datums of one group of trajectories (``advantages`` in
    trajectory order, 0 for a masked one)."""
    kept = [i for i, t in enumerate(trajectories) if not t.masked]
    baseline = group_advantages([trajectories[i].total_reward for i in kept])
    advantages = [0.0] * len(trajectories)
    for i, advantage in zip(kept, baseline, strict=True):
        advantages[i] = advantage
    datums: list[Datum] = []
    empty = zero = dropped = 0
    for i in kept:
        trajectory, advantage = trajectories[i], advantages[i]
        if trajectory.action_tokens == 0:
            empty += 1
            continue
        missing = [t for t in trajectory.turns if t.action and not _has_logprobs(t)]
        if missing:
            if on_missing_logprobs == "error":
                raise MissingLogprobsError(
                    f"the sampler returned a turn of {len(missing[0].action)} tokens without "
                    "matching logprobs; rerun with --on-missing-logprobs drop to skip such "
                    "episodes"
                )
            dropped += 1
            continue
        if abs(advantage) < ADVANTAGE_EPSILON:
            zero += 1
            continue
        datums.extend(trajectory_datums(trajectory, advantage))
    masked = len(trajectories) - len(kept)
    return GroupDatums(datums, advantages, empty, zero, dropped, masked)


def _extends(observation: Sequence[int], context: Sequence[int]) -> bool:
    return bool(context) and tuple(observation[: len(context)]) == tuple(context)


def _has_logprobs(turn: Turn) -> bool:
    return turn.logprobs is not None and len(turn.logprobs) == len(turn.action)


def _logprobs(turn: Turn) -> Sequence[float]:
    """The sampler's logprobs (a turn without them never reaches a datum)."""
    return turn.logprobs if turn.logprobs is not None else [0.0] * len(turn.action)


def _datum(
    tokens: Sequence[int], trained: Sequence[float], logprobs: Sequence[float], advantage: float
) -> list[Datum]:
    """``build_datum``'s layout over a mask: position ``i`` predicts token ``i + 1``."""
    if len(tokens) < 2 or not any(trained[1:]):
        return []
    full = np.asarray(tokens, dtype=np.int64)
    weights = np.asarray(trained[1:], dtype=np.float32)
    return [
        Datum(
            model_input=full[:-1],
            loss_fn_inputs={
                "target_tokens": full[1:],
                "weights": weights,
                "logprobs": np.asarray(logprobs[1:], dtype=np.float32),
                "advantages": weights * np.float32(advantage),
            },
        )
    ]
