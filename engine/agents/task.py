"""Agents as training tasks: an agent function run once per episode against the
capturing endpoint.

An agent is ``async def episode(client, problem) -> float | AgentResult``: ``client`` is
an ``openai.AsyncOpenAI`` whose base URL names the episode (``client.base_url`` and
``client.api_key`` serve any other OpenAI-compatible client), ``problem`` the
:class:`~engine.core.problems.Problem` to solve; it returns the episode's reward.
:class:`AgentTask` makes one an :class:`~engine.envs.types.EnvTask`: each group serves
an endpoint on loopback and runs its agents in a task group it owns (the group's scope,
entered by the episode runner around the whole group), one :class:`AgentEnv` each.

With ``--score-workers processes:N`` (or ``ray:N``) the agents run in worker processes
(:class:`~engine.agents.workers.AgentWorkers`; Ray tasks) instead, a group's agents
together in one call (:class:`AgentRuns`), calling the group's endpoint over loopback:
the agent function must be picklable (checked before the run). Their CPU then leaves
the engine's event loop, which serves only the calls.

What an agent that fails yields reuses the environment settings: an agent that raises
or runs past ``timeout`` (default ``--episode-timeout``) after its first call ends its
episode with outcome ``env_error`` (``--on-limit``: zero or mask); one that ends before
its first call fails its group like a failing reward (``--on-reward-error``). When the
group ends, calls still in flight get a 409 and the agents are cancelled.
"""

from __future__ import annotations

import contextlib
import hmac
import importlib.util
import math
import secrets
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import anyio
from anyio.abc import TaskGroup

from engine.agents.chat import ChatFormat
from engine.agents.endpoint import Endpoint, EndpointLimits, serve_endpoint
from engine.agents.episodes import AgentOutcome, AgentResult, Episode
from engine.agents.openai_wire import EndpointError
from engine.agents.workers import AgentWorkers
from engine.basemodels.catalogue import AGENT_MODEL_DIR
from engine.config.values import ScoreWorkers
from engine.envs import Env, EnvContext, Trajectory
from engine.envs.examples.stops import stop_at_eos
from engine.envs.executors import Workers
from engine.envs.scoring import check_reward
from engine.envs.tools import ToolCallParser
from engine.errors import ConfigError, EngineError
from engine.tasks import Problem, ProblemSource, RewardBreakdown, TaskContext

__all__ = ["AgentFunction", "AgentGroup", "AgentRuns", "AgentTask", "run_agent"]

AgentFunction = Callable[[Any, Problem], Awaitable["float | AgentResult"]]
"""``async def episode(client: openai.AsyncOpenAI, problem: Problem) -> float | AgentResult``."""

SERVED_MODEL = "policy"
"""The model name ``/v1/models`` lists (the ``model`` a request names is not checked)."""


class AgentTask:
    """An agent function trained as an environment task.

    ``problems`` is any object with ``source(seed, state)`` (a task such as
    :class:`~engine.tasks.arithmetic.ArithmeticTask`); its ``eval_problems()`` (if any)
    are the held-out set. ``timeout`` bounds each agent run in seconds (None: the run's
    ``--episode-timeout``). ``local_model``: the model the local server loads for this
    task unless one is given (default: the packaged agent model, which knows the
    tool-call format; None: the server's default model). Replies always end at the
    model's EOS, as a chat endpoint's do.
    """

    def __init__(
        self,
        agent: AgentFunction,
        problems: Any,
        *,
        name: str | None = None,
        timeout: float | None = None,
        parser: ToolCallParser | None = None,
        local_model: Path | None = AGENT_MODEL_DIR,
        limits: EndpointLimits | None = None,
    ) -> None:
        if importlib.util.find_spec("openai") is None:
            raise ConfigError("agent tasks need the openai SDK: pip install '.[agents]'")
        if not callable(getattr(problems, "source", None)):
            raise TypeError("problems must have a source(seed, state) method (e.g. a Task)")
        self.agent = agent
        self.problems = problems
        self.name: str = name or str(getattr(agent, "__name__", "agent"))
        self.timeout = timeout
        self.parser = parser
        self.endpoint_limits = limits
        if local_model is not None:
            self.local_model = local_model
        self._chat: tuple[TaskContext, ChatFormat] | None = None

    def source(self, seed: int, state: Mapping[str, Any] | None = None) -> ProblemSource:
        return self.problems.source(seed, state)  # type: ignore[no-any-return]

    def eval_problems(self) -> list[Problem]:
        own = getattr(self.problems, "eval_problems", None)
        return list(own()) if callable(own) else []

    def group_builder(self, problem: Problem, group_size: int, context: EnvContext) -> AgentGroup:
        return AgentGroup(self, problem, group_size, stop_at_eos(context))

    @property
    def worker_payload(self) -> AgentFunction:
        """What ``--score-workers`` sends to its workers (must pickle): the agent."""
        return self.agent

    def own_workers(self, spec: ScoreWorkers) -> Workers | None:
        """Where ``--score-workers`` runs the agents: processes that each run many
        agents at once (:class:`~engine.agents.workers.AgentWorkers`), Ray tasks, or
        this event loop (threads, the default)."""
        if spec.kind == "processes":
            return AgentWorkers(spec.count)
        if spec.kind == "ray":
            from engine.envs.ray_workers import RayWorkers

            return RayWorkers(spec.count)
        return None

    def chat_format(self, task: TaskContext) -> ChatFormat:
        """The chat format of ``task`` (built once per context: it renders a probe)."""
        if self._chat is None or self._chat[0] is not task:
            self._chat = (task, ChatFormat(task, self.parser))
        return self._chat[1]


