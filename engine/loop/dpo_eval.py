"""Held-out evaluation of preference pairs (``--objective dpo``, docs/dpo.md): the DPO
loss, accuracy and margin of the held-out pairs (``eval/dpo/*``), and how often the
policy itself gives the chosen response the higher logprob (``eval/dpo/prefers_chosen``).

The policy's logprobs come from the sampler snapshot of the weights after the step
(``Session.prompt_logprobs``, a forward pass without a backward one), so it measures
exactly the steps before it while the next steps are already submitted; the reference's
are asked once per pair (:class:`~engine.loop.reference.Reference`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import anyio
import numpy as np

from engine.config import EngineConfig
from engine.core.problems import Problem
from engine.loop.dpo import PairPlan, pair_rewards, preference_metrics
from engine.loop.evaluation import HeldOutLog
from engine.loop.reference import Reference
from engine.loop.teacher import action_logprobs
from engine.session.api import SamplerHandle, Session

__all__ = ["PreferenceEvaluator"]


class PreferenceEvaluator:
    """The held-out pairs' ``eval/dpo/*`` every ``--eval-every`` steps, at step 0 and
    after the last step; each result goes to ``held_out`` (``<run dir>/eval.jsonl``) and
    is said on the console."""

    def __init__(
        self,
        session: Session,
        plan: PairPlan,
        reference: Reference,
        problems: Sequence[Problem],
        config: EngineConfig,
        held_out: HeldOutLog,
        *,
        say: Callable[[str], None] = lambda line: None,
    ) -> None:
        self._session = session
        self._plan = plan
        self._reference = reference
        self._problems = problems
        self._beta = config.preference.dpo_beta
        self._concurrency = config.pipeline.concurrency
        self._held_out = held_out
        self._say = say

    def due(self, step: int) -> bool:
        """Whether the weights after ``step`` train steps are evaluated."""
        return self._held_out.due(step)

    async def __call__(self, step: int, sampler: SamplerHandle) -> dict[str, float]:
        slots = anyio.Semaphore(self._concurrency)
        n = len(self._problems)
        policy = [0.0] * (2 * n)
        reference = [0.0] * (2 * n)

        async def one(k: int, problem: Problem) -> None:
            pair = await self._reference.score(problem, self._plan.group(problem, 0))
            for j, trajectory in enumerate(pair):
                turn = trajectory.turns[0]
                logprobs = await action_logprobs(self._session, sampler, turn, slots, "the sampler")
                policy[2 * k + j] = sum(logprobs)
                reference[2 * k + j] = sum(turn.logprobs or ())

        async with anyio.create_task_group() as tg:
            for k, problem in enumerate(self._problems):
                tg.start_soon(one, k, problem)
        chosen, rejected = pair_rewards(policy, reference, self._beta)
        metrics = preference_metrics(chosen, rejected, prefix="eval/dpo/")
        sums = np.asarray(policy)
        metrics["eval/dpo/prefers_chosen"] = float((sums[0::2] > sums[1::2]).mean())
        metrics["eval/dpo/pairs"] = float(n)
        self._held_out.write(step, sampler, metrics)
        self._say(
            f"Eval after step {step}: eval/dpo/accuracy={metrics['eval/dpo/accuracy']:.1%} "
            f"margin={metrics['eval/dpo/margin']:+.3f} loss={metrics['eval/dpo/loss']:.4f}, "
            f"chosen preferred={metrics['eval/dpo/prefers_chosen']:.1%} "
            f"({n} held-out pairs)"
        )
        return metrics
