"""The RL arithmetic of one step: group-relative advantages, datums, skip rules, KL.

Kept free of I/O so each rule can be unit-tested against the MinT quickstart it must
reproduce: advantage = reward - group mean (no std); a datum per non-empty response
whose |advantage| >= 1e-12; ``model_input = full[:-1]``, ``target_tokens = full[1:]``,
and weights/logprobs/advantages zero over the first ``len(prompt) - 1`` positions.
Unlike the quickstart, a response without sampler logprobs is never silently given
zeros (that corrupts the importance ratio): it is an error, or a counted drop.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from engine.errors import EngineError

__all__ = [
    "ADVANTAGE_EPSILON",
    "Completion",
    "Datum",
    "GroupDatums",
    "KLStats",
    "MissingLogprobsError",
    "OnMissingLogprobs",
    "build_datum",
    "group_advantages",
    "group_datums",
    "kl_sample_train",
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
        return all(abs(a) < ADVANTAGE_EPSILON for a in self.advantages)


def group_advantages(rewards: Sequence[float]) -> list[float]:
    """``reward - mean(rewards)`` for each response (the quickstart's baseline)."""
    if not rewards:
        return []
    mean = sum(rewards) / len(rewards)
    return [r - mean for r in rewards]


def build_datum(
    prompt_tokens: Sequence[int],
    response_tokens: Sequence[int],
    logprobs: Sequence[float],
    advantage: float,
) -> Datum:
    """The quickstart's datum layout, position for position."""
    if len(logprobs) != len(response_tokens):
        raise ValueError(f"{len(logprobs)} logprobs for {len(response_tokens)} response tokens")
    prefix = len(prompt_tokens) - 1
    full = np.fromiter((*prompt_tokens, *response_tokens), dtype=np.int64)
    n = len(response_tokens)
    weights = np.zeros(prefix + n, dtype=np.float32)
    weights[prefix:] = 1.0
    sampled = np.zeros(prefix + n, dtype=np.float32)
    sampled[prefix:] = logprobs
    advantages = np.zeros(prefix + n, dtype=np.float32)
    advantages[prefix:] = advantage
    return Datum(
        model_input=full[:-1],
        loss_fn_inputs={
            "target_tokens": full[1:],
            "weights": weights,
            "logprobs": sampled,
            "advantages": advantages,
        },
    )


def with_loss_inputs(datum: Datum, loss: str) -> Datum:
    """``datum`` with the inputs ``loss`` takes beyond the ones every RL loss shares:
    gspo's sequence ratio runs over the sampled tokens, the ones ``weights`` marks."""
    if loss != "gspo":
        return datum
    inputs = {**datum.loss_fn_inputs, "sequence_ratio_mask": datum.loss_fn_inputs["weights"]}
    return Datum(datum.model_input, inputs)


def _has_logprobs(completion: Completion) -> bool:
    return completion.logprobs is not None and len(completion.logprobs) == len(completion.tokens)


def group_datums(
    prompt_tokens: Sequence[int],
    completions: Sequence[Completion],
    rewards: Sequence[float],
    *,
    on_missing_logprobs: OnMissingLogprobs = "error",
) -> GroupDatums:
    """Advantages and datums of one group, with the quickstart's skip rules.

    A non-empty response without logprobs (or with a logprob count that does not match
    its tokens) raises MissingLogprobsError with ``on_missing_logprobs="error"``; with
    ``"drop"`` it is left out and counted. Its reward still counts in the group mean:
    the baseline estimate is valid, only the importance ratio is unknown.
    """
    if len(completions) != len(rewards):
        raise ValueError(f"{len(rewards)} rewards for {len(completions)} responses")
    advantages = group_advantages(rewards)
    datums: list[Datum] = []
    empty = zero = dropped = 0
    for completion, advantage in zip(completions, advantages, strict=True):
        if not completion.tokens:
            empty += 1
            continue
        if not _has_logprobs(completion):
            if on_missing_logprobs == "error":
                got = "none" if completion.logprobs is None else len(completion.logprobs)
                raise MissingLogprobsError(
                    f"the sampler returned a response of {len(completion.tokens)} tokens "
                    f"with {got} logprobs; rerun with --on-missing-logprobs drop to skip "
                    "such responses"
                )
            dropped += 1
            continue
        if abs(advantage) < ADVANTAGE_EPSILON:
            zero += 1
            continue
        assert completion.logprobs is not None
        datums.append(build_datum(prompt_tokens, completion.tokens, completion.logprobs, advantage))
    return GroupDatums(datums, advantages, empty, zero, dropped)


@dataclass(frozen=True)
class KLStats:
    """Sampler-vs-trainer divergence over the trained tokens of one step.

    v1 = mean(q - p), v2 = 0.5 * mean((q - p)^2), with q the sampler's logprob and p the
    training policy's logprob of the same token (tinker-cookbook's definitions). Stable
    runs keep them below ~0.01; off-policy data without a clipped loss makes them grow.
    """

    v1: float | None
    v2: float | None
    tokens: int


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
    return KLStats(float(diff.mean()), float(0.5 * np.mean(diff * diff)), int(diff.size))
