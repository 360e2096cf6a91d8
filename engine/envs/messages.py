"""The message-level layer: environments that speak chat messages, with tools.

A :class:`MessageEnv` gives the opening messages and answers the conversation after
each assistant reply (user feedback, a reward, the end). :class:`ChatEnv` adapts one to
the token-level :class:`~engine.envs.types.Env`: it renders the conversation with the
served chat template (with the tools' schemas), reads the model's reply back (decoded
from the exact sampled tokens, tool calls parsed in the template's format), runs the
tool calls itself, each under ``tool_timeout``, and asks the environment only when the
reply calls no tool::

    reply with tool calls  -> tool results appended, the episode goes on
                              (a tool whose result says ``done`` ends it)
    reply without          -> MessageEnv.respond(conversation): messages, reward, done

A tool that raises, times out or does not exist is a *tool error*: the model reads
``error: ...`` as that call's result and the episode goes on. A reply whose tool call
cannot be parsed follows ``on_parse_error`` (see :data:`~engine.envs.types.OnParseError`).
Each turn logs the assistant's text, its tool calls and their results (shown by
``python -m engine.rollouts``) and counts ``tool_calls``, ``tool_errors`` and
``parse_errors``.

The sampled tokens are never re-rendered for training: the next observation is the
whole conversation rendered anew, and the trainer merges it into the same datum only
when it extends the previous observation plus action (a template that rewrites history,
e.g. drops earlier reasoning, starts a new datum instead).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import anyio

from engine.core.problems import RewardBreakdown
from engine.core.trajectory import Action, Observation, StopCondition, Trajectory
from engine.envs.tools import HermesToolCalls, ParsedReply, Tool, ToolCall, ToolCallParser
from engine.envs.tools import tool_schema as _schema
from engine.envs.types import Env, EnvContext, EnvStepResult
from engine.tasks.render import ChatMessage

__all__ = ["ChatEnv", "ChatGroup", "MessageEnv", "MessageStep"]

PARSE_RETRY_PROMPT = (
    "Your tool call could not be read ({error}). Write each call as "
    '<tool_call>{{"name": ..., "arguments": {{...}}}}</tool_call>.'
)


@dataclass(frozen=True)
class MessageStep:
    """The environment's answer to a reply without tool calls: messages appended to the
    conversation (e.g. the user's next turn), this turn's reward, and whether the
    episode ends."""

    messages: Sequence[ChatMessage] = ()
    reward: float = 0.0
    done: bool = False
    metrics: Mapping[str, float] = field(default_factory=dict)


@runtime_checkable
class MessageEnv(Protocol):
    """One episode in chat messages."""

    async def initial_messages(self) -> Sequence[ChatMessage]:
        """The opening messages (system, user...)."""
        ...

    async def respond(self, messages: Sequence[ChatMessage]) -> MessageStep:
        """The conversation so far ends with the model's reply (an ``assistant``
        message); answer it."""
        ...


class ChatEnv:
    """A :class:`MessageEnv` (and its tools) as a token-level :class:`Env`."""

    def __init__(
        self,
        env: MessageEnv,
        context: EnvContext,
        *,
        tools: Sequence[Tool] = (),
        parser: ToolCallParser | None = None,
        stop: StopCondition | None = None,
    ) -> None:
        self.env = env
        self._context = context
        self._tools = {t.name: t for t in tools}
        self._schemas = [_schema(t) for t in tools]
        self._parser = parser or HermesToolCalls()
        self._stop = stop or context.stop
        self.messages: list[ChatMessage] = []

    async def initial_observation(self) -> Observation:
        self.messages = [dict(m) for m in await self.env.initial_messages()]
        return self._observe()

    async def step(self, action: Action) -> EnvStepResult:
        text = self._decode(action.tokens)
        parsed = self._parser.parse(text) if self._tools else ParsedReply(text.strip())
        logs: dict[str, Any] = {"assistant": text}
        if parsed.error is not None:
            logs["parse_error"] = parsed.error
            metrics = {"parse_errors": 1.0}
            if self._context.limits.on_parse_error != "retry":
                return EnvStepResult(done=True, metrics=metrics, logs=logs, outcome="parse_error")
            feedback = {"role": "user", "content": PARSE_RETRY_PROMPT.format(error=parsed.error)}
            self.messages += [{"role": "assistant", "content": text}, feedback]
            logs["messages"] = [feedback]
            return EnvStepResult(next_observation=self._observe(), metrics=metrics, logs=logs)
        self.messages.append(parsed.assistant_message())
        if parsed.tool_calls:
            return await self._run_tools(parsed.tool_calls, logs)
        answer = await self.env.respond(list(self.messages))
        self.messages.extend(dict(m) for m in answer.messages)
        if answer.messages:
            logs["messages"] = [dict(m) for m in answer.messages]
        return EnvStepResult(
            reward=answer.reward,
            done=answer.done,
            next_observation=None if answer.done else self._observe(),
            metrics=answer.metrics,
            logs=logs,
        )

    async def _run_tools(self, calls: Sequence[ToolCall], logs: dict[str, Any]) -> EnvStepResult:
        reward, done, errors = 0.0, False, 0
        results: list[dict[str, Any]] = []
        for call in calls:
            messages, error, call_done, call_reward = await self._call(call)
            self.messages.extend(messages)
            reward += call_reward
            done = done or call_done
            errors += error is not None
            results.append(
                {
                    "name": call.name,
                    "arguments": dict(call.arguments),
                    "result": [m.get("content") for m in messages],
                    "error": error,
                }
            )
        logs["tool_calls"] = results
        metrics = {"tool_calls": float(len(calls)), "tool_errors": float(errors)}
        return EnvStepResult(
            reward=reward,
            done=done,
            next_observation=None if done else self._observe(),
            metrics=metrics,
            logs=logs,
        )

    async def _call(self, call: ToolCall) -> tuple[list[ChatMessage], str | None, bool, float]:
        """The call's messages, its error (None if it worked), whether it ends the
        episode, and its reward."""
        tool = self._tools.get(call.name)
        error: str
        if tool is None:
            error = f"unknown tool {call.name!r} (tools: {', '.join(sorted(self._tools))})"
        else:
            timeout = self._context.limits.tool_timeout
            try:
                with anyio.fail_after(timeout):
                    result = await tool.call(call.arguments)
                return [dict(m) for m in result.messages], None, result.done, result.reward
            except TimeoutError:
                error = f"tool {call.name!r} timed out after {timeout} s"
            except anyio.get_cancelled_exc_class():
                raise
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        message = {"role": "tool", "name": call.name, "content": f"error: {error}"}
        return [message], error, False, 0.0

    def _observe(self) -> Observation:
        return Observation(tuple(self._context.render(self.messages, self._schemas)), self._stop)

    def _decode(self, tokens: Sequence[int]) -> str:
        """The reply as text, as a reward reads it (the sampler may return its stop)."""
        stop = self._stop
        return self._context.task.response_text(tokens, stop.stop_strings, stop.stop_token_ids)


@dataclass
class ChatGroup:
    """An :class:`~engine.envs.types.EnvGroupBuilder` of independent chat episodes,
    one :class:`ChatEnv` per message environment. Group rewards are zero (the per-turn
    rewards say it all); subclass and override :meth:`compute_group_rewards` for a
    judge or a ranking. Message environments with an ``aclose()`` are closed in
    :meth:`cleanup`."""

    envs: Sequence[MessageEnv]
    context: EnvContext
    tools: Sequence[Tool] = ()
    parser: ToolCallParser | None = None

    async def make_envs(self) -> Sequence[Env]:
        return [
            ChatEnv(env, self.context, tools=self.tools, parser=self.parser) for env in self.envs
        ]

    async def compute_group_rewards(
        self, trajectories: Sequence[Trajectory], envs: Sequence[Env]
    ) -> Sequence[RewardBreakdown]:
        return [RewardBreakdown(0.0)] * len(trajectories)

    async def cleanup(self) -> None:
        for env in self.envs:
            close = getattr(env, "aclose", None)
            if callable(close):
                await close()
