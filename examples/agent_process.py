"""An agent process: any program that talks to ``$OPENAI_BASE_URL`` with
``$OPENAI_API_KEY`` and ends its output with ``{"reward": R}``. The engine runs it once
per episode (``--task agent-cmd:COMMAND``), with the problem in the file
``$ENGINE_PROBLEM_FILE`` names (small ones are in ``$ENGINE_PROBLEM`` too)::

    python -m engine.run --local --task "agent-cmd:python examples/agent_process.py" \\
        --task-arg op=* --task-arg min_operand=10 --task-arg max_operand=99 --steps 20

This one is the calculator loop of examples/openai_calculator_agent.py, synchronous.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import openai

MULTIPLY: Any = {  # a program of its own: it shares nothing with the engine
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


def main() -> None:
    problem = json.loads(Path(os.environ["ENGINE_PROBLEM_FILE"]).read_text())
    client = openai.OpenAI()  # reads OPENAI_BASE_URL and OPENAI_API_KEY
    messages: list[Any] = [{"role": "user", "content": problem["question"]}]
    answer = ""
    for _ in range(4):
        response = client.chat.completions.create(
            model="policy", messages=messages, tools=[MULTIPLY], max_tokens=96
        )
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            answer = (message.content or "").strip()
            break
        for call in message.tool_calls:
            if call.type == "function":
                args = json.loads(call.function.arguments)
                product = str(int(args["a"]) * int(args["b"]))
                messages.append({"role": "tool", "tool_call_id": call.id, "content": product})
    print(json.dumps({"reward": float(answer == str(problem["answer"]))}))


if __name__ == "__main__":
    main()
