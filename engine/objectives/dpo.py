"""``--objective dpo``: preference pairs (prompt, chosen, rejected) through the SDK's
custom loss (docs/dpo.md). Nothing is sampled: each pair is a ready group of its two
replies with the reference's logprobs of them (:mod:`engine.loop.reference`: the
run's initial weights, a resumed run's from its step-0 checkpoint), trained with the
DPO loss (:class:`engine.loop.dpo.DpoLoss`); the held-out evaluation scores the
held-out pairs (:mod:`engine.loop.dpo_eval`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

import numpy as np

from engine.config import EngineConfig
from engine.core.datums import Datum
from engine.core.problems import Problem, Task
from engine.core.state import ScoredGroup
from engine.core.trajectory import Trajectory
from engine.envs.types import AnyTask
from engine.errors import ConfigError
from engine.loop.dpo import DpoLoss, PairPlan, check_pair_task, response_sums
from engine.loop.dpo_eval import PreferenceEvaluator
from engine.loop.evaluation import HeldOutLog, eval_problems_of
from engine.loop.groups import NotSampled
from engine.loop.messages import steps_done
from engine.loop.recipe import FinishedStep, HeldOut
from engine.loop.reference import Reference
from engine.loop.step_metrics import preference_line, preference_step_metrics
from engine.objectives.base import Headline, RunContext, StageRole, figure, shown, train_timing
from engine.objectives.sft import CROSS_ENTROPY, ReadySteps
from engine.session.api import LossSpec, SamplerHandle, Session, StepTicket
from engine.session.capabilities import Need, custom_loss_need, loss_need
from engine.session.usage import spending_for
from engine.tasks.dataset import DataFormat
from engine.tasks.pairs import PairTask

__all__ = ["DPO", "HELD_OUT_ACCURACY", "DpoObjective", "DpoRun", "DpoSteps"]


class DpoSteps(ReadySteps):
    """Pairs scored by ``reference``, trained with the DPO loss."""

    def __init__(self, config: EngineConfig, plan: PairPlan, reference: Reference) -> None:
        super().__init__(config)
        self._plan = plan
        self._reference = reference

    async def group(self, problem: Problem, step: int) -> tuple[Trajectory, ...] | NotSampled:
        with spending_for(steps_done(step)):
            return await self._reference.score(problem, self._plan.group(problem, step))

    async def forward_backward(
        self,
        session: Session,
        ticket: StepTicket,
        groups: Sequence[ScoredGroup],
        datums: Sequence[Datum],
    ) -> None:
        # Chosen then rejected of each trainable pair, in order; scaled by the step's pairs.
        loss = DpoLoss(
            tuple(np.asarray(d.loss_fn_inputs["weights"], dtype=np.float64) for d in datums),
            tuple(s for g in groups if g.trainable for s in response_sums(g)),
            self._config.preference.dpo_beta,
            1.0 / self._config.pipeline.batch,
        )
        await session.submit_forward_backward_custom(ticket, datums, loss)

    def step_metrics(self, step: FinishedStep) -> tuple[dict[str, Any], str]:
        cfg = self._config
        metrics = preference_step_metrics(
            step.done,
            cfg.pipeline.steps,
            step.groups,
            step.assembled,
            step.result,
            step.timing,
            lr=cfg.training.learning_rate or 0.0,
            beta=cfg.preference.dpo_beta,
        )
        return metrics, preference_line(step.done, metrics)


class DpoRun:
    def __init__(self, context: RunContext) -> None:
        config, session = context.config, context.session
        refusal = session.custom_loss_refusal
        if refusal is not None:
            raise ConfigError(f"--objective dpo cannot run: {refusal}")
        self._context = context
        self._plan = PairPlan(context.task, context.renderer, session.info.max_context)
        self._reference = Reference(session, config.pipeline.concurrency)
        self.evaluator: HeldOut | None = None
        if config.evaluation.eval_every:
            self.evaluator = PreferenceEvaluator(
                session,
                self._plan,
                self._reference,
                eval_problems_of(context.task),
                config,
                HeldOutLog(config, context.run_dir, context.track),
                say=context.say,
            )

    async def start(self) -> None:
        """Nothing to open before the first sampler: the reference is its weights."""

    async def recipe(self, sampler: SamplerHandle, resumed: bool) -> DpoSteps:
        if self._reference.sampler is None:  # the run's initial weights, once
            self._reference.sampler = await self._context.initial_sampler() if resumed else sampler
        return DpoSteps(self._context.config, self._plan, self._reference)


HELD_OUT_ACCURACY: Final = "eval/dpo/accuracy"
"""How often the held-out pairs' chosen response has the higher implicit reward."""


