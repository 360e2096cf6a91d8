"""One step's metrics, built from what the stages pass: the step's groups, what its
datums left out, the trainer's answer and the stage timings.

Names follow the field (tinker-cookbook, prime-rl, verl, PipelineRL) so dashboards and
habits carry over: ``env/all/reward/total``, ``optim/kl_sample_train_v1``,
``sampling_client/step_min``, ``time/<span>``, ``trainer/idle_ratio``,
``progress/done_frac``, ``retries/<kind>``; docs/run-directory.md lists them all.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.common.clock import Stopwatch
from engine.core.datums import Datum, kl_sample_train, reverse_kl
from engine.core.state import ScoredGroup
from engine.envs.episode_metrics import episode_metrics
from engine.loop.dpo import pair_rewards, preference_metrics, response_sums
from engine.loop.length_control import is_overlong
from engine.session.api import TrainResult

__all__ = [
    "ActivityMeter",
    "Assembled",
    "StepTiming",
    "distill_metrics",
    "preference_line",
    "preference_step_metrics",
    "quickstart_line",
    "refill_metrics",
    "response_metrics",
    "reward_metrics",
    "step_metrics",
    "supervised_line",
    "supervised_step_metrics",
]


@dataclass(frozen=True)
class Assembled:
    """What a step trains on (its datums in submission order, each group's advantages
    in trajectory order) and what was left out, and why."""

    datums: tuple[Datum, ...]
    advantages: tuple[tuple[float, ...], ...]
    empty: int
    zero_advantage: int
    missing_logprobs: int
    constant_groups: int
    used_groups: int
    masked: int


@dataclass(frozen=True)
class StepTiming:
    """A step's clock values (``time.perf_counter()``-like): its first training call,
    its end, the previous step's end, and how long the trainer waited for its groups."""

    train_start: float
    train_end: float
    last_end: float
    wait: float


class ActivityMeter:
    """Busy time of a stage (time with at least one operation in flight) and the work it
    completed, read as deltas per step. Owned by one event loop; no locking."""

    def __init__(self, clock: Stopwatch = time.perf_counter) -> None:
        self._clock = clock
        self._active = 0
        self._since = 0.0
        self._busy = 0.0
        self._items = 0
        self._tokens = 0
        self._taken = (0.0, 0, 0)

    def begin(self) -> None:
        if self._active == 0:
            self._since = self._clock()
        self._active += 1

    def end(self, *, items: int = 0, tokens: int = 0) -> None:
        self._active -= 1
        if self._active == 0:
            self._busy += self._clock() - self._since
        self._items += items
        self._tokens += tokens

    def _busy_now(self) -> float:
        return self._busy + (self._clock() - self._since if self._active else 0.0)

    def take(self) -> tuple[float, int, int]:
        """(busy seconds, items, tokens) since the previous take."""
        now = (self._busy_now(), self._items, self._tokens)
        delta = (now[0] - self._taken[0], now[1] - self._taken[1], now[2] - self._taken[2])
        self._taken = now
        return delta


def reward_metrics(groups: Sequence[ScoredGroup]) -> dict[str, float]:
    """Reward mean, per-component means and rates (fraction > 0), and the quickstart's
    summary (avg_reward, exact_rate, format_rate, avg_distance_reward)."""
    rewards = [r for g in groups for r in g.rewards]
    n = len(rewards)
    out: dict[str, float] = {
        "env/all/reward/total": sum(r.total for r in rewards) / n if n else 0.0
    }
    names = sorted({k for r in rewards for k in r.components})
    for name in names:
        values = [float(r.components.get(name, 0.0)) for r in rewards]
        out[f"env/all/{name}"] = sum(values) / n
        out[f"env/all/{name}/rate"] = sum(1 for v in values if v > 0) / n
    totals = [g.totals for g in groups]
    out["env/all/by_group/frac_mixed"] = (
        sum(1 for t in totals if max(t) != min(t)) / len(totals) if totals else 0.0
    )
    out["avg_reward"] = out["env/all/reward/total"]
    for alias, name in (
        ("exact_rate", "env/all/exact_bonus/rate"),
        ("exact_rate", "env/all/correct/rate"),  # the dataset task's reward presets
        ("format_rate", "env/all/format_reward/rate"),
        ("avg_distance_reward", "env/all/distance_reward"),
    ):
        if name in out:
            out[alias] = out[name]
    return out


