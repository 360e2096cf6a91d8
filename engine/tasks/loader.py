"""Turn ``--task`` into a Task: the built-in arithmetic task, or ``package.module:attr``.

Why strict: a typo in a task path should stop the run before any server work, with one
sentence naming what is wrong, not an ImportError traceback halfway through step 1.
"""

from __future__ import annotations

import importlib
from typing import Any

from engine.errors import ConfigError
from engine.tasks.arithmetic import ArithmeticTask
from engine.tasks.base import Task

__all__ = ["BUILTIN_TASKS", "load_task"]

BUILTIN_TASKS = ("arithmetic",)

_REQUIRED = ("name", "source", "prompt", "score")


def load_task(spec: str, *, op: str = "*", min_operand: int = 10, max_operand: int = 199) -> Task:
    """``"arithmetic"`` (configured by ``op`` and the operand range) or a user task at
    ``package.module:attr``, where ``attr`` is a Task or a zero-argument callable (a class
    or factory) returning one. Raises ConfigError with a one-line reason."""
    if spec == "arithmetic":
        try:
            return ArithmeticTask(op, min_operand, max_operand)
        except ValueError as exc:
            raise ConfigError(f"invalid arithmetic task: {exc}") from exc
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"invalid task {spec!r}: use 'arithmetic' or 'package.module:attr'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"invalid task {spec!r}: cannot import {module_name!r} ({exc})") from exc
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"invalid task {spec!r}: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not _is_task(obj) and callable(obj):
        try:
            obj = obj()
        except Exception as exc:
            raise ConfigError(f"invalid task {spec!r}: calling {attr} failed ({exc})") from exc
    if not _is_task(obj):
        missing = [name for name in _REQUIRED if not hasattr(obj, name)]
        raise ConfigError(
            f"invalid task {spec!r}: {type(obj).__name__} is not a Task "
            f"(missing {', '.join(missing)})"
        )
    return obj  # type: ignore[no-any-return]


def _is_task(obj: object) -> bool:
    return all(hasattr(obj, name) for name in _REQUIRED) and not isinstance(obj, type)
