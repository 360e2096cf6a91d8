"""Direct preference optimisation (``--objective dpo``, docs/dpo.md): pairs -> groups, the
loss, and what a step or a held-out set of pairs measures.

A pair is a group of two one-turn trajectories, its chosen and its rejected response
after the same prompt (:class:`PairPlan`); each turn's ``logprobs`` are the reference
policy's logprobs of the response (:class:`~engine.loop.reference.Reference`). Its datums
are those of supervised fine-tuning (weights 1 on the response tokens, 0 on the prompt),
chosen then rejected. With ``pi`` and ``ref`` a response's summed logprob under the
policy and under the reference, the implicit reward of a response is
``beta * (pi - ref)``, the margin of a pair its chosen reward minus its rejected reward,
and the loss of a step of ``B`` pairs ``(1/B) * sum(-log sigmoid(margin))``
(:class:`DpoLoss`), trained through the SDK's custom-loss path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from engine.core.problems import Problem
from engine.core.state import ScoredGroup
from engine.core.trajectory import Trajectory, Turn
from engine.errors import ConfigError
from engine.session.api import CustomLossValue
from engine.tasks.pairs import RenderedPair
from engine.tasks.render import PromptRenderer, TaskContext

__all__ = [
    "DpoLoss",
    "PairPlan",
    "check_pair_task",
    "pair_rewards",
    "preference_metrics",
    "response_sums",
]


class PairSource(Protocol):
    """What ``--objective dpo`` needs of a task beyond a source: each problem's pair
    (:class:`~engine.tasks.pairs.PairTask` has it)."""

    def pair_tokens(self, context: TaskContext, problem: Problem) -> RenderedPair: ...

    def every_problem(self) -> list[Problem]: ...


def check_pair_task(task: Any) -> None:
    """ConfigError unless ``task`` gives each problem a preference pair."""
    if not all(callable(getattr(task, name, None)) for name in ("pair_tokens", "every_problem")):
        raise ConfigError(
            f"--objective dpo trains on preference pairs, and task {task.name!r} has none "
            '(--task jsonl:PATH of {"prompt", "chosen", "rejected"} lines)'
        )


class PairPlan:
    """How a pair becomes a group: two one-turn trajectories, chosen then rejected (no
    logprobs yet: the reference adds them). Every pair, training and held-out, is
    rendered once when the plan is made, so a pair the model cannot take stops the run
    before anything is sent."""

    episodic = False
    workers = None

    def __init__(self, task: Any, renderer: PromptRenderer, max_context: int | None) -> None:
        check_pair_task(task)
        self._task: PairSource = task
        self._context = renderer.context
        for problem in self._task.every_problem():
            prompt, chosen, rejected = self._task.pair_tokens(self._context, problem)
            split, row = problem.data["split"], int(problem.data["row"]) + 1
            where = f"{'held-out ' if split == 'eval' else ''}pair {row} of {task.name}"
            if chosen == rejected:
                raise ConfigError(f"{where}: its chosen and rejected responses are the same tokens")
            longest = len(prompt) + max(len(chosen), len(rejected))
            if max_context is not None and longest > max_context:
                raise ConfigError(
                    f"{where} is {longest} tokens long (prompt and its longer response), more "
                    f"than the model's context of {max_context} tokens"
                )

    def group(self, problem: Problem, version: int) -> tuple[Trajectory, Trajectory]:
        prompt, chosen, rejected = self._task.pair_tokens(self._context, problem)
        return (
            Trajectory((Turn(tuple(prompt), tuple(chosen), None, version, "stop"),)),
            Trajectory((Turn(tuple(prompt), tuple(rejected), None, version, "stop"),)),
        )


def response_sums(group: ScoredGroup) -> tuple[float, float]:
    """The reference's summed logprob of a pair's chosen and rejected response."""
    chosen, rejected = (t.turns[0].logprobs for t in group.trajectories)
    assert chosen is not None and rejected is not None, "the reference scores every pair"
    return float(sum(chosen)), float(sum(rejected))


def _softplus(x: np.ndarray) -> np.ndarray:
    return np.asarray(np.logaddexp(0.0, x), dtype=np.float64)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return np.asarray(np.exp(-np.logaddexp(0.0, -x)), dtype=np.float64)


@dataclass(frozen=True)
class DpoLoss:
    """The DPO loss of pairs whose datums are given chosen then rejected: ``weights``
    (1 on the response tokens) and ``reference`` (the reference's summed logprob of the
    response) per datum; ``scale`` is 1 / the step's pairs. A
    :class:`~engine.session.api.CustomLoss`: given the policy's logprobs, its value, its
    exact gradient and the step's ``dpo/*`` values."""

    weights: tuple[np.ndarray, ...]
    reference: tuple[float, ...]
    beta: float
    scale: float

    def __call__(self, logprobs: Sequence[np.ndarray]) -> CustomLossValue:
        policy = [
            float((w * np.asarray(lp, dtype=np.float64).reshape(-1)).sum())
            for w, lp in zip(self.weights, logprobs, strict=True)
        ]
        chosen, rejected = pair_rewards(policy, self.reference, self.beta)
        margin = chosen - rejected
        # d loss / d policy sum: -scale * beta * sigmoid(-margin) for the chosen response,
        # the opposite for the rejected one; each token of a response has its weight's share.
        coefficient = -self.scale * self.beta * _sigmoid(-margin)
        gradients: list[np.ndarray] = []
        for k, c in enumerate(coefficient):
            gradients.append(c * self.weights[2 * k])
            gradients.append(-c * self.weights[2 * k + 1])
        return CustomLossValue(
            float(self.scale * _softplus(-margin).sum()),
            gradients,
            preference_metrics(chosen, rejected),
        )


def pair_rewards(
    policy: Sequence[float], reference: Sequence[float], beta: float
) -> tuple[np.ndarray, np.ndarray]:
    """The implicit rewards ``beta * (policy - reference)`` of each pair's chosen and
    rejected response (both sequences hold chosen then rejected of each pair)."""
    rewards = beta * (np.asarray(policy, dtype=np.float64) - np.asarray(reference))
    return rewards[0::2], rewards[1::2]


def preference_metrics(
    chosen: np.ndarray, rejected: np.ndarray, prefix: str = "dpo/"
) -> dict[str, float]:
    """``loss`` (mean -log sigmoid(margin)), ``accuracy`` (the fraction of pairs with a
    positive margin), ``margin``, ``chosen_reward`` and ``rejected_reward`` (means)."""
    if not len(chosen):
        return {}
    margin = chosen - rejected
    return {
        f"{prefix}loss": float(_softplus(-margin).mean()),
        f"{prefix}accuracy": float((margin > 0).mean()),
        f"{prefix}margin": float(margin.mean()),
        f"{prefix}chosen_reward": float(chosen.mean()),
        f"{prefix}rejected_reward": float(rejected.mean()),
    }
