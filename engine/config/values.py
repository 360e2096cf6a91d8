"""The values settings take that are more than a number or a name, and the names every
layer shares: losses, SDK generations, trackers, where rewards run, the server-liveness
defaults. Kept apart from the settings models so the layers below config can read them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Final, Literal, get_args

from pydantic import AfterValidator

__all__ = [
    "HOSTED_BASE_URL",
    "LOSSES",
    "PROBE_INTERVAL_S",
    "SDKS",
    "TINKER_ONLY_LOSSES",
    "TRACKERS",
    "UNREACHABLE_AFTER_S",
    "DirectoryPath",
    "LogFormat",
    "LogLevel",
    "LossName",
    "LossTemperature",
    "OnRewardError",
    "RolloutCorrectionName",
    "ScoreWorkers",
    "SdkChoice",
    "Tracker",
    "parse_score_workers",
    "pass_k_problem",
]


def _home_expanded(path: Path | None) -> Path | None:
    return None if path is None else path.expanduser()


DirectoryPath = Annotated[Path | None, AfterValidator(_home_expanded)]
"""A directory setting, ``~`` expanded, so that an embedded config means what the CLI's
flag means."""

LossName = Literal["importance_sampling", "ppo", "cispo", "dro", "gspo", "stable_reinforce"]
LOSSES: Final[tuple[str, ...]] = get_args(LossName)
TINKER_ONLY_LOSSES: Final = ("gspo", "stable_reinforce")
"""Losses only the tinker >= 0.38 SDK can send (the ``mint`` SDK's tinker 0.22 refuses
them client-side)."""
LossTemperature = Literal["off", "sampling"]
"""What the RL losses score the sampled tokens under: the model's own logits (``off``,
the quickstart's) or the logits divided by the sampling temperature (``sampling``: the
policy the sampler drew from, so an on-policy ratio is 1; the engine's local server only,
docs/losses.md)."""
RolloutCorrectionName = Literal["off", "mis"]
"""MinT's session-level rollout correction a run asks ``create_model`` for (``off``: none;
the configurations: :data:`engine.common.protocol.ROLLOUT_CORRECTIONS`)."""
SdkChoice = Literal["auto", "mint", "tinker"]
SDKS: Final[tuple[str, ...]] = get_args(SdkChoice)
LogFormat = Literal["console", "json"]
LogLevel = Literal["info", "debug"]
OnRewardError = Literal["fail", "skip"]

HOSTED_BASE_URL: Final = "https://mint.macaron.xin/"
"""Where the quickstart (and the ``mint`` SDK) point when no base URL is configured."""

Tracker = Literal["wandb", "tensorboard"]
TRACKERS: Final[tuple[str, ...]] = get_args(Tracker)

UNREACHABLE_AFTER_S: Final = 30.0
"""Default seconds of refused connections before a server counts as gone."""

PROBE_INTERVAL_S: Final = 5.0
"""Seconds between probes (shorter when ``unreachable_after`` is short: at least three
probes fail before a server counts as gone)."""


@dataclass(frozen=True)
class ScoreWorkers:
    """Where synchronous rewards (and an environment task's environments) run: worker
    threads, ``count`` worker processes, or Ray tasks (``count`` in flight; environment
    tasks only)."""

    kind: Literal["threads", "processes", "ray"] = "threads"
    count: int = 0

    def __str__(self) -> str:
        return "threads" if self.kind == "threads" else f"{self.kind}:{self.count}"


def parse_score_workers(text: str) -> ScoreWorkers:
    """``threads``, ``processes:N`` or ``ray:N`` (N >= 1)."""
    value = text.strip()
    if value == "threads":
        return ScoreWorkers()
    kind, _, count = value.partition(":")
    if kind in ("processes", "ray") and count.strip().isdigit() and int(count) >= 1:
        return ScoreWorkers("processes" if kind == "processes" else "ray", int(count))
    raise ValueError("must be 'threads', 'processes:N' or 'ray:N' with N >= 1")


def pass_k_problem(ks: Sequence[int], samples: int) -> str | None:
    """Why pass@k for each of ``ks`` cannot be estimated from ``samples`` sampled responses
    per problem (the unbiased estimate needs k <= n), or None."""
    if any(k < 1 for k in ks):
        return f"each k must be >= 1, got {min(ks)}"
    if ks and max(ks) > samples:
        return (
            f"pass@{max(ks)} needs at least {max(ks)} sampled responses per problem, "
            f"and {samples} are drawn"
        )
    return None
