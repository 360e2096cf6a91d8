"""The built-in tasks' own settings (the arithmetic task's ``--op``, ...), declared here
with the other settings so the config knows them without importing a task: a fresh
``EngineConfig(op="+")`` takes them. A user's task registers its own
(:func:`engine.config.registry.register_task_settings`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Final

from pydantic import Field

from engine.common.setting import Setting, TaskSettings, one_of

__all__ = [
    "ARITHMETIC_OPS",
    "BUILT_IN_TASK_SETTINGS",
    "DEFAULT_EVAL_SIZE",
    "ArithmeticSettings",
    "default_eval_size",
]

ARITHMETIC_OPS: Final = ("+", "-", "*")
"""The operations of the arithmetic task (:mod:`engine.tasks.arithmetic`)."""

DEFAULT_EVAL_SIZE: Final = 64
"""Held-out pairs of an evaluated arithmetic run (a tenth of the pairs when the range has
fewer than 640)."""


def default_eval_size(min_operand: int | str, max_operand: int | str) -> int:
    """The held-out pairs of an evaluated run over ``min_operand..max_operand`` (0 for a
    range that is not one: the task reports that)."""
    try:
        pairs = (int(max_operand) - int(min_operand) + 1) ** 2
    except ValueError:
        return 0
    return min(DEFAULT_EVAL_SIZE, pairs // 10) if int(max_operand) >= int(min_operand) else 0


class ArithmeticSettings(TaskSettings):
    """The arithmetic task's own flags (``--op +`` is ``--task-arg op=+``); the server
    recommends them for the model it serves."""

    spec = "arithmetic"

    op: Annotated[str | None, Setting(check=one_of(ARITHMETIC_OPS), recommended=True)] = Field(
        None, description=f"arithmetic task: the operation ({' '.join(ARITHMETIC_OPS)})"
    )
    min_operand: Annotated[int | None, Setting(recommended=True)] = Field(
        None, description="arithmetic task: smallest operand"
    )
    max_operand: Annotated[int | None, Setting(recommended=True)] = Field(
        None, description="arithmetic task: largest operand"
    )

    @classmethod
    def complete(cls, args: Mapping[str, str], *, evaluated: bool) -> dict[str, str]:
        """Held-out pairs only when evaluated: otherwise the quickstart's problems."""
        out = dict(args)
        if evaluated and "eval_size" not in out and {"min_operand", "max_operand"} <= out.keys():
            out["eval_size"] = str(default_eval_size(out["min_operand"], out["max_operand"]))
        return out


BUILT_IN_TASK_SETTINGS: Final[tuple[type[TaskSettings], ...]] = (ArithmeticSettings,)
"""Every built-in task's own settings (:func:`engine.config.registry.task_settings_models`
lists them first)."""
