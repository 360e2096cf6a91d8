"""The episode API: token-level environments, trajectories and groups of them.

Why token-level at the core: training needs the exact tokens the sampler produced and
their logprobs. An :class:`Env` is handed the sampled tokens themselves (an
:class:`Action`) and answers with the next observation as tokens, so nothing between
sampling and training re-renders the model's output. The message-level layer
(:mod:`engine.envs.messages`) and the single-turn tasks are adapters over it.

One episode::

    obs = await env.initial_observation()      # prompt tokens + stop condition
    while True:
        action = <sample obs.tokens with obs.stop>
        result = await env.step(action)        # reward, done, next observation, ...
        if result.done: break
        obs = result.next_observation

A group (one problem, ``--group`` episodes) is made and scored by an
:class:`EnvGroupBuilder`: ``make_envs()``, then ``compute_group_rewards(...)`` once
every episode has ended (a judge, a pairwise comparison or a ranking sees the whole
group), then ``cleanup()``. An :class:`EnvTask` is what a user brings: a seeded problem
source (the same one single-turn tasks use, so checkpoints and resume work alike) and a
builder per problem. Builders must be picklable where episodes run in worker
processes.

Advantages are group-relative on each trajectory's :attr:`Trajectory.total_reward`
(the sum of its per-turn rewards plus its group reward), as for single-turn tasks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from engine.tasks.base import Problem, ProblemSource, RewardBreakdown
from engine.tasks.render import ChatMessage, TaskContext, render_prompt

if TYPE_CHECKING:
    from typing_extensions import TypeIs  # typing.TypeIs from Python 3.13

__all__ = [
    "Action",
    "Env",
    "EnvContext",
    "EnvGroupBuilder",
    "EnvStepResult",
    "EnvTask",
    "EpisodeLimits",
    "Observation",
    "OnLimit",
    "OnParseError",
    "Outcome",
    "StopCondition",
    "Trajectory",
    "Turn",
    "is_env_task",
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
class EnvStepResult:
    """The environment's answer to one action.

    ``next_observation`` is required while the episode goes on (``done`` False) and
    ignored once it ends. ``metrics`` are numbers averaged into the step's
    ``env/all/<name>`` metrics; ``logs`` are JSON-friendly values shown turn by turn in
    ``rollouts.jsonl`` (the message layer logs the assistant's text, its tool calls and
    their results). ``outcome`` says why an environment ended an episode when it was
    not a natural end (``"parse_error"``: the runner applies ``on_parse_error``)."""

    reward: float = 0.0
    done: bool = False
    next_observation: Observation | None = None
    metrics: Mapping[str, float] = field(default_factory=dict)
    logs: Mapping[str, Any] = field(default_factory=dict)
    outcome: Outcome = "done"


@runtime_checkable
class Env(Protocol):
    """One episode's environment. Used once: the runner calls
    :meth:`initial_observation` once, then :meth:`step` until it returns ``done`` or a
    limit ends the episode. An environment that holds resources releases them in its
    builder's ``cleanup``."""

    async def initial_observation(self) -> Observation: ...

    async def step(self, action: Action) -> EnvStepResult: ...


@dataclass(frozen=True)
class Turn:
    """One turn of an episode as it was sampled and answered.

    ``observation`` is the exact prompt sampled from, ``action``/``logprobs`` the exact
    sampled tokens and the sampler's logprob of each (None when the server sent none),
    ``version`` the sampler version that produced it."""

    observation: tuple[int, ...]
    action: tuple[int, ...]
    logprobs: tuple[float, ...] | None
    version: int
    stop_reason: str
    reward: float = 0.0
    metrics: Mapping[str, float] = field(default_factory=dict)
    logs: Mapping[str, Any] = field(default_factory=dict)


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


@dataclass(frozen=True)
class EnvContext:
    """What a builder may need from the run: the served tokenizer and chat-template
    options (``task``), the run's default stop condition (the task's stop strings,
    ``--stop-at-eos``, ``--max-tokens``) and the episode limits."""

    task: TaskContext
    stop: StopCondition
    limits: EpisodeLimits = EpisodeLimits()

    @property
    def tokenizer(self) -> Any:
        return self.task.tokenizer

    def render(
        self, messages: Sequence[ChatMessage], tools: Sequence[Mapping[str, Any]] = ()
    ) -> list[int]:
        """The chat messages rendered by the served chat template with the generation
        prompt (``tools``: OpenAI-style tool schemas the template lists)."""
        options = dict(self.task.chat_template_options)
        if tools:
            options["tools"] = [dict(t) for t in tools]
        return render_prompt(self.task.tokenizer, messages, options)


@runtime_checkable
class EnvGroupBuilder(Protocol):
    """Makes, scores and cleans up one group of environments (one problem)."""

    async def make_envs(self) -> Sequence[Env]:
        """The group's environments, one per episode (``--group`` of them)."""
        ...

    async def compute_group_rewards(
        self, trajectories: Sequence[Trajectory], envs: Sequence[Env]
    ) -> Sequence[RewardBreakdown]:
        """One reward per trajectory, in order, added to its per-turn rewards (return
        zeros when the per-turn rewards say it all). Raising fails the group like a
        failing reward function (``--on-reward-error``)."""
        ...

    async def cleanup(self) -> None:
        """Release what the environments hold; called once, also after a failure."""
        ...


@runtime_checkable
class EnvTask(Protocol):
    """A multi-turn (or tool-use) task: ``--task package.module:attr`` may name one."""

    name: str

    def source(self, seed: int, state: Mapping[str, Any] | None = None) -> ProblemSource:
        """A seeded, resumable problem source (see :class:`~engine.tasks.base.Task`)."""
        ...

    def group_builder(
        self, problem: Problem, group_size: int, context: EnvContext
    ) -> EnvGroupBuilder:
        """The builder of ``problem``'s group of ``group_size`` episodes."""
        ...


def is_env_task(obj: object) -> TypeIs[EnvTask]:
    """True for an :class:`EnvTask` (it builds environments rather than scoring
    responses)."""
    return callable(getattr(obj, "group_builder", None)) and callable(getattr(obj, "source", None))