class AgentGroup:
    """One group of agent episodes: an endpoint and the agents, held from the group's
    start to its end (an async context manager, entered by the episode runner)."""

    def __init__(
        self, task: AgentTask, problem: Problem, group_size: int, context: EnvContext
    ) -> None:
        self._task = task
        self._problem = problem
        self._context = context
        chat = task.chat_format(context.task)
        token = secrets.token_hex(4)
        self.episodes = [Episode(f"{token}-{i}", chat, context) for i in range(group_size)]
        # A key per episode: an agent cannot call its siblings' episodes (their URLs
        # differ only in the index).
        self._keys = {e.id: "sk-engine-" + secrets.token_hex(16) for e in self.episodes}
        self._stack = contextlib.AsyncExitStack()
        self._workers: Workers | None = None
        self.endpoint: Endpoint | None = None

    def on_workers(self, workers: Workers) -> AgentGroup:
        """This group with its agents run on ``workers`` (its endpoint stays here)."""
        self._workers = workers
        return self

    async def __aenter__(self) -> AgentGroup:
        stack = self._stack
        try:
            backend = _GroupBackend({e.id: e for e in self.episodes}, self._keys)
            endpoint = await stack.enter_async_context(
                serve_endpoint(backend, limits=self._task.endpoint_limits)
            )
            self.endpoint = endpoint
            timeout = self._timeout()
            http = None if self._workers is not None else _in_process_client(endpoint, timeout)
            if http is not None:
                stack.push_async_callback(_shielded, http.aclose)
            tg: TaskGroup = await stack.enter_async_context(anyio.create_task_group())
            stack.callback(tg.cancel_scope.cancel)  # the agents do not outlive the group
            stack.callback(self._close_episodes)
            if self._workers is not None:
                urls = tuple(endpoint.episode_url(e.id) for e in self.episodes)
                agent, problem = self._task.agent, self._problem
                keys = tuple(self._keys[e.id] for e in self.episodes)
                runs = AgentRuns(agent, problem, urls, keys, timeout, endpoint.base_url)
                if isinstance(self._workers, AgentWorkers):
                    stack.enter_context(self._workers.route(endpoint.base_url, endpoint.dispatch))
                tg.start_soon(self._run_on_workers, self._workers, runs)
            else:
                import openai

                for episode in self.episodes:
                    client = openai.AsyncOpenAI(
                        base_url=endpoint.episode_url(episode.id),
                        api_key=self._keys[episode.id],
                        http_client=http,
                    )
                    tg.start_soon(self._run_agent, episode, client, timeout)
        except BaseException:
            await stack.aclose()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        # Not under a shield of ours: the agents' task group was entered before any such
        # scope, and anyio scopes must nest; each resource shields its own shutdown.
        await self._stack.aclose()

    async def make_envs(self) -> Sequence[Env]:
        if self.endpoint is None:
            raise EngineError(
                "an agent group runs its agents while it is entered (async with); to run "
                "them on workers, place the group there with on_workers(workers)"
            )
        return [e.env for e in self.episodes]

    async def compute_group_rewards(
        self, trajectories: Sequence[Trajectory], envs: Sequence[Env]
    ) -> Sequence[RewardBreakdown]:
        return [RewardBreakdown(0.0)] * len(trajectories)  # the agents' rewards are per turn

    async def cleanup(self) -> None:
        self._close_episodes()

    def _close_episodes(self) -> None:
        for episode in self.episodes:
            episode.close("the runner ended the episode")

    def _timeout(self) -> float:
        timeout = self._task.timeout
        if timeout is None:
            timeout = self._context.limits.episode_timeout
        return math.inf if timeout is None else timeout

    async def _run_agent(self, episode: Episode, client: Any, limit_s: float) -> None:
        """One agent run; whatever it does ends as a result or an error of its episode."""
        await episode.finish(*await run_agent(self._task.agent, client, self._problem, limit_s))

    async def _run_on_workers(self, workers: Workers, runs: AgentRuns) -> None:
        """The group's agents on ``workers``; a failed call (a worker died, the agent
        cannot be unpickled there) is every episode's error."""
        try:
            _, outcomes = await workers.call(runs, "run")
        except Exception as exc:
            error = f"its worker failed: {type(exc).__name__}: {exc}"
            outcomes = [(None, error, {})] * len(self.episodes)
        for episode, outcome in zip(self.episodes, outcomes, strict=True):
            await episode.finish(*outcome)


