"""``--objective rl``: train on rewards. Each step's groups are sampled and scored by
the rollout stage (:mod:`engine.loop.rollout_stage`), their datums carry the group's
advantages (:func:`engine.core.datums.group_datums`), the loss is ``--loss``
(docs/losses.md) and the held-out evaluation answers greedily (:mod:`engine.loop.evaluation`).
Distillation (:mod:`engine.objectives.distill`) is this with a teacher.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from engine.config import EngineConfig
from engine.core.datums import Datum, DistillSignal, GroupDatums, group_datums
from engine.core.problems import Task
from engine.core.state import ScoredGroup
from engine.envs.executors import Workers
from engine.envs.types import AnyTask
from engine.errors import ConfigError
from engine.loop.evaluation import Evaluator, HeldOutLog, eval_problems_of
from engine.loop.groups import GroupPlan
from engine.loop.length_control import LengthControl
from engine.loop.recipe import FinishedStep, FirstStage, HeldOut, StageContext
from engine.loop.rollout_stage import RolloutStage
from engine.loop.step_metrics import quickstart_line, step_metrics
from engine.loop.teacher import Teacher
from engine.objectives.base import Headline, RunContext, StageRole, shown, train_timing
from engine.session.api import LossSpec, SamplerHandle, Session, StepTicket
from engine.session.capabilities import Need, loss_need
from engine.tasks.dataset import DataFormat, DatasetTask

__all__ = ["RL", "RlObjective", "RlRun", "RlSteps", "rl_loss"]


def rl_loss(config: EngineConfig) -> LossSpec:
    """``--loss`` with the ``loss_fn_config`` its settings give."""
    return LossSpec(
        config.training.loss, config.training.loss_fn_config(config.sampling.resolved_temperature)
    )


class RlSteps:
    """The pipeline's recipe for sampled groups: rolled out on ``plan``, trained with
    ``--loss`` on their advantages; with ``teacher`` (``--objective distill``) each
    group is scored by it too, and its datums carry the teacher's per-token signal."""

    samples = True

    def __init__(
        self, config: EngineConfig, plan: GroupPlan, teacher: Teacher | None = None
    ) -> None:
        self._config = config
        self._plan = plan
        self._teacher = teacher
        self._loss = rl_loss(config)
        distill = config.distillation
        self._distill = (
            None
            if teacher is None
            else DistillSignal(distill.distill_coef, distill.distill_reward_weight)
        )

    @property
    def episodic(self) -> bool:
        return self._plan.episodic

    @property
    def workers(self) -> Workers | None:
        return self._plan.workers

    def first_stage(self, context: StageContext) -> FirstStage:
        cfg = self._config
        return RolloutStage(
            context,
            self._plan,
            cfg.sampling,
            cfg.scoring,
            LengthControl.of(cfg),
            seed=cfg.task.seed,
            teacher=self._teacher,
        )

    def datums(self, group: ScoredGroup) -> GroupDatums:
        return group_datums(
            group.trajectories,
            on_missing_logprobs=self._config.training.on_missing_logprobs,
            distill=self._distill,
        )

    async def forward_backward(
        self,
        session: Session,
        ticket: StepTicket,
        groups: Sequence[ScoredGroup],
        datums: Sequence[Datum],
    ) -> None:
        await session.submit_forward_backward(ticket, datums, self._loss)

    def step_metrics(self, step: FinishedStep) -> tuple[dict[str, Any], str]:
        cfg = self._config
        metrics = step_metrics(
            step.done,
            cfg.pipeline.steps,
            step.groups,
            step.assembled,
            step.result,
            step.timing,
            step.meter.take(),
            lr=cfg.training.learning_rate or 0.0,
            staleness=step.staleness,
            episodic=self._plan.episodic,
            snapshot_retries=step.snapshot_retries,
            distill=self._distill is not None,
            batch=cfg.pipeline.batch,
            reserves=cfg.pipeline.refill_groups,
        )
        return metrics, quickstart_line(step.done, metrics)


class RlRun:
    """A run of sampled groups (with ``distill``: scored by ``--teacher`` too)."""

    def __init__(self, context: RunContext, *, distill: bool = False) -> None:
        self._context = context
        self._distill = distill
        self._teacher: Teacher | None = None
        config, task = context.config, context.task
        self._plan = GroupPlan(config, task, context.renderer, context.session.info.max_context)
        self.evaluator: HeldOut | None = None
        if config.evaluation.eval_every:
            self.evaluator = Evaluator(
                context.session,
                self._plan,
                eval_problems_of(task),
                config,
                HeldOutLog(config, context.run_dir, context.track),
                say=context.say,
                warn=context.warn,
            )

    async def start(self) -> None:
        if self._distill:
            self._teacher = await self._context.teacher()

    async def recipe(self, sampler: SamplerHandle, resumed: bool) -> RlSteps:
        return RlSteps(self._context.config, self._plan, self._teacher)