def response_metrics(groups: Sequence[ScoredGroup]) -> dict[str, float]:
    """Response lengths in tokens: ``response_len/mean``, ``response_len/max``,
    ``response_len/truncated_frac`` (stopped by max_tokens) and ``response_len/empty_frac``
    (nothing before the stop: no tokens, or only the stop token): over every turn's
    action."""
    responses = [
        (turn.action, turn.stop_reason) for g in groups for t in g.trajectories for turn in t.turns
    ]
    n = len(responses)
    lengths = [len(tokens) for tokens, _ in responses]
    empty = sum(1 for tokens, stop in responses if len(tokens) - (stop == "stop") <= 0)
    truncated = sum(1 for tokens, stop in responses if stop == "length" and tokens)
    return {
        "response_len/mean": sum(lengths) / n if n else 0.0,
        "response_len/max": float(max(lengths, default=0)),
        "response_len/truncated_frac": truncated / n if n else 0.0,
        "response_len/empty_frac": empty / n if n else 0.0,
    }


def refill_metrics(groups: Sequence[ScoredGroup], batch: int, reserves: int) -> dict[str, float]:
    """Dynamic sampling and length control of one step of ``batch`` groups plus the
    reserves it sampled (of ``reserves`` drawn): ``groups/with_signal`` (groups whose
    rewards differ), ``refill/extra_groups`` (reserves sampled), ``refill/replaced``
    (those with signal), ``refill/unused_reserves`` (drawn, never sampled, never
    trained), ``refill/short`` (1: fewer than ``batch`` groups with signal),
    ``length/overlong_frac`` (trajectories cut at their budget) and
    ``length/overlong_masked`` (of those, the ones left out of training)."""
    extra = [g for g in groups if g.index >= batch]
    with_signal = sum(1 for g in groups if g.has_signal)
    trajectories = [t for g in groups for t in g.trajectories]
    overlong = [t for t in trajectories if is_overlong(t)]
    return {
        "groups/with_signal": with_signal,
        "refill/extra_groups": len(extra),
        "refill/replaced": sum(1 for g in extra if g.has_signal),
        "refill/unused_reserves": reserves - len(extra),
        "refill/short": int(with_signal < batch),
        "length/overlong_frac": len(overlong) / len(trajectories) if trajectories else 0.0,
        "length/overlong_masked": sum(1 for t in overlong if t.masked),
    }


def quickstart_line(step: int, metrics: Mapping[str, Any]) -> str:
    """The MinT quickstart's per-step line, character for character, when the task has
    its components; otherwise the same line without the rates it cannot compute."""
    parts = [f"avg_reward={metrics['avg_reward']:.3f}"]
    if "exact_rate" in metrics:
        parts.append(f"exact_rate={metrics['exact_rate']:.1%}")
    if "format_rate" in metrics:
        parts.append(f"format_rate={metrics['format_rate']:.1%}")
    parts.append(f"datums={metrics['datums']}")
    if metrics.get("distill/reverse_kl") is not None:
        parts.append(f"reverse_kl={metrics['distill/reverse_kl']:.4f}")
    return f"Step {step}: " + ", ".join(parts)


