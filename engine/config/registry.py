"""The settings tasks declare of their own (the arithmetic task's ``--op``, ...).

A task's settings model registers itself here when its module is imported
(:func:`register_task_settings`, a class decorator), so the config reads them without
importing any task: the CLI, the environment variables and flat keywords of
``EngineConfig`` see every registered model (``import engine`` registers the built-in
tasks').
"""

from __future__ import annotations

from typing import TypeVar

from engine.common.setting import TaskSettings

__all__ = ["register_task_settings", "settings_spec", "task_settings_models"]

_T = TypeVar("_T", bound=type[TaskSettings])
_REGISTERED: list[type[TaskSettings]] = []


def register_task_settings(model: _T) -> _T:
    """Register ``model`` (once; its ``spec`` names the task it belongs to)."""
    if any(m.spec == model.spec and m is not model for m in _REGISTERED):
        raise ValueError(f"task settings for {model.spec!r} are registered already")
    if model not in _REGISTERED:
        _REGISTERED.append(model)
    return model


def task_settings_models() -> tuple[type[TaskSettings], ...]:
    """Every registered model, in registration order."""
    return tuple(_REGISTERED)


def settings_spec(spec: str) -> str:
    """The task spec whose own settings and server recommendations ``spec`` takes: a
    judged task's (``judge:arithmetic`` -> ``arithmetic``: the judge changes the
    reward, not the problems), else ``spec`` itself."""
    while spec.startswith("judge:"):
        spec = spec.removeprefix("judge:")
    return spec
