"""Each objective's headline: the figures a person looks at first, as first -> last.

Each objective names its own (:attr:`engine.objectives.Objective.headlines`: supervised
fine-tuning's held-out loss, then the training loss; distillation's reverse KL to the
teacher; preference pairs' held-out preference accuracy, then the training accuracy and
margin); a reward's (``avg_reward``) is the summary's own line. A headline is given for
each registered objective's metric the run logged, whatever its objective:
``summary.md`` (:mod:`engine.rundir.directory`) and the report's page
(:mod:`engine.observe.run_report`) lead with them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engine.objectives import Headline, headlines

__all__ = ["HeadlineFigure", "headline_figures"]


@dataclass(frozen=True)
class HeadlineFigure:
    """A headline metric's first and last values, at the steps that logged them."""

    headline: Headline
    first_step: int
    first: float
    last_step: int
    last: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "metric": self.headline.metric,
            "first_step": self.first_step,
            "first": self.first,
            "last_step": self.last_step,
            "last": self.last,
        }

    @property
    def line(self) -> str:
        """``label (metric), step a -> b: x -> y``."""

        def shown(value: float) -> str:
            return f"{value:.1%}" if self.headline.percent else f"{value:.4f}"

        h = self.headline
        return (
            f"{h.label} ({h.metric}), step {self.first_step} -> {self.last_step}: "
            f"{shown(self.first)} -> {shown(self.last)}"
        )


def headline_figures(
    steps: Sequence[Mapping[str, Any]], evals: Sequence[Mapping[str, Any]]
) -> list[HeadlineFigure]:
    """The headlines of a run's steps (``metrics.jsonl``) and evaluations
    (``eval.jsonl``) that it logged at least once, in the registry's order."""
    figures = []
    for headline in headlines():
        records = evals if headline.held_out else steps
        logged = [
            (int(r["step"]), float(v))
            for r in records
            if isinstance(v := r.get(headline.metric), int | float)
            and not isinstance(v, bool)
            and math.isfinite(v)
        ]
        if logged:
            (first_step, first), (last_step, last) = logged[0], logged[-1]
            figures.append(HeadlineFigure(headline, first_step, first, last_step, last))
    return figures