class DpoObjective:
    name = "dpo"
    samples = False
    logs_conversations = False
    held_out = ("scored", "pairs")
    held_out_values: tuple[str, ...] = (HELD_OUT_ACCURACY, "eval/dpo/prefers_chosen")
    stage: StageRole = None
    takes_teacher = False
    own_settings: str | None = "preference"
    progress: tuple[str, str] | None = None  # its console line has its values
    headlines: tuple[Headline, ...] = (
        Headline(HELD_OUT_ACCURACY, "held-out preference accuracy", percent=True),
        Headline("dpo/accuracy", "preference accuracy", percent=True),
        Headline("dpo/margin", "reward margin, chosen - rejected"),
    )

    def data_task(self, path: str, args: Mapping[str, str], data_format: DataFormat) -> Task:
        return PairTask.from_args(path, args, data_format)

    def check_task(self, task: AnyTask) -> None:
        check_pair_task(task)

    def check_config(self, config: EngineConfig, chosen: bool) -> None:
        if chosen and config.pipeline.stream_minibatches:
            raise ConfigError(
                "--stream-minibatches splits a step's forward_backward, and --objective dpo "
                "sends a step's pairs in one forward_backward_custom (its loss is over them all)"
            )

    def open(self, context: RunContext) -> DpoRun:
        return DpoRun(context)

    def loss(self, config: EngineConfig) -> LossSpec:
        return CROSS_ENTROPY

    def needs(self, config: EngineConfig) -> list[Need]:
        setting = f"--objective {self.name}"
        return [loss_need(CROSS_ENTROPY, setting), custom_loss_need(setting)]

    def loss_name(self, config: EngineConfig) -> str:
        return f"dpo (forward_backward_custom, beta {config.preference.dpo_beta})"

    def summary_table(self, metrics: Sequence[Mapping[str, Any]]) -> list[str]:
        return [
            "| step | dpo/loss | dpo/accuracy | dpo/margin | pairs | time/step (s) |",
            "|---:|---:|---:|---:|---:|---:|",
            *(
                f"| {m['step']} | {figure(m.get('dpo/loss'))} | {figure(m.get('dpo/accuracy'))} | "
                f"{figure(m.get('dpo/margin'))} | {m['dpo/pairs']} | {m['time/step']:.2f} |"
                for m in metrics
            ),
        ]

    def step_detail(self, metrics: Mapping[str, Any]) -> str:
        """The implicit rewards of its pairs, its tokens, train time and idleness."""
        m = metrics
        return (
            f"  chosen_reward={shown(m.get('dpo/chosen_reward'), '+.4f')} "
            f"rejected_reward={shown(m.get('dpo/rejected_reward'), '+.4f')} "
            f"tokens={m['dpo/tokens']} | {train_timing(m)}"
        )

    def summary_figures(self, metrics: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        first, last = (metrics[0], metrics[-1]) if metrics else ({}, {})
        return {
            f"{which}_dpo": {k: step.get(f"dpo/{k}") for k in ("loss", "accuracy", "margin")}
            for which, step in (("first", first), ("last", last))
        }


DPO = DpoObjective()
