"""An inspect-ai task for a checkpoint served by ``python -m engine.serve``: ``a + b``
questions as the arithmetic task asks them, scored by inspect's numeric match of the
reply's first number (what the engine's ``exact_bonus`` rewards).

It imports nothing of the engine, so it runs in an environment of its own with
``inspect-ai`` and ``openai`` (docs/export-and-eval.md, "inspect-ai"); inspect's
OpenAI-compatible provider ``openai-api/<name>/<model>`` sends the temperature as asked::

    python -m engine.serve runs/RUN --port 8765 &
    SERVED_API_KEY=unused inspect eval examples/inspect_arithmetic.py \\
        --model openai-api/served/policy --model-base-url http://127.0.0.1:8765/v1

``-T size=N -T seed=S``: N random questions (operands 10..99); ``-T problems=FILE``: the
held-out questions of an ``engine.eval`` JSON result instead (its ``problems``).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from inspect_ai import Task, task
from inspect_ai.dataset import Sample
from inspect_ai.model import GenerateConfig
from inspect_ai.scorer import match
from inspect_ai.solver import generate


@task
def arithmetic(size: int = 16, seed: int = 7, problems: str | None = None) -> Task:
    """Greedy replies to ``What is A + B?`` (the served chat template turns it into the
    packaged model's ``Question: ...\\nAnswer:`` prompt), scored against the sum."""
    if problems is not None:
        records = json.loads(Path(problems).read_text(encoding="utf-8"))["problems"]
        questions = [(r["question"], str(r["answer"])) for r in records]
    else:
        rng = random.Random(seed)
        pairs = [(rng.randint(10, 99), rng.randint(10, 99)) for _ in range(size)]
        questions = [(f"What is {a} + {b}?", str(a + b)) for a, b in pairs]
    return Task(
        dataset=[Sample(input=q, target=answer) for q, answer in questions],
        solver=generate(),
        scorer=match(location="begin", numeric=True),
        config=GenerateConfig(temperature=0.0),
    )
