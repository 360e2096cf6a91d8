"""The RL arithmetic of one step: group-relative advantages, datums, skip rules, KL.

Free of I/O so each rule can be tested against the MinT quickstart it reproduces: a
group's advantage is total reward - group mean (no std); each trajectory whose
|advantage| >= 1e-12 gives datums built from its exact sampled tokens (never
re-rendered). One datum holds as many consecutive turns as share one growing context
(a turn joins while its observation extends the previous observation plus action,
token for token); observation positions get weight, logprob and advantage 0, action
positions weight 1, the sampler's logprobs and the advantage. A one-turn trajectory
gives the quickstart's datum position for position (``model_input = full[:-1]``,
``target_tokens = full[1:]``). A turn without sampler logprobs is never given zeros
(that corrupts the importance ratio): it is an error, or a counted drop. Masked
trajectories yield no datum and stay out of the baseline.

On-policy distillation (:class:`DistillSignal`) gives each action token its own
advantage: ``coef * (teacher logprob - sampler logprob)`` of that token (the reverse-KL
signal), plus ``reward_weight`` x the trajectory's group-relative advantage.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from engine.core.trajectory import Trajectory, Turn
from engine.errors import EngineError

__all__ = [
    "ADVANTAGE_EPSILON",
    "Completion",
    "Datum",
    "DistillSignal",
    "GroupDatums",
    "KLStats",
    "MissingLogprobsError",
    "OnMissingLogprobs",
    "carries_signal",
    "group_advantages",
    "group_datums",
    "kl_sample_train",
    "reverse_kl",
    "supervised_datums",
    "trajectory_advantages",
    "trajectory_datums",
    "turn_reverse_kl",
    "with_loss_inputs",
]

ADVANTAGE_EPSILON = 1e-12
"""Responses whose |advantage| is below this carry no signal and are skipped."""

OnMissingLogprobs = Literal["error", "drop"]


class MissingLogprobsError(EngineError):
    """The sampler returned a response without per-token logprobs."""


@dataclass(frozen=True)
class Completion:
    """One sampled response: its tokens and the sampler's logprob of each (None when
    the server sent none)."""

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...] | None
    stop_reason: str = "length"


@dataclass(frozen=True, eq=False)
class Datum:
    """One training example as the loss sees it: the input tokens and, per position, the
    target token, its weight, the sampler's logprob and the advantage. The session turns
    it into the SDK's datum (the same dtypes the SDK gives plain lists: int64 targets,
    float32 weights/logprobs/advantages)."""

    model_input: np.ndarray
    loss_fn_inputs: Mapping[str, np.ndarray]

    def __len__(self) -> int:
        return len(self.model_input)


@dataclass(frozen=True)
class GroupDatums:
    """The datums of one group and what was left out, and why."""

    datums: list[Datum]
    advantages: list[float]
    skipped_empty: int
    skipped_zero_advantage: int
    dropped_missing_logprobs: int
    masked: int = 0
    """Episodes left out by a limit (``on_limit = mask``); single-turn groups have none."""

    @property
    def constant_reward(self) -> bool:
        """True when every response got the same reward (the group teaches nothing)."""
        return not carries_signal(self.advantages)


@dataclass(frozen=True)
class DistillSignal:
    """How a teacher's logprobs become per-token advantages (``--objective distill``)."""

    coef: float = 1.0
    reward_weight: float = 0.0

    def advantages(self, turn: Turn, advantage: float) -> list[float]:
        """Each action token's advantage; ``advantage``: the group-relative one."""
        if turn.teacher_logprobs is None or len(turn.teacher_logprobs) != len(turn.action):
            raise EngineError(
                f"internal error: a turn of {len(turn.action)} tokens reached training "
                "without the teacher's logprob of each"
            )
        base = self.reward_weight * advantage
        return [
            base + self.coef * (teacher - student)
            for teacher, student in zip(turn.teacher_logprobs, _logprobs(turn), strict=True)
        ]


def reverse_kl(trajectories: Sequence[Trajectory]) -> tuple[float, float, int]:
    """(sum of sampler - teacher logprob, sum of teacher logprob, tokens) over the action
    tokens that have teacher logprobs: their mean is the per-token reverse-KL estimate
    ``KL(student || teacher)`` on the student's own samples, and the teacher's mean
    logprob of them."""
    sums = [turn_reverse_kl(turn) for trajectory in trajectories for turn in trajectory.turns]
    return sum(s[0] for s in sums), sum(s[1] for s in sums), sum(s[2] for s in sums)


def turn_reverse_kl(turn: Turn) -> tuple[float, float, int]:
    """:func:`reverse_kl` of one turn's action tokens (0 tokens: no teacher logprobs)."""
    if turn.teacher_logprobs is None or turn.logprobs is None:
        return 0.0, 0.0, 0
    kl = teacher = 0.0
    for t, s in zip(turn.teacher_logprobs, turn.logprobs, strict=True):
        kl += s - t
        teacher += t
    return kl, teacher, len(turn.teacher_logprobs)


def group_advantages(rewards: Sequence[float]) -> list[float]:
    """``reward - mean(rewards)`` for each response (the quickstart's baseline)."""
    if not rewards:
        return []
    mean = sum(rewards) / len(rewards)
    return [r - mean for r in rewards]


def trajectory_advantages(trajectories: Sequence[Trajectory]) -> list[float]:
    """Each trajectory's advantage in trajectory order: its total reward minus the mean
    over the unmasked ones (0 for a masked one)."""
    kept = [i for i, t in enumerate(trajectories) if not t.masked]
    baseline = group_advantages([trajectories[i].total_reward for i in kept])
    advantages = [0.0] * len(trajectories)
    for i, advantage in zip(kept, baseline, strict=True):
        advantages[i] = advantage
    return advantages