def step_metrics(
    done: int,
    steps: int,
    groups: Sequence[ScoredGroup],
    assembled: Assembled,
    result: TrainResult,
    timing: StepTiming,
    sampling: tuple[float, int, int],
    *,
    lr: float,
    staleness: int,
    episodic: bool,
    snapshot_retries: int,
    distill: bool = False,
    batch: int,
    reserves: int,
) -> dict[str, Any]:
    """The metrics.jsonl event of step ``done`` (1-based) of ``steps``. ``sampling`` is
    the sampling meter's (busy seconds, samples, tokens) over the step; ``episodic``
    adds the environment metrics (an environment task's steps), ``distill`` the
    teacher's (``--objective distill``); ``batch`` and ``reserves`` are ``--batch`` and
    ``--refill-groups`` (:func:`refill_metrics`)."""
    kl = kl_sample_train(assembled.datums, result.logprobs)
    step_time = max(timing.train_end - timing.last_end, 1e-9)
    sampling_busy, samples, tokens = sampling
    # Steps are trained in order: from this step's first submission (or the end of the
    # previous step, if later) to its end, the trainer was busy.
    training_busy = timing.train_end - max(timing.train_start, timing.last_end)
    versions = [g.version for g in groups]
    failed = [g for g in groups if g.reward_error is not None]
    metrics: dict[str, Any] = {
        "step": done,
        **reward_metrics([g for g in groups if g.trainable]),
        **response_metrics(groups),
        "datums": len(assembled.datums),
        "groups/total": len(groups),
        "groups/used": assembled.used_groups,
        "groups/trained_frac": assembled.used_groups / len(groups),
        "groups/skipped": assembled.constant_groups,
        "groups/reward_errors": len(failed),
        "reward_errors/problem_ids": [g.problem.id for g in failed],
        "groups/too_long": sum(1 for g in groups if g.too_long is not None),
        **refill_metrics(groups, batch, reserves),
        "skipped/empty_responses": assembled.empty,
        "skipped/zero_advantage": assembled.zero_advantage,
        "dropped/missing_logprobs": assembled.missing_logprobs,
        "sampling_client/step_min": min(versions),
        "sampling_client/step_max": max(versions),
        "sampling_client/step_mean": sum(versions) / len(versions),
        "off_policy/staleness": staleness,
        "optim/kl_sample_train_v1": kl.v1,
        "optim/kl_sample_train_v2": kl.v2,
        "optim/entropy": kl.entropy,
        "optim/grad_norm": result.optim_metrics.get("grad_norm:mean"),
        "optim/loss": result.metrics.get("loss:sum"),
        "optim/lr": lr,
        "optim/trained_tokens": kl.tokens,
        "time/sample": max(g.sample_finished for g in groups)
        - min(g.sample_started for g in groups),
        "time/score": _union_length([(g.score_started, g.score_finished) for g in groups]),
        "time/train": timing.train_end - timing.train_start,
        "time/wait": timing.wait,
        "time/step": step_time,
        "trainer/idle_ratio": _ratio(1.0 - training_busy / step_time),
        "sampler/idle_ratio": _ratio(1.0 - sampling_busy / step_time),
        "throughput/samples_per_s": samples / step_time,
        "throughput/tokens_per_s": tokens / step_time,
        "progress/done_frac": done / steps,
        "problem_ids": [g.problem.id for g in groups],
        "problems/digest": _problems_digest(groups),
        "retries/sample": sum(g.retries for g in groups),
        "retries/save_sampler": snapshot_retries,
    }
    if distill:
        metrics.update(distill_metrics(groups, step_time))
    if episodic:
        metrics.update(episode_metrics([t for g in groups for t in g.trajectories]))
        metrics["skipped/masked_episodes"] = assembled.masked
    return metrics


def distill_metrics(groups: Sequence[ScoredGroup], step_time: float) -> dict[str, Any]:
    """On-policy distillation's signals over a step's sampled tokens:
    ``distill/reverse_kl`` (mean sampler - teacher logprob: the per-token reverse KL to
    the teacher), ``distill/teacher_logprob`` (the teacher's mean logprob of them),
    ``distill/teacher_s`` (wall time with a teacher request of the step's groups in
    flight) and ``distill/teacher_frac`` (that time over the step's)."""
    trained = [t for g in groups if g.trainable for t in g.trajectories if not t.masked]
    kl, teacher, tokens = reverse_kl(trained)
    asked = [(g.teacher_started, g.teacher_finished) for g in groups if g.teacher_finished]
    teacher_s = _union_length(asked)
    return {
        "distill/reverse_kl": kl / tokens if tokens else None,
        "distill/teacher_logprob": teacher / tokens if tokens else None,
        "distill/tokens": tokens,
        "distill/teacher_s": teacher_s,
        "distill/teacher_frac": _ratio(teacher_s / step_time),
    }


def supervised_step_metrics(
    done: int,
    steps: int,
    groups: Sequence[ScoredGroup],
    assembled: Assembled,
    result: TrainResult,
    timing: StepTiming,
    *,
    lr: float,
) -> dict[str, Any]:
    """The metrics.jsonl event of a supervised step (``--objective sft``): ``sft/loss``
    is the mean cross-entropy per assistant token at the weights the step started from
    (from the logprobs its forward_backward returned), ``sft/tokens`` the tokens it
    trained on."""
    sums, tokens = _weighted_logprobs(assembled, result)
    loss = -sum(sums) / tokens if tokens else None
    used = sum(1 for g in groups if g.trainable)
    return {
        "step": done,
        "sft/loss": loss,
        "sft/tokens": int(tokens),
        "sft/conversations": used,
        **_ready_step_metrics(done, steps, groups, assembled, result, timing, lr, tokens),
    }


