"""The settings groups, one pydantic model per concern, declared by subject: what is
trained and sampled (:mod:`~engine.config.model_settings`), how it is trained
(:mod:`~engine.config.loss_settings`), how the loop runs
(:mod:`~engine.config.loop_settings`), where the engine connects and reports
(:mod:`~engine.config.service_settings`) and the second stage
(:mod:`~engine.config.then_settings`). Each field declares its default, type,
description and (in its :class:`~engine.common.setting.Setting` marker) its flag,
environment variables, checks and resume rule (:func:`all_settings` lists them).
:mod:`engine.config.models` assembles them into
:class:`~engine.config.models.EngineConfig`."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Final

from engine.common.setting import SettingField, setting_fields
from engine.config.loop_settings import (
    CheckpointSettings,
    EnvironmentSettings,
    EvaluationSettings,
    PipelineSettings,
    ScoringSettings,
)
from engine.config.loss_settings import DistillationSettings, PreferenceSettings, TrainingSettings
from engine.config.model_settings import ModelSettings, SamplingSettings, TaskSettingsGroup
from engine.config.service_settings import LoggingSettings, SessionSettings
from engine.config.settings_group import SettingsGroup
from engine.config.then_settings import ThenSettings

__all__ = [
    "GROUPS",
    "CheckpointSettings",
    "DistillationSettings",
    "EnvironmentSettings",
    "EvaluationSettings",
    "LoggingSettings",
    "ModelSettings",
    "PipelineSettings",
    "PreferenceSettings",
    "SamplingSettings",
    "ScoringSettings",
    "SessionSettings",
    "SettingsGroup",
    "TaskSettingsGroup",
    "ThenSettings",
    "TrainingSettings",
    "all_settings",
    "setting_at",
]

GROUPS: Final[Mapping[str, type[SettingsGroup]]] = {
    "task": TaskSettingsGroup,
    "model": ModelSettings,
    "sampling": SamplingSettings,
    "training": TrainingSettings,
    "distillation": DistillationSettings,
    "preference": PreferenceSettings,
    "pipeline": PipelineSettings,
    "scoring": ScoringSettings,
    "environment": EnvironmentSettings,
    "evaluation": EvaluationSettings,
    "checkpoints": CheckpointSettings,
    "session": SessionSettings,
    "logging": LoggingSettings,
    "then": ThenSettings,
}
"""The groups of :class:`EngineConfig`, in the order ``--help`` shows them."""


@functools.cache
def all_settings() -> tuple[SettingField, ...]:
    """Every setting of :class:`~engine.config.models.EngineConfig`, group by group."""
    return tuple(f for name, model in GROUPS.items() for f in setting_fields(model, name))


def setting_at(path: str) -> SettingField | None:
    """The setting at ``group.name`` (None: no such setting)."""
    return next((f for f in all_settings() if f.path == path), None)