class RlObjective:
    name = "rl"
    samples = True
    logs_conversations = False
    held_out = ("greedy", "problems")
    held_out_values: tuple[str, ...] = ()  # the rates alone
    stage: StageRole = "second"
    takes_teacher = False
    own_settings: str | None = None
    progress: tuple[str, str] | None = ("avg_reward", "reward")
    headlines: tuple[Headline, ...] = ()  # the summary's reward line is every run's

    def data_task(self, path: str, args: Mapping[str, str], data_format: DataFormat) -> Task:
        return DatasetTask.from_args(path, args, data_format)

    def check_task(self, task: AnyTask) -> None:
        """Any task trains on rewards."""

    def check_config(self, config: EngineConfig, chosen: bool) -> None:
        if chosen and config.pipeline.group < 2:
            raise ConfigError(
                f"--group must be at least 2 with --objective rl, got {config.pipeline.group}: "
                "an advantage is a response's reward minus its group's mean, so a group of "
                "one never trains"
            )
        if not chosen and config.pipeline.refill_groups:
            raise ConfigError(
                "--refill-groups samples reserves for groups whose rewards tie: it needs "
                f"--objective rl (not {config.training.objective})"
            )

    def open(self, context: RunContext) -> RlRun:
        return RlRun(context)

    def loss(self, config: EngineConfig) -> LossSpec:
        return rl_loss(config)

    def needs(self, config: EngineConfig) -> list[Need]:
        return [loss_need(self.loss(config), self.loss_setting(config))]

    def loss_setting(self, config: EngineConfig) -> str:
        """The settings that choose its loss, as a refusal names them."""
        training = config.training
        return " ".join([f"--loss {training.loss}", *training.local_loss_options()])

    def loss_name(self, config: EngineConfig) -> str:
        training = config.training
        corrections = []
        if training.loss_temperature == "sampling":
            temperature = config.sampling.temperature  # unset in a run that failed before it
            at = (
                "the sampling temperature"
                if temperature is None
                else f"temperature {temperature:g}"
            )
            corrections.append(f"scored at {at}")
        if training.rollout_correction != "off":
            corrections.append(f"MinT's rollout correction {training.rollout_correction}")
        if training.tis_cap:
            corrections.append(f"TIS cap {training.tis_cap:g}")
        if training.mask_high:
            corrections.append(f"mask [{training.mask_low:g}, {training.mask_high:g}]")
        return training.loss + (f" ({', '.join(corrections)})" if corrections else "")

    def summary_table(self, metrics: Sequence[Mapping[str, Any]]) -> list[str]:
        lines = [
            "| step | avg_reward | datums | staleness | kl_v1 | time/step (s) |",
            "|---:|---:|---:|---:|---:|---:|",
        ]
        for m in metrics:
            kl = m.get("optim/kl_sample_train_v1")
            lines.append(
                f"| {m['step']} | {m['avg_reward']:.3f} | {m['datums']} | "
                f"{m['off_policy/staleness']} | {'n/a' if kl is None else f'{kl:+.4f}'} | "
                f"{m['time/step']:.2f} |"
            )
        return lines

    def step_detail(self, metrics: Mapping[str, Any]) -> str:
        """Sampler versions, staleness, groups trained of sampled (and the reserves
        dynamic sampling added), KL, loss, time split, idleness, throughput."""
        m = metrics
        extra = m.get("refill/extra_groups", 0)
        refilled = f" (+{extra} refill)" if extra else ""
        return (
            f"  versions={m['sampling_client/step_min']}..{m['sampling_client/step_max']} "
            f"staleness={m['off_policy/staleness']} "
            f"groups={m['groups/used']}/{m['groups/total']}{refilled} "
            f"kl_v1={shown(m['optim/kl_sample_train_v1'], '+.4f')} "
            f"kl_v2={shown(m['optim/kl_sample_train_v2'], '.4f')} "
            f"loss={shown(m['optim/loss'], '.4g')} | "
            f"sample {m['time/sample']:.2f}s score {m['time/score']:.2f}s "
            f"{train_timing(m)} sampler idle {m['sampler/idle_ratio']:.0%} "
            f"| {m['throughput/samples_per_s']:.1f} samples/s "
            f"{m['throughput/tokens_per_s']:.0f} tok/s"
        )

    def summary_figures(self, metrics: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        return {}  # its rewards and staleness are every run's


RL = RlObjective()