def carries_signal(advantages: Sequence[float]) -> bool:
    """Whether any advantage is large enough to train on (a group whose rewards all
    tie, or whose trajectories are all masked, carries none)."""
    return any(abs(a) >= ADVANTAGE_EPSILON for a in advantages)


def with_loss_inputs(datum: Datum, loss: str) -> Datum:
    """``datum`` with the inputs ``loss`` takes beyond the ones every RL loss shares:
    gspo's sequence ratio runs over the sampled tokens, the ones ``weights`` marks."""
    if loss != "gspo":
        return datum
    inputs = {**datum.loss_fn_inputs, "sequence_ratio_mask": datum.loss_fn_inputs["weights"]}
    return Datum(datum.model_input, inputs)


def trajectory_datums(
    trajectory: Trajectory, advantage: float, distill: DistillSignal | None = None
) -> list[Datum]:
    """The datums of one trajectory (one per run of turns sharing a prefix); with
    ``distill`` each action token's advantage is its own (:class:`DistillSignal`)."""
    datums: list[Datum] = []
    tokens: list[int] = []
    trained: list[float] = []  # per token: 1.0 for an action token
    logprobs: list[float] = []
    advantages: list[float] = []
    for turn in trajectory.turns:
        if not _extends(turn.observation, tokens):
            datums.extend(_datum(tokens, trained, logprobs, advantages))
            tokens, trained, logprobs, advantages = [], [], [], []
        added = len(turn.observation) - len(tokens)
        tokens.extend(turn.observation[len(tokens) :])
        for column in (trained, logprobs, advantages):
            column.extend([0.0] * added)
        tokens.extend(turn.action)
        trained.extend([1.0] * len(turn.action))
        logprobs.extend(_logprobs(turn))
        if distill is None:
            advantages.extend([advantage] * len(turn.action))
        else:
            advantages.extend(distill.advantages(turn, advantage))
    datums.extend(_datum(tokens, trained, logprobs, advantages))
    return datums


def supervised_datums(trajectory: Trajectory) -> list[Datum]:
    """The ``cross_entropy`` datums of a conversation whose assistant messages are the
    trajectory's actions (``--objective sft``): :func:`trajectory_datums`'s layout with
    only ``target_tokens`` and ``weights`` (1 on the assistant tokens, 0 elsewhere)."""
    keep = ("target_tokens", "weights")
    return [
        Datum(d.model_input, {k: d.loss_fn_inputs[k] for k in keep})
        for d in trajectory_datums(trajectory, 0.0)
    ]


def group_datums(
    trajectories: Sequence[Trajectory],
    *,
    on_missing_logprobs: OnMissingLogprobs = "error",
    distill: DistillSignal | None = None,
) -> GroupDatums:
    """Advantages and datums of one group of trajectories (``advantages`` in
    trajectory order, 0 for a masked one). With ``distill`` a trajectory of zero
    group-relative advantage is trained too (its tokens' teacher signal)."""
    advantages = trajectory_advantages(trajectories)
    kept = [i for i, t in enumerate(trajectories) if not t.masked]
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
        if distill is None and abs(advantage) < ADVANTAGE_EPSILON:
            zero += 1
            continue
        datums.extend(trajectory_datums(trajectory, advantage, distill))
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
    tokens: Sequence[int],
    trained: Sequence[float],
    logprobs: Sequence[float],
    advantages: Sequence[float],
) -> list[Datum]:
    """The quickstart's layout over a mask: position ``i`` predicts token ``i + 1``."""
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
                "advantages": weights * np.asarray(advantages[1:], dtype=np.float32),
            },
        )
    ]


@dataclass(frozen=True)
class KLStats:
    """Sampler-vs-trainer divergence over the trained tokens of one step.

    v1 = mean(q - p), v2 = 0.5 * mean((q - p)^2), with q the sampler's logprob and p the
    training policy's logprob of the same token (tinker-cookbook's definitions). Stable
    runs keep them below ~0.01; off-policy data without a clipped loss makes them grow.
    ``entropy`` = -mean(q): the sampler's entropy estimated from its own draws (the
    distribution sampled from: tempered at T != 1 on servers that report it so).
    """

    v1: float | None
    v2: float | None
    tokens: int
    entropy: float | None = None


def kl_sample_train(datums: Sequence[Datum], outputs: Sequence[Any]) -> KLStats:
    """KL estimates from the datums sent and the training ``logprobs`` of every position
    that their forward_backward returned (one array-like per datum)."""
    if len(outputs) != len(datums):
        raise ValueError(
            f"forward_backward returned {len(outputs)} outputs for {len(datums)} datums"
        )
    if not datums:
        return KLStats(None, None, 0)
    trained = [np.asarray(o, dtype=np.float64).reshape(-1) for o in outputs]
    for datum, got in zip(datums, trained, strict=True):
        if len(got) != len(datum):
            raise ValueError(
                f"forward_backward returned {len(got)} logprobs for a datum of "
                f"{len(datum)} positions"
            )
    weights = np.concatenate([d.loss_fn_inputs["weights"] for d in datums]) > 0
    sampler = np.concatenate([d.loss_fn_inputs["logprobs"] for d in datums]).astype(np.float64)
    diff = (sampler - np.concatenate(trained))[weights]
    if diff.size == 0:
        return KLStats(None, None, 0)
    entropy = float(-sampler[weights].mean())
    return KLStats(float(diff.mean()), float(0.5 * np.mean(diff * diff)), int(diff.size), entropy)
