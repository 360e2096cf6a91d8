"""Shared pieces of the agent tests: a byte tokenizer in which each byte has a second
spelling (so a reply re-tokenized from its text is told apart from the sampled tokens),
a scripted sampler that answers in that spelling, and a tool-calling agent written only
against the ``openai`` SDK."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import openai
from env_support import ChatBytes
from openai.types.chat import ChatCompletionFunctionToolParam

from engine.core.datums import Completion
from engine.envs import EnvContext, EpisodeLimits, Observation, StopCondition
from engine.envs.rollout import SampledAction
from engine.tasks import Problem, TaskContext

ALT = 256
"""Token ``ALT + b`` decodes as byte ``b`` too; encoding never produces it."""


class TwoSpellings(ChatBytes):
    eos_token = "</s>"
    eos_token_id = 999

    def __len__(self) -> int:
        return 1000

    def decode(self, tokens: Sequence[int], skip_special_tokens: bool = False) -> str:
        out = bytearray()
        for t in tokens:
            if t == self.eos_token_id:
                out += b"</s>"
            else:
                out.append(t - ALT if t >= ALT else t)
        return out.decode(errors="replace")


def alt_tokens(text: str, eos: bool = True) -> tuple[int, ...]:
    return (*(ALT + b for b in text.encode()), *((TwoSpellings.eos_token_id,) if eos else ()))


def agent_context(**limits: Any) -> EnvContext:
    return EnvContext(TaskContext(TwoSpellings()), StopCondition(), EpisodeLimits(**limits))


def calculator_reply(observation: Observation) -> str:
    """The tool call until the tool's result is in the context, then the product."""
    return "42" if b"<tool>42" in bytes(t % ALT for t in observation.tokens if t < 512) else CALL


CALL = '<tool_call>{"name": "multiply", "arguments": {"a": 6, "b": 7}}</tool_call>'


@dataclass
class AltSampler:
    """Answers each request with the next scripted reply (or ``replies(observation)``),
    in the second spelling."""

    replies: Sequence[str] | Callable[[Observation], str]
    version: int = 0
    calls: list[Observation] = field(default_factory=list)

    async def __call__(
        self, observation: Observation, n: int, room: int | None, *, episode: int, turn: int
    ) -> list[SampledAction]:
        out = []
        for _ in range(n):
            self.calls.append(observation)
            if callable(self.replies):
                text = self.replies(observation)
            else:
                text = self.replies[(len(self.calls) - 1) % len(self.replies)]
            tokens = alt_tokens(text)
            out.append(
                SampledAction(Completion(tokens, (-0.5,) * len(tokens), "stop"), self.version)
            )
        return out


MULTIPLY: ChatCompletionFunctionToolParam = {
    "type": "function",
    "function": {
        "name": "multiply",
        "description": "Multiply two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


async def calculator_agent(client: openai.AsyncOpenAI, problem: Problem) -> float:
    """A tool-calling loop: call the model, run its tool calls, until it answers."""
    messages: list[Any] = [{"role": "user", "content": problem.question}]
    for _ in range(4):
        response = await client.chat.completions.create(
            model="policy", messages=messages, tools=[MULTIPLY], max_tokens=64
        )
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return float((message.content or "").strip() == str(problem.answer))
        for call in message.tool_calls:
            if call.type != "function":
                continue
            args = json.loads(call.function.arguments)
            messages.append(
                {"role": "tool", "tool_call_id": call.id, "content": str(args["a"] * args["b"])}
            )
    return 0.0
