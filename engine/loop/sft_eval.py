"""Held-out evaluation of supervised fine-tuning: the mean cross-entropy per assistant
token of the held-out conversations (``eval/sft/loss``), and their first replies
answered greedily (the ``eval/*`` metrics of :func:`~engine.loop.evaluation.evaluate`).

The loss is computed from the sampler snapshot of the weights after the step
(``Session.prompt_logprobs``, a forward pass without a backward one), so it holds
exactly the steps before it while the next steps are already submitted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import anyio
import numpy as np

from engine.config import EngineConfig
from engine.core.datums import Datum, supervised_datums
from engine.core.problems import Problem
from engine.loop.evaluation import HeldOutLog, evaluate
from engine.loop.groups import GroupPlan, NotSampled
from engine.loop.sft_stage import ConversationPlan
from engine.session.api import SamplerHandle, Session

__all__ = ["SupervisedEvaluator", "held_out_loss"]


async def held_out_loss(
    session: Session, sampler: SamplerHandle, datums: Sequence[Datum], *, concurrency: int = 64
) -> tuple[float, int]:
    """(mean cross-entropy per weighted token, weighted tokens) of ``datums`` under
    ``sampler``: one prompt-logprobs request per datum, ``concurrency`` at once."""
    limiter = anyio.CapacityLimiter(concurrency)
    totals = [0.0] * len(datums)

    async def one(i: int, datum: Datum) -> None:
        targets = datum.loss_fn_inputs["target_tokens"]
        tokens = [int(datum.model_input[0]), *(int(t) for t in targets)]
        async with limiter:
            logprobs = await session.prompt_logprobs(sampler, tokens)
        scored = np.asarray([0.0 if lp is None else lp for lp in logprobs[1:]], dtype=np.float64)
        totals[i] = -float((datum.loss_fn_inputs["weights"] * scored).sum())

    async with anyio.create_task_group() as tg:
        for i, datum in enumerate(datums):
            tg.start_soon(one, i, datum)
    tokens = int(sum(float(d.loss_fn_inputs["weights"].sum()) for d in datums))
    return (sum(totals) / tokens if tokens else float("nan")), tokens


class SupervisedEvaluator:
    """The held-out loss of the task's held-out conversations every ``--eval-every``
    steps, at step 0 and after the last step; with ``replies`` (a group plan of the
    task) also their first replies, answered greedily. Each result is appended to
    ``<run dir>/eval.jsonl`` (``held_out``) and said on the console."""

    def __init__(
        self,
        session: Session,
        plan: ConversationPlan,
        replies: GroupPlan | None,
        problems: Sequence[Problem],
        config: EngineConfig,
        held_out: HeldOutLog,
        *,
        say: Callable[[str], None] = lambda line: None,
    ) -> None:
        self._session = session
        self._replies = replies
        self._problems = problems
        self._config = config
        self._held_out = held_out
        self._say = say
        self._datums: list[Datum] = []
        self._too_long = 0
        for problem in problems:
            built = plan.build(problem, 0)
            if isinstance(built, NotSampled):
                self._too_long += 1
            else:
                self._datums.extend(supervised_datums(built))

    def due(self, step: int) -> bool:
        """Whether the weights after ``step`` train steps are evaluated."""
        return self._held_out.due(step)

    async def __call__(self, step: int, sampler: SamplerHandle) -> dict[str, float]:
        cfg = self._config
        loss, tokens = await held_out_loss(
            self._session, sampler, self._datums, concurrency=cfg.pipeline.concurrency
        )
        metrics: dict[str, float] = {
            "eval/sft/loss": loss,
            "eval/sft/tokens": float(tokens),
            "eval/sft/conversations": float(len(self._problems) - self._too_long),
        }
        if self._replies is not None:
            metrics.update(
                await evaluate(
                    self._session,
                    sampler,
                    self._replies,
                    self._problems,
                    max_tokens=cfg.sampling.max_tokens,
                    concurrency=cfg.pipeline.concurrency,
                    seed=cfg.task.seed,
                )
            )
        self._held_out.write(step, sampler, metrics)
        correct = metrics.get("eval/correct/rate")
        self._say(
            f"Eval after step {step}: eval/sft/loss={loss:.4f} over {tokens} assistant tokens"
            + ("" if correct is None else f", first replies correct={correct:.1%} (greedy)")
            + f" ({int(metrics['eval/sft/conversations'])} held-out conversations)"
        )
        return metrics
