"""The settings tasks declare of their own (the arithmetic task's ``--op``, ...).

The built-in tasks' are declared with the config (:mod:`engine.config.task_settings`),
so a fresh ``EngineConfig(op="+")`` knows them; a user task's settings model registers
itself (:func:`register_task_settings`, a class decorator). The CLI, the environment
variables and flat keywords of ``EngineConfig`` see every model.
"""

from __future__ import annotations

from typing import TypeVar

from engine.common.setting import TaskSettings
from engine.config.task_settings import BUILT_IN_TASK_SETTINGS

__all__ = ["register_task_settings", "settings_spec", "task_settings_models"]

_T = TypeVar("_T", bound=type[TaskSettings])
_REGISTERED: list[type[TaskSettings]] = []


def register_task_settings(model: _T) -> _T:
    """Register ``model`` (once; its ``spec`` names the task it belongs to)."""
    if any(m.spec == model.spec and m is not model for m in task_settings_models()):
        raise ValueError(f"task settings for {model.spec!r} are registered already")
    if model not in task_settings_models():
        _REGISTERED.append(model)
    return model


def task_settings_models() -> tuple[type[TaskSettings], ...]:
    """The built-in tasks' models, then every registered one in registration order."""
    return (*BUILT_IN_TASK_SETTINGS, *_REGISTERED)


def settings_spec(spec: str) -> str:
    """The task spec whose own settings and server recommendations ``spec`` takes: a
    judged task's (``judge:arithmetic`` -> ``arithmetic``: the judge changes the
    reward, not the problems), else ``spec`` itself."""
    while spec.startswith("judge:"):
        spec = spec.removeprefix("judge:")
    return spec
