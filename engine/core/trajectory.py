"""A rollout's one form, from sampling to the run directory: the turns of an episode
(what was sampled from, the exact sampled tokens, their logprobs and sampler version) and
the finished :class:`Trajectory`. A single-turn task's response is a one-turn trajectory;
an environment's episode has as many turns as it took (docs/architecture.md)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from engine.core.problems import RewardBreakdown

__all__ = [
    "Action",
    "EpisodeLimits",
    "Observation",
    "OnLimit",
    "OnParseError",
    "Outcome",
    "StopCondition",
    "Trajectory",
    "Turn",
]

Outcome = Literal[
    "done",  # the environment ended the episode
    "max_turns",  # the turn limit ended it
    "max_tokens",  # the next observation would not fit the context (--env-max-tokens)
    "timeout",  # the episode ran past --episode-timeout
    "parse_error",  # the action could not be parsed (a malformed tool call)
    "env_error",  # the environment raised
]
"""Why an episode ended. Anything but ``"done"`` is a limit or an error; what it yields
(zero reward or masked) is set by :class:`EpisodeLimits`."""

OnLimit = Literal["zero", "mask"]
"""What an episode cut by a limit (turns, tokens, timeout) or by an environment error
yields: ``zero``: trained with total reward 0 (the model learns that running long is not
rewarded); ``mask``: left out of training (no datums; the group's baseline is taken over
the other episodes)."""

OnParseError = Literal["zero", "mask", "retry"]
"""What an unparsable action (a malformed tool call) yields: ``zero`` or ``mask`` end the
episode as for :data:`OnLimit`; ``retry`` tells the model the error in a message and
lets it try again (the failed turn is trained like any other and counts as a turn)."""


@dataclass(frozen=True)
class StopCondition:
    """When the sampler stops a turn: at any of ``stop_strings`` (sent in preference to
    ``stop_token_ids``: the SDK takes one kind per request), or after ``max_tokens``
    tokens (None: the run's ``--max-tokens``)."""

    stop_strings: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    max_tokens: int | None = None


@dataclass(frozen=True)
class Observation:
    """What the model sees before a turn: the full context as token ids (the previous
    observation plus action plus what the environment appended, when it extends them)
    and the stop condition of the next action."""

    tokens: tuple[int, ...]
    stop: StopCondition = StopCondition()


@dataclass(frozen=True)
class Action:
    """One sampled turn as the environment receives it: the exact sampled tokens and
    the sampler's stop reason (``"stop"`` or ``"length"``: cut by ``max_tokens``)."""

    tokens: tuple[int, ...]
    stop_reason: str = "stop"


@dataclass(frozen=True)
class Turn:
    """One turn of an episode as it was sampled and answered.

    ``observation`` is the exact prompt sampled from, ``action``/``logprobs`` the exact
    sampled tokens and the sampler's logprob of each (None when the server sent none),
    ``version`` the sampler version that produced it; ``teacher_logprobs`` the teacher's
    logprob of each action token (``--objective distill``; None otherwise)."""

    observation: tuple[int, ...]
    action: tuple[int, ...]
    logprobs: tuple[float, ...] | None
    version: int
    stop_reason: str
    reward: float = 0.0
    metrics: Mapping[str, float] = field(default_factory=dict)
    logs: Mapping[str, Any] = field(default_factory=dict)
    teacher_logprobs: tuple[float, ...] | None = None


@dataclass(frozen=True)
class Trajectory:
    """One finished episode: its turns in order, why it ended, and its rewards.

    ``group_reward`` is what :meth:`EnvGroupBuilder.compute_group_rewards` gave it;
    ``masked`` trajectories are left out of training (see :data:`OnLimit`); a limit with
    ``zero`` sets ``zeroed`` and the total reward to 0. ``elapsed`` is the episode's
    wall time in seconds (metrics only)."""

    turns: tuple[Turn, ...]
    outcome: Outcome = "done"
    group_reward: RewardBreakdown = field(default_factory=lambda: RewardBreakdown(0.0))
    masked: bool = False
    zeroed: bool = False
    elapsed: float = 0.0
    error: str | None = None
    """What the environment raised (outcome ``"env_error"``)."""

    @property
    def total_reward(self) -> float:
        """What the advantage is computed from."""
        if self.zeroed:
            return 0.0
        return sum(t.reward for t in self.turns) + self.group_reward.total

    @property
    def version(self) -> int:
        """The oldest sampler version of its turns: the trajectory's staleness is that
        of its oldest turn."""
        return min(t.version for t in self.turns)

    @property
    def action_tokens(self) -> int:
        return sum(len(t.action) for t in self.turns)


@dataclass(frozen=True)
class EpisodeLimits:
    """The bounds every episode of a run runs under, and what hitting one yields.

    ``max_turns``: actions per episode. ``max_tokens``: the longest context (observation
    plus action) an episode may reach; an observation that leaves no room for one more
    token ends it. ``episode_timeout`` / ``tool_timeout``: seconds (None: unbounded; a
    tool call that times out is a tool error the model is told about)."""

    max_turns: int = 8
    max_tokens: int = 8192
    episode_timeout: float | None = None
    tool_timeout: float | None = 60.0
    on_limit: OnLimit = "zero"
    on_parse_error: OnParseError = "zero"

    def within(self, context: int | None) -> EpisodeLimits:
        """These limits with ``max_tokens`` at most ``context`` (the served model's
        context length, None: unknown): an episode that would outgrow the model ends
        with outcome ``"max_tokens"`` instead of a request the server refuses."""
        if context is None or self.max_tokens <= context:
            return self
        return replace(self, max_tokens=context)
