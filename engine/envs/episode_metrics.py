"""A step's episode metrics (environment tasks only; single-turn runs log none of them).

Names follow tinker-cookbook's ``env/all/...`` where it has one:

* ``env/all/turns_per_episode``, ``env/all/tokens_per_episode`` (the context an episode
  reached: its last observation plus action), ``env/all/ac_tokens_per_turn`` (response
  length), ``env/all/ob_tokens_per_turn`` (what the environment appended per turn);
* per-episode sums of the turns' metrics, e.g. ``env/all/tool_calls``,
  ``env/all/tool_errors``, ``env/all/parse_errors``;
* ``env/all/truncated_rate`` (turns cut by the action's token limit),
  ``env/all/outcome/<outcome>`` (the fraction of episodes ended by each outcome: limits
  and errors), ``env/all/masked_rate``;
* ``time/episode_p50`` / ``time/episode_p95`` (seconds).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, get_args

import numpy as np

from engine.core.trajectory import Outcome, Trajectory

__all__ = ["episode_metrics"]


def episode_metrics(episodes: Sequence[Trajectory]) -> dict[str, Any]:
    if not episodes:
        return {}
    turns = [t for e in episodes for t in e.turns]
    n = len(episodes)
    out: dict[str, Any] = {
        "env/all/episodes": n,
        "env/all/turns_per_episode": len(turns) / n,
        "env/all/tokens_per_episode": sum(_context(e) for e in episodes) / n,
        "env/all/ac_tokens_per_turn": _mean([len(t.action) for t in turns]),
        "env/all/ob_tokens_per_turn": sum(_appended(e) for e in episodes) / max(1, len(turns)),
        "env/all/truncated_rate": _mean([t.stop_reason == "length" for t in turns]),
        "env/all/masked_rate": sum(e.masked for e in episodes) / n,
        "time/episode_p50": float(np.percentile([e.elapsed for e in episodes], 50)),
        "time/episode_p95": float(np.percentile([e.elapsed for e in episodes], 95)),
    }
    for outcome in get_args(Outcome):
        out[f"env/all/outcome/{outcome}"] = sum(e.outcome == outcome for e in episodes) / n
    for name in sorted({k for t in turns for k in t.metrics}):
        total = sum(float(t.metrics.get(name, 0.0)) for t in turns)
        out[f"env/all/{name}"] = total / n
    return out


def _context(episode: Trajectory) -> int:
    if not episode.turns:
        return 0
    last = episode.turns[-1]
    return len(last.observation) + len(last.action)


def _appended(episode: Trajectory) -> int:
    """Observation tokens the episode's turns added (the first turn's prompt counts)."""
    added, context = 0, 0
    for t in episode.turns:
        added += max(0, len(t.observation) - context)
        context = len(t.observation) + len(t.action)
    return added


def _mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values)) if values else 0.0
