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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from engine.core.problems import Problem, ProblemSource, RewardBreakdown, Task
from engine.core.trajectory import (
    Action,
    EpisodeLimits,
    Observation,
    Outcome,
    StopCondition,
    Trajectory,
)
from engine.tasks.render import ChatMessage, TaskContext, render_prompt

if TYPE_CHECKING:
    from typing_extensions import TypeIs  # typing.TypeIs from Python 3.13

__all__ = [
    "AnyTask",
    "Env",
    "EnvContext",
    "EnvGroupBuilder",
    "EnvStepResult",
    "EnvTask",
    "is_env_task",
]


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
class EnvContext:
    """What a builder may need from the run: the served tokenizer and chat-template
    options (``task``), the run's default stop condition (the task's stop strings,
    ``--stop-at-eos``, ``--max-tokens``) and the episode limits."""

    task: TaskContext
    stop: StopCondition
    limits: EpisodeLimits = field(default_factory=EpisodeLimits)

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
        """A seeded, resumable problem source (see :class:`~engine.core.problems.Task`)."""
        ...

    def group_builder(
        self, problem: Problem, group_size: int, context: EnvContext
    ) -> EnvGroupBuilder:
        """The builder of ``problem``'s group of ``group_size`` episodes."""
        ...


AnyTask = Task | EnvTask
"""What a run trains on: a single-turn :class:`~engine.core.problems.Task` or an
:class:`EnvTask`."""


def is_env_task(obj: object) -> TypeIs[EnvTask]:
    """True for an :class:`EnvTask` (it builds environments rather than scoring
    responses)."""
    return callable(getattr(obj, "group_builder", None)) and callable(getattr(obj, "source", None))
