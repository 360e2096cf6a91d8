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

from engine.config import EngineConfig
from engine.errors import PermanentServiceError
from engine.session.retry import RetryPolicy
from engine.tasks import Problem
from engine.tasks.arithmetic import ArithmeticTask
from engine.tasks.judge import Judge, JudgedTask, JudgeReply, OpenAIJudgeModel

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


class FlakyModel:
    """Fails its first call (not retried), then answers SCORE: 7; counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    async def complete(self, prompt: str, *, max_tokens: int) -> JudgeReply:
        self.calls += 1
        await anyio.lowlevel.checkpoint()
        if self.calls == 1:
            raise ValueError("judge down")
        return JudgeReply("SCORE: 7")


def test_a_failed_call_on_a_shared_pair_is_asked_again_once() -> None:
    model = FlakyModel()
    judge = Judge(model, policy=NO_WAIT)
    outcomes: list[float | str] = []

    async def one() -> None:
        try:
            outcomes.append(await judge.score("q", "same response"))
        except PermanentServiceError:
            outcomes.append("failed")

    async def go() -> None:
        async with anyio.create_task_group() as tg:
            for _ in range(4):
                tg.start_soon(one)

    anyio.run(go)
    assert sorted(outcomes, key=str) == [0.7, 0.7, 0.7, "failed"]
    assert model.calls == 2  # the failed call, then one for the three that waited


URL, MODEL = "judge.url=http://judge.test/v1", "judge.model=grader"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            [MODEL],
            "invalid judge (judge:arithmetic): judge.url must be the judge's http(s) base URL",
        ),
        (
            [URL],
            "invalid judge (judge:arithmetic): judge.model is required: the judge's model name",
        ),
        (
            [URL, MODEL, "judge.concurrency=many"],
            "judge.concurrency must be an integer >= 1, got 'many'",
        ),
        (
            [URL, MODEL, "judge.verdict=vibes"],
            "judge.verdict must be score or same-number, got 'vibes'",
        ),
        ([URL, MODEL, "judge.rubric=Grade {reply}"], "judge.rubric may use {prompt}, {response}"),
        ([URL, MODEL, "judge.urll=http://x"], "unknown argument judge.urll (known: judge.url,"),
        ([URL, MODEL, "judge.chat=maybe"], "task argument judge.chat must be true or false"),
        ([URL, MODEL, "op=%"], "invalid arithmetic task: unknown operation '%'"),
        (
            [URL, MODEL, "judge.api=mint", "judge.api_key_env=ENGINE_TEST_NO_SUCH_KEY"],
            "judge.api=mint needs an API key in $ENGINE_TEST_NO_SUCH_KEY",
        ),
    ],
)
def test_bad_judge_arguments_are_one_line_and_exit_2(
    args: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    from engine.run import main

    monkeypatch.chdir(tmp_path)
    argv = ["--task", "judge:arithmetic"] + [f"--task-arg={a}" for a in args]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("Error: ") and message in err and err.count("\n") == 1
    assert not (tmp_path / "runs").exists()


def test_an_environment_to_judge_is_one_line_before_the_run(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A judge scores single-turn responses: an environment (its episodes reward
    themselves) under ``judge:`` is refused before a server starts, not an
    AttributeError once the run has begun."""
    from engine.run import main

    monkeypatch.chdir(tmp_path)
    assert main(["--task", "judge:guess-sum", "--task-arg=judge.api=local"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "Error: invalid task 'judge:guess-sum': a judge scores single-turn responses, and "
        "guess-sum is an environment whose episodes give their own rewards\n"
    )
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow  # ~40 s on a loaded 2-core machine
def test_a_judge_task_from_the_command_line_trains_against_the_local_server(
    tmp_path: Path,
) -> None:
    """The engine trains on its own local server (no MINT_API_KEY anywhere) while a
    second local server without a key judges; the judged task asks what the served
    model's recommendation says (a + b), and judge.jsonl shows what the judge read."""
    from engine.local import LocalServer
    from tests.reliability_support import run_cli

    with LocalServer() as server:
        judge = {
            "api": "mint",
            "url": server.base_url,
            "model": server.model_name,
            "verdict": "same-number",  # the packaged model answers the question itself
            "max_tokens": "8",
        }
        args = ["--task", "judge:arithmetic"]
        args += [f"--task-arg=judge.{k}={v}" for k, v in judge.items()]
        args += ["--steps", "1", "--batch", "2", "--group", "4", "--max-tokens", "8"]
        run = tmp_path / "run"
        done = run_cli([*args, "--run-dir", str(run), "--no-progress"], tmp_path)
    assert done.returncode == 0, done.stderr
    [record] = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    assert record["judge/calls"] >= 1
    assert record["judge/calls"] + record["judge/cache_hits"] == 8  # 2 groups of 4
    assert record["judge/unparsed"] == 0.0 and "env/all/judge" in record
    config = json.loads((run / "config.json").read_text())
    assert config["task"]["spec"] == "judge:arithmetic" and config["server"] == "local"
    assert config["task"]["args"]["judge.api"] == "mint"
    assert config["task"]["args"]["op"] == "+"  # the local server's recommendation
    samples = [json.loads(line) for line in (run / "judge.jsonl").open()]
    assert samples and all(" + " in s["prompt"] and s["reply"] for s in samples)


class RecordingSampler:
    """A sampling client that records the prompt tokens and answers ' 42'."""

    def __init__(self, tokenizer: Any) -> None:
        self.prompts: list[list[int]] = []
        self.answer = tokenizer.encode(" 42", add_special_tokens=False)

    async def sample_async(self, prompt: Any, **kw: Any) -> Any:
        from types import SimpleNamespace

        self.prompts.append(list(prompt.to_ints()))
        return SimpleNamespace(sequences=[SimpleNamespace(tokens=self.answer)])


@pytest.mark.parametrize("chat", [True, False])
def test_a_mint_judge_reads_the_prompt_through_the_chat_template_or_as_it_is(chat: bool) -> None:
    from transformers import AutoTokenizer

    from engine.local import DEFAULT_MODEL_DIR
    from engine.tasks.judge import MintJudgeModel

    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    assert tokenizer.chat_template  # the packaged model wraps a message in "Question: ..."
    sampler = RecordingSampler(tokenizer)
    prompt = "Question: What is 12 + 30?\nAnswer:"
    judge = MintJudgeModel(sampler, tokenizer, chat=chat)
    reply = anyio.run(lambda: judge.complete(prompt, max_tokens=8))
    assert reply.text.strip() == "42" and reply.completion_tokens == len(sampler.answer)
    [sent] = sampler.prompts
    assert tokenizer.decode(sent).count("Question:") == (2 if chat else 1)
    if not chat:
        assert sent == tokenizer.encode(prompt)  # as the task's own string prompt is sent


def test_a_judged_task_takes_the_servers_recommended_task_settings() -> None:
    """judge:arithmetic asks what plain arithmetic asks: the local server's a + b,
    10..99, not the hosted defaults (a * b, 10..199); --op is its flag too."""
    from engine.catalog import load_task
    from engine.session.preflight import local_server_profile

    local = local_server_profile(None)
    judge = {"judge.url": "http://127.0.0.1:9/v1", "judge.model": "m"}
    plain = EngineConfig(task="arithmetic").resolved(local).task.args
    judged = EngineConfig(task="judge:arithmetic", task_args=judge).resolved(local)
    assert plain == {"op": "+", "min_operand": "10", "max_operand": "99"}
    assert judged.task.args == {**plain, **judge}
    assert judged.unresolved == ()
    task = load_task(judged.task.spec, judged.task.args)
    problem = task.source(0).next()
    assert problem is not None and " + " in problem.question
    flagged = EngineConfig(task="judge:arithmetic", task_args=judge, op="-").resolved(local)
    assert flagged.task.args["op"] == "-"


def test_the_judges_prompts_and_raw_replies_land_in_the_run_dir(tmp_path: Path) -> None:
    """judge.jsonl holds the first log_samples verdicts and up to log_samples more
    unparsed ones (bounded however long the run, also across a resume), each with the
    prompt as sent and the reply as received."""
    from engine.tasks.render import TaskContext

    def judged() -> JudgedTask:
        task = JudgedTask(ArithmeticTask(op="+"), judge_of(Endpoint(), log_samples=2))
        task.setup(TaskContext(tokenizer=None, run_dir=tmp_path))
        return task

    task = judged()
    for i, response in enumerate(("1", "???", "22", "???", "???", "???")):
        anyio.run(task.score, response, Problem(i, f"{i} + 0 =", i))
    lines = [json.loads(line) for line in (tmp_path / "judge.jsonl").read_text().splitlines()]
    assert [(r["score"], r["unparsed"]) for r in lines] == [
        (0.1, False),
        (None, True),
        (None, True),
        (None, True),
    ]
    assert "Response to grade:\n???\n" in lines[1]["prompt"] and lines[1]["reply"] == "no idea"
    assert task.metrics()["judge/unparsed"] == 4.0
    resumed = judged()
    anyio.run(resumed.score, "???", Problem(9, "9 + 0 =", 9))
    assert len((tmp_path / "judge.jsonl").read_text().splitlines()) == 4


def test_a_judge_key_of_its_own_keeps_the_engine_on_the_local_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """MINT_API_KEY would send the training to that server: a judge reads
    ENGINE_JUDGE_API_KEY first, and a mint judge on a loopback URL needs no key."""
    from engine.catalog import load_task
    from engine.config import config_from_sources
    from engine.tasks.judge_task import LazyMintJudgeModel

    monkeypatch.delenv("MINT_API_KEY", raising=False)
    monkeypatch.delenv("ENGINE_JUDGE_API_KEY", raising=False)
    mint = {"judge.api": "mint", "judge.model": "m", "judge.url": "http://127.0.0.1:8000"}
    local = load_task("judge:arithmetic", mint)
    assert isinstance(local, JudgedTask)
    assert isinstance(local.judge.model, LazyMintJudgeModel)
    assert local.judge.model._api_key == "tml-engine-local"
    monkeypatch.setenv("ENGINE_JUDGE_API_KEY", "sk-judge")
    remote = load_task("judge:arithmetic", {**mint, "judge.url": "https://judge.example"})
    assert isinstance(remote, JudgedTask)
    assert isinstance(remote.judge.model, LazyMintJudgeModel)
    assert remote.judge.model._api_key == "sk-judge"
    assert config_from_sources({}, {"ENGINE_JUDGE_API_KEY": "sk-judge"}).session.local
