"""The seam between the engine and what it trains for (``--objective``).

An objective (:class:`Objective`) says what differs between RL, SFT, DPO and
distillation: which task a data file becomes and what it must have, what a step's
groups are and where they come from (sampled and scored, or read and rendered), their
datums and loss, the step's metrics and console line (a :class:`StepRecipe`, what the
pipeline asks), the held-out evaluator, what a run needs before its first step (a
teacher, the reference weights a resume reads from its step-0 checkpoint), and how a
run's summary and report name it. The registry (:mod:`engine.objectives.registry`)
maps ``--objective`` to one; the pipeline, supervisor, run directory and report ask it
and never test its name.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from engine.config import EngineConfig
from engine.core.problems import Task
from engine.envs.types import AnyTask
from engine.loop.recipe import HeldOut, StepRecipe
from engine.loop.teacher import Teacher
from engine.session.api import LossSpec, SamplerHandle, Session
from engine.session.capabilities import Need
from engine.tasks.dataset import DataFormat
from engine.tasks.render import PromptRenderer

__all__ = [
    "Headline",
    "Objective",
    "ObjectiveRun",
    "RunContext",
    "StageRole",
    "figure",
    "no_teacher",
    "shown",
]

StageRole = Literal["first", "second"] | None
"""An objective's part in a two-stage command (``--then``, :mod:`engine.stages`):
``"first"``, a second stage may follow it; ``"second"``, it may be one, trained from the
first stage's final weights; None, it runs alone."""


def figure(value: float | None) -> str:
    """A figure of a run's summary: three decimals, or n/a."""
    return "n/a" if value is None else f"{value:.3f}"


@dataclass(frozen=True)
class Headline:
    """A figure a person looks at first in a run's summary and report, as first -> last
    (:mod:`engine.observe.headline`)."""

    metric: str
    """A ``metrics.jsonl`` field, or an ``eval/*`` one of ``eval.jsonl``."""
    label: str
    percent: bool = False

    @property
    def held_out(self) -> bool:
        return self.metric.startswith("eval/")


def shown(value: Any, spec: str) -> str:
    """A value of a step's console line in ``spec``, or n/a (None or NaN)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return format(value, spec)


def train_timing(metrics: Mapping[str, Any]) -> str:
    """A step's console line's training time, wait and trainer idleness (every
    objective's)."""
    m = metrics
    return (
        f"train {m['time/train']:.2f}s wait {m['time/wait']:.2f}s | "
        f"trainer idle {m['trainer/idle_ratio']:.0%}"
    )


async def no_teacher() -> Teacher:
    raise AssertionError("a run without --teacher opens none")


@dataclass(frozen=True)
class RunContext:
    """What an objective's run is built from: the resolved config, the loaded task, the
    run's session and prompt renderer, its run directory, the console (``say``,
    ``warn``) and the trackers (``track``); ``teacher`` opens ``--teacher`` (checked
    once); ``initial_sampler`` opens a resumed run's step-0 sampler weights."""

    config: EngineConfig
    task: AnyTask
    session: Session
    renderer: PromptRenderer
    run_dir: Path
    say: Callable[[str], None]
    warn: Callable[[str], None]
    track: Callable[[int, dict[str, float]], None]
    initial_sampler: Callable[[], Awaitable[SamplerHandle]]
    teacher: Callable[[], Awaitable[Teacher]] = no_teacher


class ObjectiveRun(Protocol):
    """One run of an objective: its held-out evaluator (``--eval-every``; None
    without), what it opens once before the first sampler, and the pipeline's recipe
    each time the pipeline starts (at first, and again after each recovery)."""

    @property
    def evaluator(self) -> HeldOut | None: ...

    async def start(self) -> None:
        """Once per run, before the run's first sampler is opened."""
        ...

    async def recipe(self, sampler: SamplerHandle, resumed: bool) -> StepRecipe:
        """The pipeline's recipe from ``sampler`` on (``resumed``: the run was resumed
        from its run directory)."""
        ...


class Objective(Protocol):
    """What ``--objective NAME`` trains for (the module doc). ``samples``: its steps
    sample the policy (a run's loss, K, batch and group describe it);
    ``logs_conversations``: rollouts.jsonl keeps the prompts of conversations as they
    are; ``held_out``: how its held-out evaluation is made, and of what (its summary's
    line); ``held_out_values``: the values of eval.jsonl its summary shows besides the
    rates; ``stage``: its part in a two-stage command (:data:`StageRole`);
    ``takes_teacher``: it trains from ``--teacher`` (``--then-teacher`` as a second
    stage); ``progress``: the step metric the progress bar shows beside the step
    count, and its label (None: none); ``headlines``: the figures its summary and report
    lead with (a reward's is the summary's own line). Its steps' metrics are its
    recipe's (:mod:`engine.loop.step_metrics`); the report draws the panels of the
    metrics a run has (:mod:`engine.observe.report_panels`)."""

    name: str
    samples: bool
    logs_conversations: bool
    held_out: tuple[str, str]
    held_out_values: tuple[str, ...]
    stage: StageRole
    takes_teacher: bool
    own_settings: str | None
    progress: tuple[str, str] | None
    headlines: tuple[Headline, ...]

    def data_task(self, path: str, args: Mapping[str, str], data_format: DataFormat) -> Task:
        """The task a data file (``--task jsonl:PATH`` or ``parquet:PATH``) becomes."""
        ...

    def check_task(self, task: AnyTask) -> None:
        """ConfigError unless ``task`` has what this objective trains on."""
        ...

    def check_config(self, config: EngineConfig, chosen: bool) -> None:
        """ConfigError (one line) when ``config`` cannot run. ``chosen``: this objective
        is ``config``'s, and checks what it needs of the other settings; else it refuses
        the settings only it takes (:func:`engine.objectives.registry.checked_objective`
        asks every registered objective before a run)."""
        ...

    def open(self, context: RunContext) -> ObjectiveRun:
        """The run's objective (its checks that need the session run now)."""
        ...

    def loss(self, config: EngineConfig) -> LossSpec:
        """The loss and ``loss_fn_config`` its forward_backward sends."""
        ...

    def needs(self, config: EngineConfig) -> list[Need]:
        """What a run asks of a server beyond sampling, checked before its first sample
        on a server the engine did not start (:mod:`engine.session.capabilities`)."""
        ...

    def loss_name(self, config: EngineConfig) -> str:
        """The loss a run trains with, as its summary names it."""
        ...

    def summary_table(self, metrics: Sequence[Mapping[str, Any]]) -> list[str]:
        """summary.md's table of the steps ``metrics`` (metrics.jsonl's events)."""
        ...

    def step_detail(self, metrics: Mapping[str, Any]) -> str:
        """Its part of a step's second console line, from the step's ``metrics`` (the
        tokens billed and the server's queue follow it:
        :func:`engine.observe.metrics.detail_line`)."""
        ...

    def summary_figures(self, metrics: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """summary.json's figures of its own metrics over the steps ``metrics``, None
        where they have none: the summary of every run holds every registered
        objective's keys (:func:`engine.objectives.registry.summary_figures`)."""
        ...
