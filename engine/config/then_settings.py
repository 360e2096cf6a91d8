"""The second stage's settings (``--then``): the settings a second stage sets apart from
the first, each built from the setting of the first stage it stands for (its check,
resume rule and default), so nothing about them is declared twice."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, Field
from pydantic.fields import FieldInfo

from engine.common.setting import Setting, SettingField, setting_fields
from engine.config.loop_settings import EvaluationSettings, PipelineSettings
from engine.config.loss_settings import DistillationSettings, TrainingSettings
from engine.config.model_settings import TaskSettingsGroup
from engine.config.settings_group import SettingsGroup

__all__ = ["ThenSettings"]


def _setting_of(group: type[BaseModel], name: str) -> SettingField:
    """The setting ``name`` of ``group`` (a first-stage setting a second stage sets)."""
    return next(f for f in setting_fields(group) if f.name == name)


def _second(group: type[BaseModel], name: str) -> Any:
    """The field of the second stage's own value of ``group``'s setting ``name``: the
    flag ``--then-<its flag>``, the flat name ``then_<its flat name>``, its check and
    resume rule; unset (None, or no task arguments) it is what a run of its own has."""
    of = _setting_of(group, name)
    unset: str | None = None
    if of.marker.recommended:
        unset = "the server's recommendation"
    elif not isinstance(of.default, dict):
        unset = of.marker.unset or (None if of.default is None else str(of.default))
    marker = Setting(
        flag="--then-" + of.flag.removeprefix("--"),
        flat="then_" + of.flat,
        check=of.marker.check,
        resume=of.marker.resume,
        unset=unset,
    )
    description = f"as {of.flag}, for the second stage"
    if isinstance(of.default, dict):
        info = FieldInfo(default_factory=dict, description=description)
    else:
        info = FieldInfo(default=None, description=description)
    info.metadata.append(marker)
    return info


class ThenSettings(SettingsGroup):
    """The second stage (--then): trained from the first stage's final weights.

    It runs in ``<run dir>/<objective>`` on the same server (:mod:`engine.stages`,
    docs/sft.md). These settings are its own; unset, each is what a run of its own
    would have, not the first stage's value. Every other setting is shared. Each field
    is named as the first stage's setting it stands for is (its flat name) and has its
    type (tests/test_config_settings.py checks it)."""

    objective: Annotated[str | None, Setting(flag="--then", flat="then", unset="none")] = Field(
        None,
        description="after an --objective sft run, train its final weights on: rl, or "
        "distill (with --then-teacher); one command, one local server",
    )
    task: str | None = _second(TaskSettingsGroup, "spec")
    task_args: dict[str, str] = _second(TaskSettingsGroup, "args")
    steps: int | None = _second(PipelineSettings, "steps")
    batch: int | None = _second(PipelineSettings, "batch")
    learning_rate: float | None = _second(TrainingSettings, "learning_rate")
    eval_every: int | None = _second(EvaluationSettings, "eval_every")
    teacher: str | None = _second(DistillationSettings, "teacher")