@dataclass(frozen=True)
class AgentRuns:
    """A group's agent runs as a worker runs them (pickled there; the agent function by
    reference): each agent with an ``openai.AsyncOpenAI`` on its episode's base URL."""

    agent: AgentFunction
    problem: Problem
    urls: tuple[str, ...]
    keys: tuple[str, ...]
    """Each episode's key (as ``urls``)."""
    timeout: float
    route: str
    """The endpoint's base URL: what an agent worker process's pipe names it by."""

    async def run(self) -> list[AgentOutcome]:
        import openai

        from engine.agents.transport import DispatchTransport
        from engine.agents.workers import worker_dispatch

        dispatch = worker_dispatch(self.route)  # None: over loopback HTTP (Ray, a pool)
        transport = DispatchTransport(dispatch) if dispatch is not None else None
        outcomes: list[AgentOutcome] = [(None, "not run", {})] * len(self.urls)
        limit = None if math.isinf(self.timeout) else self.timeout
        async with openai.DefaultAsyncHttpxClient(timeout=limit, transport=transport) as http:

            async def one(i: int, url: str) -> None:
                client = openai.AsyncOpenAI(base_url=url, api_key=self.keys[i], http_client=http)
                outcomes[i] = await run_agent(self.agent, client, self.problem, self.timeout)

            async with anyio.create_task_group() as tg:
                for i, url in enumerate(self.urls):
                    tg.start_soon(one, i, url)
        return outcomes


async def run_agent(
    agent: AgentFunction, client: Any, problem: Problem, limit_s: float
) -> AgentOutcome:
    """One agent run: its result, or how it failed (a raise, a timeout, a bad return)
    with the logs its error keeps (an agent process's output)."""
    try:
        with anyio.fail_after(limit_s):
            value = await agent(client, problem)
        return _result(value), None, {}
    except TimeoutError:
        return None, f"it ran past its timeout of {limit_s:g} s", {}
    except EngineError as exc:  # the engine's own reason (a bad reward, an agent process)
        return None, str(exc) or type(exc).__name__, getattr(exc, "logs", {})
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__, {}


def _in_process_client(endpoint: Endpoint, timeout: float) -> Any:
    """The HTTP client of a group's agents on this event loop: its requests go straight
    to the endpoint's dispatch (no socket, no HTTP parsing, no ASGI stack: docs/agents.md)."""
    import openai

    from engine.agents.transport import DispatchTransport

    return openai.DefaultAsyncHttpxClient(
        transport=DispatchTransport(endpoint.dispatch),
        timeout=None if math.isinf(timeout) else timeout,
    )


class _GroupBackend:
    """A group's callers: its episodes, by the path's episode id, each for its own key."""

    model = SERVED_MODEL

    def __init__(self, episodes: Mapping[str, Episode], keys: Mapping[str, str]) -> None:
        self._episodes = episodes
        self._keys = {episode: key.encode() for episode, key in keys.items()}

    def caller(self, episode: str | None, api_key: str | None) -> Episode:
        given = (api_key or "").encode()
        if not any(hmac.compare_digest(given, key) for key in self._keys.values()):
            raise EndpointError(401, "invalid API key: use the key the agent was given")
        if episode is None:
            raise EndpointError(
                404, "no episode in the path: use the base URL the agent was given (/e/ID/v1)"
            )
        found, key = self._episodes.get(episode), self._keys.get(episode)
        if found is None or key is None:
            raise EndpointError(404, f"unknown episode {episode!r}")
        if not hmac.compare_digest(given, key):
            raise EndpointError(
                401,
                f"this key is not episode {episode!r}'s: use the base URL and key the "
                "agent was given",
            )
        return found


async def _shielded(close: Callable[[], Awaitable[None]]) -> None:
    with anyio.move_on_after(5, shield=True):
        await close()


def _result(value: object) -> AgentResult:
    """What an agent returned, its reward checked as a task's is (finite: a NaN reward
    never reaches the advantages)."""
    if isinstance(value, AgentResult):
        check_reward(value.reward, "the agent")
        return value
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"the agent returned {type(value).__name__}, not a float or AgentResult")
    return AgentResult(check_reward(value, "the agent").total)
