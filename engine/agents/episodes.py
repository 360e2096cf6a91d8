"""Agent episodes as environments: each HTTP call of an agent is one turn sampled by the
engine's own runner.

Control is inverted through bounded memory streams. The agent's call (an HTTP request
handled by :meth:`Episode.chat`) renders its prompt and hands it to the episode's
:class:`AgentEnv` as the next observation, then waits for the answer;
:meth:`AgentEnv.initial_observation` waits for the first call, and
:meth:`AgentEnv.step` answers the pending call with the action the runner sampled (the
runner records its tokens, logprobs and version in the turn) and waits for the agent's
next call (the next observation) or its end (``done``, with the agent's reward). So every
limit, policy and the datum building of environments hold for agents unchanged.

An episode takes one call at a time (a second concurrent call is a 429); a call after
the episode ended (the agent finished, or the runner ended it at a limit) is a 409.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectSendStream

from engine.agents.chat import Answer, ChatFormat, Choice, Conversation
from engine.agents.openai_wire import ChatRequest, CompletionRequest, EndpointError
from engine.envs import Action, EnvContext, EnvStepResult, Observation, StopCondition
from engine.envs.tools import ToolCall
from engine.errors import EngineError

__all__ = ["AgentEnv", "AgentError", "AgentOutcome", "AgentResult", "Episode"]


@dataclass(frozen=True)
class AgentResult:
    """What an agent returns: its reward, and numbers averaged into the step's
    ``env/all/<name>`` metrics."""

    reward: float
    metrics: Mapping[str, float] = field(default_factory=dict)


class AgentError(EngineError):
    """The agent raised, timed out or ended before its first call; ``logs``: what its
    episode keeps with its last turn (an agent process's last output lines)."""

    def __init__(self, message: str, logs: Mapping[str, Any] | None = None) -> None:
        super().__init__(message)
        self.logs: Mapping[str, Any] = dict(logs or {})


AgentOutcome = tuple[AgentResult | None, str | None, Mapping[str, Any]]
"""How an agent run ended: its result, or how it failed and the logs its episode keeps."""


@dataclass(frozen=True)
class _Pending:
    observation: Observation
    answer: MemoryObjectSendStream[Choice]
    tools: bool
    logs: Mapping[str, Any]
    metrics: Mapping[str, float]


@dataclass(frozen=True)
class _Ended:
    result: AgentResult | None
    error: str | None = None
    logs: Mapping[str, Any] = field(default_factory=dict)


class Episode:
    """One episode's calls: the agent's side (:meth:`chat`, :meth:`complete`,
    :meth:`finish`) and its environment's (:attr:`env`)."""

    def __init__(self, episode_id: str, chat: ChatFormat, context: EnvContext) -> None:
        self.id = episode_id
        self._chat = chat
        self._stop = context.stop
        self._on_parse_error = context.limits.on_parse_error
        self._conversation = Conversation(chat)
        self._events_send, self._events_recv = anyio.create_memory_object_stream[_Pending | _Ended](
            1
        )
        self._busy = False
        self._in_flight: _Pending | None = None
        self.ended: str | None = None
        """Why the episode ended (None while it runs)."""
        self.env = AgentEnv(self)

    # -- the agent's side ------------------------------------------------------------

    async def chat(self, request: ChatRequest) -> Answer:
        _refuse_in_training(request.n, bool(request.logprobs), request.top_p)
        if isinstance(request.tool_choice, dict) or request.tool_choice == "required":
            raise EndpointError(
                400,
                "tool_choice must be 'auto' or 'none': the sampler cannot force a call",
                param="tool_choice",
            )
        tools = self._chat.tools(request.tools) if request.tool_choice != "none" else []
        messages = self._chat.messages(request.messages)
        with self._call():
            # Off the event loop: a long prompt takes seconds to render and tokenize.
            prompt, rewrote = await anyio.to_thread.run_sync(
                self._conversation.prompt, messages, tools
            )
            logs: dict[str, Any] = {"messages": _new_messages(messages)}
            stop = self._stop_of(request.stop_strings(), request.token_limit())
            reply = await self._hand_over(
                Observation(prompt, stop),
                bool(tools),
                logs,
                {"agent/history_rewrites": float(rewrote)},
            )
            self._conversation.record(messages, tools, prompt, reply)
            return Answer(len(prompt), (reply,))

    async def complete(self, request: CompletionRequest) -> Answer:
        _refuse_in_training(request.n, bool(request.logprobs), request.top_p)
        if request.echo:
            raise EndpointError(400, "echo is not supported", param="echo")
        prompt = await anyio.to_thread.run_sync(self._chat.prompt_tokens, request.prompt)
        with self._call():
            stop = self._stop_of(request.stop_strings(), request.max_tokens)
            reply = await self._hand_over(Observation(prompt, stop), False, {}, {})
            return Answer(len(prompt), (reply,))

    async def finish(
        self,
        result: AgentResult | None,
        error: str | None = None,
        logs: Mapping[str, Any] | None = None,
    ) -> None:
        """The agent ended (``error``: how it failed; ``logs``: kept with the last turn)."""
        if self.ended is None:
            self.ended = "the agent finished" if error is None else f"the agent failed: {error}"
        with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
            await self._events_send.send(_Ended(result, error, dict(logs or {})))

    def close(self, why: str) -> None:
        """End the episode (the runner is done with it): calls from now on are 409s."""
        if self.ended is None:
            self.ended = why
        self._events_send.close()
        self._events_recv.close()
        if self._in_flight is not None:  # its handler answers 409
            self._in_flight.answer.close()

    # -- the environment's side ------------------------------------------------------

    async def next_event(self) -> _Pending | _Ended:
        try:
            return await self._events_recv.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            return _Ended(None, self.ended or "the episode was closed")

    # -- helpers ---------------------------------------------------------------------

    def _call(self) -> _CallGuard:
        if self.ended is not None:
            raise EndpointError(409, f"episode {self.id} has ended ({self.ended})")
        if self._busy:
            raise EndpointError(429, f"episode {self.id} already has a call in flight")
        return _CallGuard(self)

    def _stop_of(self, strings: tuple[str, ...], limit: int | None) -> StopCondition:
        """The run's stop condition with the request's stop strings and token limit
        (stop strings are sent instead of stop tokens: the EOS text joins them)."""
        stop = self._stop
        if strings:
            eos = getattr(self._chat.tokenizer, "eos_token", None)
            eos_text = (eos,) if isinstance(eos, str) and stop.stop_token_ids else ()
            strings = (*strings, *stop.stop_strings, *eos_text)
        return StopCondition(
            stop_strings=strings or stop.stop_strings,
            stop_token_ids=stop.stop_token_ids,
            max_tokens=limit or stop.max_tokens,
        )

    async def _hand_over(
        self,
        observation: Observation,
        tools: bool,
        logs: Mapping[str, Any],
        metrics: Mapping[str, float],
    ) -> Choice:
        """Hand the call to the environment; the reply the runner sampled for it."""
        answer_send, answer_recv = anyio.create_memory_object_stream[Choice](1)
        with answer_recv:
            try:
                self._in_flight = _Pending(observation, answer_send, tools, logs, metrics)
                await self._events_send.send(self._in_flight)
                return await answer_recv.receive()
            except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
                raise EndpointError(
                    409, f"episode {self.id} has ended ({self.ended or 'closed'})"
                ) from None
            finally:
                self._in_flight = None


class _CallGuard:
    def __init__(self, episode: Episode) -> None:
        self._episode = episode

    def __enter__(self) -> None:
        self._episode._busy = True

    def __exit__(self, *_: object) -> None:
        self._episode._busy = False


class AgentEnv:
    """The :class:`~engine.envs.types.Env` of one agent episode."""

    def __init__(self, episode: Episode) -> None:
        self._episode = episode
        self._pending: _Pending | None = None

    async def initial_observation(self) -> Observation:
        event = await self._episode.next_event()
        if isinstance(event, _Ended):
            raise AgentError(
                f"episode {self._episode.id}: the agent ended before its first call"
                + (f" ({event.error})" if event.error else "")
            )
        self._pending = event
        return event.observation

    async def step(self, action: Action) -> EnvStepResult:
        pending, self._pending = self._pending, None
        if pending is None:
            raise EngineError("step without a pending call")
        parsed = self._episode._chat.choice(
            action.tokens,
            action.stop_reason,
            pending.observation.stop.stop_strings,
            tools=pending.tools,
        )
        with pending.answer, contextlib.suppress(anyio.BrokenResourceError):
            await pending.answer.send(parsed)  # (unless the call was abandoned)
        logs: dict[str, Any] = {}
        logs["assistant"] = parsed.text
        calls: dict[str, float] = {"agent/tool_offers": float(pending.tools)}
        if parsed.tool_calls:
            logs["tool_calls"] = _tool_calls(parsed.tool_calls, None)
            calls["tool_calls"] = float(len(parsed.tool_calls))  # (the agent runs them)
        if parsed.parse_error is not None:
            logs["parse_error"] = parsed.parse_error
            if self._episode._on_parse_error != "retry":
                self._episode.close(f"its tool call could not be read ({parsed.parse_error})")
                return EnvStepResult(
                    done=True,
                    logs=logs,
                    metrics={**calls, "parse_errors": 1.0},
                    outcome="parse_error",
                )
        event = await self._episode.next_event()
        if isinstance(event, _Ended):
            if event.result is None:
                error = event.error or "the agent ended without a result"
                raise AgentError(error, {**logs, **event.logs})
            metrics = {**calls, **event.result.metrics}
            return EnvStepResult(reward=event.result.reward, done=True, metrics=metrics, logs=logs)
        self._pending = event
        if parsed.tool_calls:
            logs["tool_calls"] = _tool_calls(parsed.tool_calls, event.logs)
        logs.update(event.logs)
        metrics = {**event.metrics, **calls}
        return EnvStepResult(next_observation=event.observation, metrics=metrics, logs=logs)


def _refuse_in_training(n: int, logprobs: bool, top_p: float | None) -> None:
    if n != 1:
        raise EndpointError(
            400,
            "n must be 1 in training: each call is one turn of one episode (the engine "
            "samples the group's episodes itself, --group)",
            param="n",
        )
    if logprobs:
        raise EndpointError(
            400,
            "logprobs are not returned in training: the engine records the sampled "
            "tokens' logprobs in the episode itself",
            param="logprobs",
        )
    if top_p is not None and top_p < 1.0:
        raise EndpointError(400, "top_p < 1 is not supported by the sampler", param="top_p")


def _tool_calls(calls: Sequence[ToolCall], added: Mapping[str, Any] | None) -> list[Any]:
    """A reply's tool calls as the rollouts show them, each with its ``result`` when the
    agent called again (``added``: that call's logs): the content of the tool messages
    it answered the call with, by ``tool_call_id`` (none: it did not answer it)."""
    if added is None:
        return [{"name": c.name, "arguments": dict(c.arguments)} for c in calls]
    answers: dict[str | None, list[Any]] = {}
    for message in added.get("messages", ()):
        if message.get("role") == "tool":
            answers.setdefault(message.get("tool_call_id"), []).append(message.get("content"))
    return [
        {"name": c.name, "arguments": dict(c.arguments), "result": answers.get(c.id, [])}
        for c in calls
    ]


def _new_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages after the last assistant message (what the agent added)."""
    last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=-1)
    return messages[last + 1 :]
