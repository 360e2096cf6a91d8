"""``--objective NAME`` -> its :class:`~engine.objectives.base.Objective`: one entry per
objective (a new one: its module, its tests and its entry here; a test registers one with
``monkeypatch.setitem(OBJECTIVES, NAME, OBJECTIVE)``). The config holds the name alone;
what an objective needs of the other settings is checked here, before a run
(:func:`checked_objective`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from engine.common.setting import setting_fields
from engine.config import EngineConfig
from engine.errors import ConfigError
from engine.objectives.base import Headline, Objective, StageRole
from engine.objectives.distill import DISTILL
from engine.objectives.dpo import DPO
from engine.objectives.rl import RL
from engine.objectives.sft import SFT

__all__ = [
    "OBJECTIVES",
    "checked_objective",
    "headlines",
    "objective_named",
    "staged",
    "summary_figures",
]

OBJECTIVES: dict[str, Objective] = {
    objective.name: objective
    for objective in (
        RL,
        SFT,
        DISTILL,
        DPO,
    )
}


def objective_named(name: str) -> Objective:
    """The objective ``--objective name`` trains for; ConfigError for another name."""
    try:
        return OBJECTIVES[name]
    except KeyError:
        raise ConfigError(f"unknown objective {name!r}: one of {', '.join(OBJECTIVES)}") from None


def checked_objective(config: EngineConfig) -> Objective:
    """The objective ``config`` trains for, once every registered objective found that
    ``config`` can run (ConfigError, one line, exit 2): the chosen one what it needs of
    the other settings, each other one that no setting only it takes is given. MinT's
    rollout correction and completion order apply to the objectives that sample."""
    chosen = objective_named(config.training.objective)
    correction = config.training.rollout_correction
    sampled_only = [  # (given, the setting, why it needs an objective that samples)
        (
            correction != "off",
            f"--rollout-correction {correction}",
            "is applied by the server inside importance_sampling",
        ),
        (
            config.pipeline.step_order == "completion",
            "--step-order completion",
            "forms steps from the sampled groups that finish first",
        ),
    ]
    for given, setting, why in sampled_only:
        if given and not chosen.samples:
            sampling = " or ".join(name for name, o in OBJECTIVES.items() if o.samples)
            raise ConfigError(
                f"{setting} {why}: it needs --objective {sampling} (not {chosen.name})"
            )
    for objective in OBJECTIVES.values():
        objective.check_config(config, chosen=objective is chosen)
    _refuse_unused_settings(config, chosen)
    return chosen


def _refuse_unused_settings(config: EngineConfig, chosen: Objective) -> None:
    """ConfigError when a setting of an objective's own group has a value of its own
    (not its default) in a run that trains that objective in neither stage: it would be
    ignored."""
    training = {chosen.name, config.then.objective}
    for objective in OBJECTIVES.values():
        if objective.own_settings is None or objective.name in training:
            continue
        group = getattr(config, objective.own_settings)
        default = type(group)()
        for setting in setting_fields(type(group), objective.own_settings):
            if getattr(group, setting.name) != getattr(default, setting.name):
                raise ConfigError(
                    f"{setting.flag} is a setting of --objective {objective.name}, and this "
                    f"run trains {chosen.name}: it would be ignored"
                )


def staged(stage: StageRole) -> list[str]:
    """The names of the objectives that take ``stage`` in a two-stage command, in
    registry order (``"second"``: what ``--then`` may name)."""
    return [name for name, objective in OBJECTIVES.items() if objective.stage == stage]


def summary_figures(metrics: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """summary.json's figures of every registered objective over the steps
    ``metrics`` (None where the run has none): its keys are the same whatever the run
    trained for."""
    figures: dict[str, Any] = {}
    for objective in OBJECTIVES.values():
        figures.update(objective.summary_figures(metrics))
    return figures


def headlines() -> tuple[Headline, ...]:
    """Every registered objective's headlines, in registry order: a summary or report
    leads with those its runs logged, whatever they trained for."""
    return tuple(h for objective in OBJECTIVES.values() for h in objective.headlines)