def preference_step_metrics(
    done: int,
    steps: int,
    groups: Sequence[ScoredGroup],
    assembled: Assembled,
    result: TrainResult,
    timing: StepTiming,
    *,
    lr: float,
    beta: float,
) -> dict[str, Any]:
    """The metrics.jsonl event of a preference step (``--objective dpo``): the
    ``dpo/*`` values of its pairs at the weights the step started from (the policy's
    logprobs its forward_backward returned), ``dpo/pairs`` the pairs it trained on."""
    policy, tokens = _weighted_logprobs(assembled, result)
    reference = [s for g in groups if g.trainable for s in response_sums(g)]
    chosen, rejected = pair_rewards(policy, reference, beta)
    values = preference_metrics(chosen, rejected)
    return {
        "step": done,
        **values,
        "dpo/pairs": len(chosen),
        "dpo/tokens": int(tokens),
        **_ready_step_metrics(done, steps, groups, assembled, result, timing, lr, tokens),
        # The backward's own loss is a surrogate (the gradients as weights): the DPO loss.
        "optim/loss": values.get("dpo/loss"),
    }


def _weighted_logprobs(assembled: Assembled, result: TrainResult) -> tuple[list[float], float]:
    """Each datum's trained logprobs summed over its weighted tokens (the policy's, at
    the weights the step started from), and the weighted tokens of the step."""
    weights = [np.asarray(d.loss_fn_inputs["weights"], dtype=np.float64) for d in assembled.datums]
    sums = [
        float((w * np.asarray(lp, dtype=np.float64).reshape(-1)).sum())
        for w, lp in zip(weights, result.logprobs, strict=True)
    ]
    return sums, float(sum(w.sum() for w in weights))


def _ready_step_metrics(
    done: int,
    steps: int,
    groups: Sequence[ScoredGroup],
    assembled: Assembled,
    result: TrainResult,
    timing: StepTiming,
    lr: float,
    tokens: float,
) -> dict[str, Any]:
    """What a step of ready groups (nothing sampled: sft, dpo) measures besides its
    objective's values; ``tokens`` are the response tokens it trained on."""
    step_time = max(timing.train_end - timing.last_end, 1e-9)
    training_busy = timing.train_end - max(timing.train_start, timing.last_end)
    used = sum(1 for g in groups if g.trainable)
    return {
        "datums": len(assembled.datums),
        "groups/total": len(groups),
        "groups/used": used,
        "groups/too_long": sum(1 for g in groups if g.too_long is not None),
        "off_policy/staleness": 0,
        "optim/loss": result.metrics.get("loss:sum"),
        "optim/lr": lr,
        "optim/trained_tokens": int(tokens),
        "time/train": timing.train_end - timing.train_start,
        "time/wait": timing.wait,
        "time/step": step_time,
        "trainer/idle_ratio": _ratio(1.0 - training_busy / step_time),
        "throughput/tokens_per_s": tokens / step_time,
        "progress/done_frac": done / steps,
        "problem_ids": [g.problem.id for g in groups],
        "problems/digest": _problems_digest(groups),
    }


def preference_line(step: int, metrics: Mapping[str, Any]) -> str:
    """A preference step's console line."""
    if "dpo/loss" not in metrics:
        return f"Step {step}: no pairs trained, datums={metrics['datums']}"
    return (
        f"Step {step}: dpo/loss={metrics['dpo/loss']:.4f}, "
        f"accuracy={metrics['dpo/accuracy']:.1%}, margin={metrics['dpo/margin']:+.4f}, "
        f"pairs={metrics['dpo/pairs']}"
    )


def supervised_line(step: int, metrics: Mapping[str, Any]) -> str:
    """A supervised step's console line."""
    loss = metrics["sft/loss"]
    shown = "n/a" if loss is None else f"{loss:.4f}"
    return (
        f"Step {step}: sft/loss={shown}, tokens={metrics['sft/tokens']}, datums={metrics['datums']}"
    )


def _problems_digest(groups: Sequence[ScoredGroup]) -> str:
    """A short fingerprint of a step's problems (questions and answers, in order): two
    runs trained the same problem sequence iff their per-step digests match."""
    h = hashlib.sha256()
    for g in groups:
        h.update(f"{g.problem.id}\x1f{g.problem.question}\x1f{g.problem.answer!r}\x1e".encode())
    return h.hexdigest()[:16]


def _union_length(intervals: Sequence[tuple[float, float]]) -> float:
    """Total length covered by ``intervals`` (overlapping spans counted once)."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def _ratio(value: float) -> float:
    return min(1.0, max(0.0, value))
