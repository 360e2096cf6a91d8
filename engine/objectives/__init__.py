"""What a run trains for (``--objective``): one module per objective behind one seam
(:mod:`engine.objectives.base`), found by name in :mod:`engine.objectives.registry`."""

from engine.objectives.base import (
    Headline,
    Objective,
    ObjectiveRun,
    RunContext,
    StageRole,
    figure,
)
from engine.objectives.registry import (
    OBJECTIVES,
    checked_objective,
    headlines,
    objective_named,
    staged,
    summary_figures,
)

__all__ = [
    "OBJECTIVES",
    "Headline",
    "Objective",
    "ObjectiveRun",
    "RunContext",
    "StageRole",
    "checked_objective",
    "figure",
    "headlines",
    "objective_named",
    "staged",
    "summary_figures",
]
