"""``--objective sft``: supervised fine-tuning on the assistant turns of a task's
conversations (docs/sft.md). Nothing is sampled: the SFT stage
(:mod:`engine.loop.sft_stage`) sends each conversation as a ready group whose turns are
its assistant messages, trained with ``cross_entropy`` on weights 1 on the assistant's
tokens; the held-out evaluation is the held-out conversations' loss
(:mod:`engine.loop.sft_eval`). DPO (:mod:`engine.objectives.dpo`) reuses its steps.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

from engine.config import EngineConfig
from engine.core.datums import Datum, GroupDatums, supervised_datums
from engine.core.problems import Problem, Task
from engine.core.state import ScoredGroup
from engine.core.trajectory import Trajectory
from engine.envs.types import AnyTask
from engine.errors import ConfigError
from engine.loop.evaluation import HeldOutLog, eval_problems_of
from engine.loop.groups import GroupPlan, NotSampled
from engine.loop.recipe import FinishedStep, FirstStage, HeldOut, StageContext
from engine.loop.sft_eval import SupervisedEvaluator
from engine.loop.sft_stage import ConversationPlan, SftStage, check_conversation_task
from engine.loop.step_metrics import supervised_line, supervised_step_metrics
from engine.objectives.base import Headline, RunContext, StageRole, figure, shown, train_timing
from engine.session.api import LossSpec, SamplerHandle, Session, StepTicket
from engine.session.capabilities import Need, loss_need
from engine.tasks.conversations import ConversationTask
from engine.tasks.dataset import DataFormat

__all__ = ["CROSS_ENTROPY", "SFT", "ReadySteps", "SftObjective", "SftRun", "SftSteps"]

CROSS_ENTROPY = LossSpec("cross_entropy")
"""SFT's loss; DPO's custom loss trains through it too."""


class ReadySteps(ABC):
    """A recipe's part for steps of ready groups (nothing sampled: the SFT stage builds
    each group with :meth:`group`), each datum weighted 1 on the assistant's tokens."""

    samples = False
    episodic = False
    workers = None

    def __init__(self, config: EngineConfig) -> None:
        self._config = config

    @abstractmethod
    async def group(self, problem: Problem, step: int) -> tuple[Trajectory, ...] | NotSampled:
        """The ready group of ``problem`` for 0-based step ``step``."""

    def first_stage(self, context: StageContext) -> FirstStage:
        return SftStage(context, self.group)

    def datums(self, group: ScoredGroup) -> GroupDatums:
        datums = [d for t in group.trajectories for d in supervised_datums(t)]
        return GroupDatums(datums, [0.0] * len(group.trajectories), 0, 0, 0)


class SftSteps(ReadySteps):
    """Conversations, trained with ``cross_entropy``."""

    def __init__(self, config: EngineConfig, plan: ConversationPlan) -> None:
        super().__init__(config)
        self._plan = plan

    async def group(self, problem: Problem, step: int) -> tuple[Trajectory, ...] | NotSampled:
        conversation = self._plan.build(problem, step)
        return conversation if isinstance(conversation, NotSampled) else (conversation,)

    async def forward_backward(
        self,
        session: Session,
        ticket: StepTicket,
        groups: Sequence[ScoredGroup],
        datums: Sequence[Datum],
    ) -> None:
        await session.submit_forward_backward(ticket, datums, CROSS_ENTROPY)

    def step_metrics(self, step: FinishedStep) -> tuple[dict[str, Any], str]:
        cfg = self._config
        metrics = supervised_step_metrics(
            step.done,
            cfg.pipeline.steps,
            step.groups,
            step.assembled,
            step.result,
            step.timing,
            lr=cfg.training.learning_rate or 0.0,
        )
        return metrics, supervised_line(step.done, metrics)


class SftRun:
    def __init__(self, context: RunContext) -> None:
        config, task, session = context.config, context.task, context.session
        self._config = config
        self._plan = ConversationPlan(task, context.renderer, session.info.max_context)
        self.evaluator: HeldOut | None = None
        if config.evaluation.eval_every:
            self.evaluator = SupervisedEvaluator(
                session,
                self._plan,
                GroupPlan(config, task, context.renderer, session.info.max_context),
                eval_problems_of(task),
                config,
                HeldOutLog(config, context.run_dir, context.track),
                say=context.say,
            )

    async def start(self) -> None:
        """Nothing to open."""

    async def recipe(self, sampler: SamplerHandle, resumed: bool) -> SftSteps:
        return SftSteps(self._config, self._plan)


class SftObjective:
    name = "sft"
    samples = False
    logs_conversations = True
    held_out = ("greedy", "problems")
    held_out_values: tuple[str, ...] = ("eval/sft/loss",)
    stage: StageRole = "first"
    takes_teacher = False
    own_settings: str | None = None
    progress: tuple[str, str] | None = ("sft/loss", "loss")
    headlines: tuple[Headline, ...] = (
        Headline("eval/sft/loss", "held-out loss per assistant token"),
        Headline("sft/loss", "training loss per assistant token"),
    )

    def data_task(self, path: str, args: Mapping[str, str], data_format: DataFormat) -> Task:
        return ConversationTask.from_args(path, args, data_format)

    def check_task(self, task: AnyTask) -> None:
        check_conversation_task(task)

    def check_config(self, config: EngineConfig, chosen: bool) -> None:
        training = config.training
        if chosen and (training.tis_cap or training.mask_high):
            raise ConfigError(
                "--tis-cap and --mask-low/--mask-high apply to the RL losses; --objective sft "
                "trains cross_entropy"
            )

    def open(self, context: RunContext) -> SftRun:
        return SftRun(context)

    def loss(self, config: EngineConfig) -> LossSpec:
        return CROSS_ENTROPY

    def needs(self, config: EngineConfig) -> list[Need]:
        return [loss_need(CROSS_ENTROPY, f"--objective {self.name}")]

    def loss_name(self, config: EngineConfig) -> str:
        return "cross_entropy"

    def summary_table(self, metrics: Sequence[Mapping[str, Any]]) -> list[str]:
        return [
            "| step | sft/loss | tokens | datums | time/step (s) |",
            "|---:|---:|---:|---:|---:|",
            *(
                f"| {m['step']} | {figure(m['sft/loss'])} | {m['sft/tokens']} | "
                f"{m['datums']} | {m['time/step']:.2f} |"
                for m in metrics
            ),
        ]

    def step_detail(self, metrics: Mapping[str, Any]) -> str:
        """Its groups, summed loss, train time, idleness and throughput."""
        m = metrics
        return (
            f"  groups={m['groups/used']}/{m['groups/total']} "
            f"loss:sum={shown(m['optim/loss'], '.4g')} | {train_timing(m)} "
            f"| {m['throughput/tokens_per_s']:.0f} tok/s"
        )

    def summary_figures(self, metrics: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        first, last = (metrics[0], metrics[-1]) if metrics else ({}, {})
        return {"first_sft_loss": first.get("sft/loss"), "last_sft_loss": last.get("sft/loss")}


SFT = SftObjective()
