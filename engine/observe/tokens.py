"""Tokens billed and their estimated cost, as metrics and as text.

Per step: ``tokens/prefill``, ``tokens/sampled``, ``tokens/trained`` (what the step's
server calls billed: :mod:`engine.session.usage`); over the run so far:
``tokens/cumulative/<kind>``. With a price (``--price-prefill``, ``--price-sample``,
``--price-train``, USD per million tokens; a kind without one adds nothing):
``cost/usd`` and ``cost/cumulative_usd``, both at the run's current prices.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from engine.config import EngineConfig
from engine.session.usage import TokenCounts

__all__ = [
    "COST",
    "COST_CUMULATIVE",
    "CUMULATIVE",
    "KINDS",
    "Prices",
    "cumulative_counts",
    "token_metrics",
    "tokens_summary",
    "tokens_summary_line",
    "tokens_text",
    "totals_text",
]

KINDS = tuple(f.name for f in fields(TokenCounts))
"""``prefill``, ``sampled``, ``trained``."""
CUMULATIVE = "tokens/cumulative/"
COST = "cost/usd"
COST_CUMULATIVE = "cost/cumulative_usd"


@dataclass(frozen=True)
class Prices:
    """USD per million tokens of each kind (None: not priced)."""

    prefill: float | None = None
    sampled: float | None = None
    trained: float | None = None

    @classmethod
    def of(cls, config: EngineConfig) -> Prices:
        c = config.logging
        return cls(c.price_prefill, c.price_sample, c.price_train)

    @property
    def set(self) -> bool:
        return any(getattr(self, kind) is not None for kind in KINDS)

    def cost(self, counts: TokenCounts) -> float:
        """Estimated USD of ``counts``."""
        return sum(getattr(counts, k) * (getattr(self, k) or 0.0) for k in KINDS) / 1e6


def token_metrics(step: TokenCounts, total: TokenCounts, prices: Prices) -> dict[str, Any]:
    """A step's token (and, with a price, cost) metrics."""
    out: dict[str, Any] = {f"tokens/{k}": getattr(step, k) for k in KINDS}
    out.update({f"{CUMULATIVE}{k}": getattr(total, k) for k in KINDS})
    if prices.set:
        out[COST] = prices.cost(step)
        out[COST_CUMULATIVE] = prices.cost(total)
    return out


def cumulative_counts(metrics: Mapping[str, Any]) -> TokenCounts | None:
    """The run's total as a step's metrics hold it (None: a step logged before tokens
    were counted)."""
    values = [metrics.get(f"{CUMULATIVE}{k}") for k in KINDS]
    counts = [v for v in values if isinstance(v, int)]
    return TokenCounts(*counts) if len(counts) == len(KINDS) else None


def _count(n: int) -> str:
    if n < 1000:
        return str(n)
    return f"{n / 1e3:.1f}k" if n < 1_000_000 else f"{n / 1e6:.2f}M"


def _usd(x: float) -> str:
    return f"${x:.2f}" if x >= 1 else f"${x:.3g}"


def tokens_text(m: Mapping[str, Any]) -> str | None:
    """The console's compact part of a step's tokens (and cost): this step's, then the
    run's; None for a step without token metrics."""
    if f"{CUMULATIVE}prefill" not in m:
        return None
    step = sum(int(m[f"tokens/{k}"]) for k in KINDS)
    total = sum(int(m[f"{CUMULATIVE}{k}"]) for k in KINDS)
    text = f"{_count(step)} tok (run {_count(total)})"
    if m.get(COST) is not None:
        text += f" {_usd(m[COST])} (run {_usd(m[COST_CUMULATIVE])})"
    return text


def tokens_summary(metrics: Mapping[str, Any]) -> dict[str, Any] | None:
    """summary.json's ``tokens``: the run's totals as its last step holds them, and the
    estimated cost when priced (None: no token metrics)."""
    total = cumulative_counts(metrics)
    if total is None:
        return None
    return {**{k: getattr(total, k) for k in KINDS}, "cost_usd": metrics.get(COST_CUMULATIVE)}


def tokens_summary_line(tokens: Mapping[str, Any], prices: Prices) -> str:
    """summary.md's line of the run's tokens (and estimated cost, with its prices)."""
    line = "- tokens billed: " + totals_text(tokens)
    if tokens["cost_usd"] is not None:
        rates = "/".join("-" if (p := getattr(prices, k)) is None else f"${p:g}" for k in KINDS)
        line += f" ({rates} per million {'/'.join(KINDS)})"
    return line


def totals_text(tokens: Mapping[str, Any]) -> str:
    """The run's tokens by kind (a :func:`tokens_summary`), and the estimated cost."""
    text = ", ".join(f"{k} {tokens[k]:,}" for k in KINDS)
    if tokens["cost_usd"] is not None:
        text += f"; estimated cost {_usd(tokens['cost_usd'])}"
    return text
