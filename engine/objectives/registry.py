"""``--objective NAME`` -> its :class:`~engine.objectives.base.Objective`: one line per
objective (a new one: its module, its tests and its line here)."""

from __future__ import annotations

from engine.errors import ConfigError
from engine.objectives.base import Objective
from engine.objectives.distill import DISTILL
from engine.objectives.dpo import DPO
from engine.objectives.rl import RL
from engine.objectives.sft import SFT

__all__ = ["OBJECTIVES", "objective_named"]

OBJECTIVES: dict[str, Objective] = {
    "rl": RL,
    "sft": SFT,
    "distill": DISTILL,
    "dpo": DPO,
}


def objective_named(name: str) -> Objective:
    """The objective ``--objective name`` trains for; ConfigError for another name."""
    try:
        return OBJECTIVES[name]
    except KeyError:
        raise ConfigError(f"unknown objective {name!r}: one of {', '.join(OBJECTIVES)}") from None
