"""Shared pieces of the environment tests: a chat tokenizer over bytes, scripted
samplers and small environments. No server, no sleeps."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict

from engine.core.datums import Completion
from engine.core.problems import Problem, RewardBreakdown, SeededSource
from engine.envs import (
    Action,
    ChatGroup,
    EnvContext,
    EnvStepResult,
    MessageStep,
    Observation,
    StopCondition,
    tool,
)
from engine.envs.rollout import SampledAction
from engine.tasks.render import TaskContext


class ChatBytes:
    """Tokens are UTF-8 bytes; the chat template writes ``<role>content`` lines and
    appends ``<assistant>`` as the generation prompt. Its tool list is one line."""

    eos_token_id = None
    eos_token = None
    chat_template = "bytes"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    def decode(self, tokens: Sequence[int], skip_special_tokens: bool = False) -> str:
        return bytes(tokens).decode(errors="replace")

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        tokenize: bool = False,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **_: Any,
    ) -> str:
        head = f"<tools>{','.join(t['function']['name'] for t in tools)}\n" if tools else ""
        lines = []
        for m in messages:
            content = m.get("content") or ""
            for call in m.get("tool_calls", ()):
                content += "<tool_call>" + json.dumps(call["function"]) + "</tool_call>"
            lines.append(f"<{m['role']}>{content}\n")
        return head + "".join(lines) + ("<assistant>" if add_generation_prompt else "")


def chat_context(**limits: Any) -> EnvContext:
    from engine.envs import EpisodeLimits

    return EnvContext(TaskContext(ChatBytes()), StopCondition(("\n",)), EpisodeLimits(**limits))


def completion(text: str) -> Completion:
    tokens = tuple(text.encode())
    return Completion(tokens, (-0.25,) * len(tokens), "stop")


@dataclass
class ScriptedSampler:
    """Answers each request with the next scripted reply (cycling), at ``version``."""

    replies: Sequence[str]
    version: int = 0
    calls: list[tuple[Observation, int, int | None]] = field(default_factory=list)

    async def __call__(
        self, observation: Observation, n: int, room: int | None, *, episode: int, turn: int
    ) -> list[SampledAction]:
        self.calls.append((observation, n, room))
        out: list[SampledAction] = []
        for _ in range(n):
            text = self.replies[(len(self.calls) - 1 + len(out)) % len(self.replies)]
            out.append(SampledAction(completion(text), self.version))
        return out


@dataclass
class CountdownEnv:
    """Token-level: each action is appended with a ``|``; reward 1 per turn; done after
    ``turns`` actions. ``hang_at`` makes that step never return; ``raise_at`` raise."""

    turns: int = 3
    prompt: bytes = b"go:"
    hang_at: int | None = None
    raise_at: int | None = None
    break_prefix_at: int | None = None
    taken: int = 0
    context: list[int] = field(default_factory=list)

    async def initial_observation(self) -> Observation:
        self.context = list(self.prompt)
        return Observation(tuple(self.context))

    async def step(self, action: Action) -> EnvStepResult:
        import anyio

        self.taken += 1
        if self.hang_at == self.taken:
            await anyio.sleep_forever()
        if self.raise_at == self.taken:
            raise RuntimeError("the environment broke")
        if self.taken >= self.turns:
            return EnvStepResult(reward=1.0, done=True, metrics={"steps": 1.0})
        self.context += [*action.tokens, ord("|")]
        if self.break_prefix_at == self.taken:
            self.context = list(b"summary:")
        return EnvStepResult(reward=1.0, next_observation=Observation(tuple(self.context)))


@tool
def add(a: int, b: int) -> str:
    """Add two integers."""
    return str(a + b)


@tool
async def hang() -> str:
    """Never returns."""
    import anyio

    await anyio.sleep_forever()
    return ""


@tool
def block() -> str:
    """A plain function that never returns (its daemon thread is abandoned)."""
    import threading

    threading.Event().wait()
    return ""


@tool
def explode() -> str:
    """Always raises."""
    raise ValueError("kaboom")


@dataclass
class GuessEnv:
    """Asks for a number; answers 'higher'/'lower' until the reply equals ``target``."""

    target: int

    async def initial_messages(self) -> list[dict[str, Any]]:
        return [{"role": "user", "content": "guess"}]

    async def respond(self, messages: Sequence[Mapping[str, Any]]) -> MessageStep:
        reply = str(messages[-1]["content"]).strip()
        if reply == str(self.target):
            return MessageStep(reward=1.0, done=True)
        return MessageStep([{"role": "user", "content": "no"}])


class GuessTask:
    """An environment task: problem ``i`` hides the number ``i % 3``; episodes of
    ``GuessEnv`` with the ``add`` tool."""

    name = "guess"

    def source(self, seed: int, state: Mapping[str, Any] | None = None) -> SeededSource:
        return SeededSource(lambda rng, i: Problem(i, f"guess {i}", i % 3), seed, state)

    def group_builder(self, problem: Problem, group_size: int, context: EnvContext) -> ChatGroup:
        return ChatGroup([GuessEnv(problem.answer) for _ in range(group_size)], context, [add])


class RankedGroup:
    """A group hook: ranks the episodes by their action length (longest first gets 1)."""

    def __init__(self, envs: Sequence[Any]) -> None:
        self.envs = list(envs)
        self.cleaned = False

    async def make_envs(self) -> list[Any]:
        return self.envs

    async def compute_group_rewards(
        self, trajectories: Sequence[Any], envs: Sequence[Any]
    ) -> list[RewardBreakdown]:
        lengths = [t.action_tokens for t in trajectories]
        best = max(lengths)
        return [RewardBreakdown(float(n == best), {"best": float(n == best)}) for n in lengths]

    async def cleanup(self) -> None:
        self.cleaned = True


@dataclass
class PidEnv(CountdownEnv):
    """A :class:`CountdownEnv` whose steps log the process that ran them."""

    async def step(self, action: Action) -> EnvStepResult:
        import dataclasses
        import os

        result = await super().step(action)
        return dataclasses.replace(result, logs={"pid": os.getpid()})


class Faults(TypedDict, total=False):
    """The steps at which a :class:`CountdownEnv` hangs or raises."""

    hang_at: int
    raise_at: int


@dataclass
class RemoteTask:
    """Module level, so that worker processes and Ray workers can import it: problem
    ``i`` is a group of :class:`PidEnv` episodes of ``1 + i % 2`` turns (``env`` sets
    ``raise_at``/``hang_at``), ranked by :class:`RankedGroup`. ``held`` is carried in
    the task's state (a lock: the task cannot be pickled)."""

    name: str = "remote"
    env: Faults = field(default_factory=Faults)
    held: Any = None

    def source(self, seed: int, state: Mapping[str, Any] | None = None) -> SeededSource:
        return SeededSource(_remote_problem, seed, state)

    def group_builder(self, problem: Problem, group_size: int, context: EnvContext) -> Any:
        turns = 1 + problem.id % 2
        return RankedGroup([PidEnv(turns=turns, **self.env) for _ in range(group_size)])


def _remote_problem(rng: Any, index: int) -> Problem:
    return Problem(index, f"count {index}", index)
