"""The judge reward below the network: an OpenAI-compatible endpoint answered in process
by httpx.MockTransport (concurrency, cache, retries, cost metrics, parsing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import httpx
import pytest

from engine.errors import PermanentServiceError
from engine.session.retry import RetryPolicy
from engine.tasks import Problem
from engine.tasks.arithmetic import ArithmeticTask
from engine.tasks.judge import Judge, JudgedTask, OpenAIJudgeModel

NO_WAIT = RetryPolicy(max_attempts=3, initial_wait=0.0, jitter=0.0, max_wait=0.0)


class Endpoint:
    """Scores a response by its length (SCORE: len), fails the first ``fail_first``
    requests with ``fail_status``; records the peak of requests in flight."""

    def __init__(self, fail_first: int = 0, fail_status: int = 503) -> None:
        self.requests: list[dict[str, Any]] = []
        self.fail_first = fail_first
        self.fail_status = fail_status
        self.in_flight = 0
        self.peak = 0

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.requests.append(body)
        if len(self.requests) <= self.fail_first:
            return httpx.Response(self.fail_status, json={"error": "busy"})
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        await anyio.lowlevel.checkpoint()  # let the other requests in
        await anyio.lowlevel.checkpoint()
        self.in_flight -= 1
        prompt = body["messages"][0]["content"]
        response = prompt.split("Response to grade:\n", 1)[1].split("\n", 1)[0]
        reply = "no idea" if response == "???" else f"Fine.\nSCORE: {len(response)}"
        return httpx.Response(
            200,
            json={
                "choices": [{"message": {"content": reply}}],
                "usage": {"prompt_tokens": 10, "completion_tokens": 3},
            },
        )


def judge_of(endpoint: Endpoint, **kw: Any) -> Judge:
    model = OpenAIJudgeModel(
        "http://judge.test/v1", "grader", api_key="sk-test", transport=httpx.MockTransport(endpoint)
    )
    return Judge(model, policy=NO_WAIT, **kw)


def test_scores_concurrently_caches_pairs_and_counts_the_cost() -> None:
    endpoint = Endpoint()
    judge = judge_of(endpoint, concurrency=3)
    responses = ["a" * n for n in range(1, 9)] + ["aaa", "aaa", "a" * 20, "???"]
    scores: list[float] = [0.0] * len(responses)

    async def go() -> None:
        async def one(i: int) -> None:
            scores[i] = await judge.score("2+2?", responses[i], "4")

        async with anyio.create_task_group() as tg:
            for i in range(len(responses)):
                tg.start_soon(one, i)

    anyio.run(go)
    assert scores[:8] == pytest.approx([n / 10 for n in range(1, 9)])
    assert scores[8:] == [0.3, 0.3, 1.0, 0.0]  # cached, cached, clipped to 10, unparsed
    assert len(endpoint.requests) == 10 and 1 < endpoint.peak <= 3
    assert endpoint.requests[0]["model"] == "grader" and endpoint.requests[0]["temperature"] == 0
    assert judge.metrics() == {
        "judge/calls": 10.0,
        "judge/cache_hits": 2.0,
        "judge/prompt_tokens": 100.0,
        "judge/completion_tokens": 30.0,
        "judge/unparsed": 1.0,
        "judge/retries": 0.0,
    }


def test_transient_failures_are_retried_and_client_errors_are_not() -> None:
    endpoint = Endpoint(fail_first=2, fail_status=503)
    judge = judge_of(endpoint)
    assert anyio.run(judge.score, "q", "abcde") == 0.5
    assert judge.metrics()["judge/retries"] == 2.0 and judge.metrics()["judge/calls"] == 1.0

    refused = judge_of(Endpoint(fail_first=5, fail_status=400))
    with pytest.raises(PermanentServiceError, match="judge failed"):
        anyio.run(refused.score, "q", "abcde")
    assert refused.metrics()["judge/retries"] == 0.0


def test_a_judged_task_scores_through_the_judge_and_reports_its_metrics() -> None:
    task = JudgedTask(ArithmeticTask(op="+"), judge_of(Endpoint()))
    problem = Problem(0, "12 + 30 =", 42)
    reward = anyio.run(task.score, "42", problem)
    assert reward.total == 0.2 and reward.components == {"judge": 0.2}
    assert task.name == "arithmetic-add-judged" and task.metrics()["judge/calls"] == 1.0


def test_the_judge_example_trains_against_the_local_server(tmp_path: Path) -> None:
    example = Path(__file__).resolve().parents[1] / "examples" / "judge_task.py"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MINT_", "TINKER_"))}
    proc = subprocess.run(
        [sys.executable, str(example), "--steps", "1"],
        env={**env, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    [record] = [json.loads(line) for line in next(tmp_path.glob("runs/*/metrics.jsonl")).open()]
    assert record["judge/calls"] + record["judge/cache_hits"] >= 16  # 4 groups of 4
    assert record["judge/unparsed"] == 0.0
