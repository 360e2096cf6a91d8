"""Each objective's headline: the figures a person looks at first, as first -> last.

Supervised fine-tuning's is its held-out loss (then the training loss), distillation's
the reverse KL to the teacher, preference pairs' the held-out preference accuracy (then
the training accuracy and margin); a reward's (``avg_reward``) is the summary's own
line. A headline is given for each of these metrics the run logged, whatever its
objective: ``summary.md`` (:mod:`engine.rundir.directory`) and the report's page
(:mod:`engine.observe.run_report`) lead with them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engine.observe.report_panels import DPO_HELD_OUT

__all__ = ["HEADLINES", "Headline", "HeadlineFigure", "headline_figures"]


@dataclass(frozen=True)
class Headline:
    metric: str
    """A ``metrics.jsonl`` field, or an ``eval/*`` one of ``eval.jsonl``."""
    label: str
    percent: bool = False

    @property
    def held_out(self) -> bool:
        return self.metric.startswith("eval/")


HEADLINES = (
    Headline("eval/sft/loss", "held-out loss per assistant token"),
    Headline("sft/loss", "training loss per assistant token"),
    Headline("distill/reverse_kl", "reverse KL to the teacher per sampled token"),
    Headline(DPO_HELD_OUT, "held-out preference accuracy", percent=True),
    Headline("dpo/accuracy", "preference accuracy", percent=True),
    Headline("dpo/margin", "reward margin, chosen - rejected"),
)


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
    (``eval.jsonl``) that it logged at least once, in :data:`HEADLINES` order."""
    figures = []
    for headline in HEADLINES:
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
