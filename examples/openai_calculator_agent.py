"""A tool-calling agent written only against the ``openai`` SDK, trained unmodified.

``solve`` is an ordinary agent loop: it offers a ``multiply`` tool, runs the calls the
model makes and returns the model's final answer. Nothing in it knows about the engine:
pointed at any OpenAI-compatible endpoint it just runs. To train it, the engine gives
it a client whose base URL is the capturing endpoint (every call becomes a turn of an
episode) and the reward is whether the answer is the product::

    python -m engine.run --local --task examples.openai_calculator_agent:task --steps 20

(the local server loads the packaged agent model, which knows the tool format; see
docs/agents.md). Run it as a plain script against an endpoint of your own::

    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 python examples/openai_calculator_agent.py 12 34
"""

from __future__ import annotations

import json
import sys
from typing import Any

import openai
from openai.types.chat import ChatCompletionFunctionToolParam

from engine.agents import AgentTask
from engine.basemodels.catalogue import AGENT_MODEL_DIR
from engine.tasks import ArithmeticTask

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


async def solve(client: openai.AsyncOpenAI, question: str, max_calls: int = 4) -> str:
    """Ask the model, run its tool calls, until it answers without one."""
    messages: list[Any] = [{"role": "user", "content": question}]
    for _ in range(max_calls):
        response = await client.chat.completions.create(
            model="policy", messages=messages, tools=[MULTIPLY], max_tokens=96
        )
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return (message.content or "").strip()
        for call in message.tool_calls:
            if call.type != "function":
                continue
            try:
                args = json.loads(call.function.arguments)
                result = str(int(args["a"]) * int(args["b"]))
            except (ValueError, KeyError, TypeError) as exc:
                result = f"error: {exc}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return ""


async def episode(client: openai.AsyncOpenAI, problem: Any) -> float:
    """One training episode: 1 for the exact product, else 0."""
    return float(await solve(client, problem.question) == str(problem.answer))


def task(**args: str) -> AgentTask:
    """The training task (``--task examples.openai_calculator_agent:task``): two-digit
    products (``--task-arg`` values go to the arithmetic task: ``min_operand``...)."""
    settings = {"op": "*", "min_operand": "10", "max_operand": "99", "eval_size": "64", **args}
    problems = ArithmeticTask.from_args(settings)
    return AgentTask(episode, problems, name="openai-calculator")


task.local_model = AGENT_MODEL_DIR  # type: ignore[attr-defined]  # read before the task is built


if __name__ == "__main__":
    import asyncio

    a, b = (int(x) for x in sys.argv[1:3])

    async def main() -> None:
        async with openai.AsyncOpenAI() as client:
            print(await solve(client, f"What is {a} * {b}?"))

    asyncio.run(main())
