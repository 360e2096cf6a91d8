"""A judge reward: a rubric prompt, answered by a model, read as a score.

The judge model is a MinT sampling client (:class:`MintJudgeModel`: hosted MinT, or the
local server) or any OpenAI-compatible chat endpoint (:class:`OpenAIJudgeModel`, over
httpx). :class:`Judge` sends at most ``concurrency`` requests at once, caches verdicts by
(prompt, response) (bounded, least recently used first out; a request already in flight
is awaited, not sent twice), retries transient failures with the project's policy
(:func:`engine.session.retry.call_with_retry`: a judge call is stateless, so safe to
repeat) and counts its cost: ``judge/calls``, ``judge/cache_hits``,
``judge/prompt_tokens``, ``judge/completion_tokens``, ``judge/unparsed`` (replies without
a score: reward 0) and ``judge/retries``, cumulative over the run, in every step's
metrics (:meth:`JudgedTask.metrics`). :class:`JudgedTask` puts a judge on any task, and
writes a sample of the judge's prompts and raw replies to the run directory's
``judge.jsonl`` (the first ``log_samples`` calls and up to ``log_samples`` more whose
reply held no score), so an ``unparsed`` count can be read, not guessed.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import anyio
import httpx

from engine.core.problems import Problem, ProblemSource, RewardBreakdown, Task
from engine.errors import ServiceError
from engine.session.retry import RetryCounter, RetryPolicy, call_with_retry
from engine.tasks.render import TaskContext

__all__ = [
    "DEFAULT_RUBRIC",
    "Judge",
    "JudgeModel",
    "JudgeReply",
    "JudgedTask",
    "MintJudgeModel",
    "OpenAIJudgeModel",
    "Verdict",
    "score_line",
]

DEFAULT_RUBRIC = (
    "You grade answers. Question:\n{prompt}\n\nReference answer: {answer}\n\n"
    "Response to grade:\n{response}\n\n"
    "How correct and helpful is the response, from 0 (wrong) to 10 (fully correct)? "
    "Reply with one line: SCORE: <number>"
)
"""The default rubric; ``{prompt}``, ``{response}`` and ``{answer}`` are filled in."""
SCORE_PATTERN = r"SCORE:\s*(-?\d+(?:\.\d+)?)"
Verdict = Callable[[str, str], float | None]
"""(judge's reply, judged response) -> reward in [0, 1], or None when the reply holds no
verdict (reward 0, counted in ``judge/unparsed``)."""
JUDGE_KIND = "judge"
"""The retry kind of judge calls (``retries/judge``)."""
JUDGE_LOG = "judge.jsonl"
"""The run directory's sample of the judge's prompts and replies."""
DEFAULT_LOG_SAMPLES = 32


@dataclass(frozen=True)
class JudgeReply:
    text: str
    prompt_tokens: int = 0
    completion_tokens: int = 0


class JudgeModel(Protocol):
    """Answers one rubric prompt; raises on failure (transient failures are retried)."""

    async def complete(self, prompt: str, *, max_tokens: int) -> JudgeReply: ...


class OpenAIJudgeModel:
    """An OpenAI-compatible ``/chat/completions`` endpoint (greedy). ``transport`` lets
    tests answer in process (``httpx.MockTransport``)."""

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str | None = None,
        timeout: float = 120.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(
            base_url=base_url.rstrip("/") + "/",
            headers=headers,
            timeout=timeout,
            transport=transport,
        )
        self._model = model

    async def complete(self, prompt: str, *, max_tokens: int) -> JudgeReply:
        response = await self._client.post(
            "chat/completions",
            json={
                "model": self._model,
                "messages": [{"role": "user", "content": prompt}],
                "temperature": 0,
                "max_tokens": max_tokens,
            },
        )
        if response.status_code == 429 or response.status_code >= 500:
            raise ServiceError(
                f"the judge endpoint answered {response.status_code}",
                kind=JUDGE_KIND,
                attempts=1,
                transient=True,
            )
        response.raise_for_status()
        body = response.json()
        usage = body.get("usage") or {}
        return JudgeReply(
            str(body["choices"][0]["message"]["content"] or ""),
            int(usage.get("prompt_tokens", 0)),
            int(usage.get("completion_tokens", 0)),
        )

    async def aclose(self) -> None:
        await self._client.aclose()


class MintJudgeModel:
    """A MinT (or local server) sampling client: the rubric goes through the tokenizer's
    chat template when it has one (``chat=False``: encoded as it is, as a task's string
    prompt is), and the reply is sampled greedily."""

    def __init__(self, sampling_client: Any, tokenizer: Any, *, chat: bool = True) -> None:
        self._client = sampling_client
        self._tokenizer = tokenizer
        self._chat = chat

    async def complete(self, prompt: str, *, max_tokens: int) -> JudgeReply:
        import mint
        from mint import types

        if self._chat and getattr(self._tokenizer, "chat_template", None):
            tokens = self._tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
            )
            tokens = list(tokens["input_ids"] if isinstance(tokens, Mapping) else tokens)
        else:
            tokens = list(self._tokenizer.encode(prompt))
        result = await self._client.sample_async(
            prompt=mint.ModelInput.from_ints(tokens),
            num_samples=1,
            sampling_params=types.SamplingParams(max_tokens=max_tokens, temperature=0.0),
        )
        out = list(result.sequences[0].tokens)
        text = str(self._tokenizer.decode(out, skip_special_tokens=True))
        return JudgeReply(text, len(tokens), len(out))


def score_line(scale: float = 10.0) -> Verdict:
    """The default verdict: the first number after ``SCORE:``, clipped to [0, ``scale``]
    and divided by it."""
    if scale <= 0:
        raise ValueError(f"scale must be positive, got {scale}")
    pattern = re.compile(SCORE_PATTERN)

    def verdict(reply: str, response: str) -> float | None:
        match = pattern.search(reply)
        if match is None:
            return None
        return min(max(float(match.group(1)), 0.0), scale) / scale

    return verdict


@dataclass
class _Usage:
    calls: int = 0
    cache_hits: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    unparsed: int = 0
    retries: RetryCounter = field(default_factory=RetryCounter)


class _SampleLog:
    """``judge.jsonl``: the first ``limit`` verdicts and up to ``limit`` more unparsed
    ones, one JSON line each (a resumed run counts what the file holds)."""

    def __init__(self, path: Path, limit: int) -> None:
        self._path = path
        self._limit = limit
        self._lock = anyio.Lock()
        lines = path.read_text(encoding="utf-8").splitlines() if path.is_file() else []
        self._first = min(len(lines), limit)
        self._unparsed = len(lines) - self._first

    async def add(self, prompt: str, reply: JudgeReply, value: float | None) -> None:
        if self._first < self._limit:
            self._first += 1
        elif value is None and self._unparsed < self._limit:
            self._unparsed += 1
        else:
            return
        record = {"prompt": prompt, "reply": reply.text, "score": value, "unparsed": value is None}
        line = json.dumps(record, ensure_ascii=False) + "\n"
        async with self._lock:
            await anyio.to_thread.run_sync(self._append, line)

    def _append(self, line: str) -> None:
        with self._path.open("a", encoding="utf-8") as f:
            f.write(line)


class Judge:
    """Scores (prompt, response) pairs with ``model`` and ``rubric``, reading each reply
    with ``verdict`` (default :func:`score_line`)."""

    def __init__(
        self,
        model: JudgeModel,
        rubric: str = DEFAULT_RUBRIC,
        *,
        verdict: Verdict | None = None,
        concurrency: int = 8,
        cache_size: int = 4096,
        max_tokens: int = 64,
        policy: RetryPolicy | None = None,
        log_samples: int = DEFAULT_LOG_SAMPLES,
    ) -> None:
        if concurrency < 1 or cache_size < 0 or max_tokens < 1 or log_samples < 0:
            raise ValueError(
                "concurrency and max_tokens must be positive, cache_size and log_samples >= 0"
            )
        self.model = model
        self._rubric = rubric
        self._verdict = verdict or score_line()
        self._limiter = anyio.CapacityLimiter(concurrency)
        self._cache: OrderedDict[tuple[str, str], float] = OrderedDict()
        self._cache_size = cache_size
        self._in_flight: dict[tuple[str, str], anyio.Event] = {}
        self._max_tokens = max_tokens
        self._policy = policy or RetryPolicy(max_attempts=4, attempt_timeout=300.0)
        self._usage = _Usage()
        self._log_samples = log_samples
        self._samples: _SampleLog | None = None

    def log_to(self, path: Path) -> None:
        """Write the sample of prompts and replies to ``path`` (see the module doc)."""
        self._samples = _SampleLog(path, self._log_samples) if self._log_samples else None

    def metrics(self) -> dict[str, float]:
        """The judge's cost so far (see the module doc)."""
        u = self._usage
        return {
            "judge/calls": float(u.calls),
            "judge/cache_hits": float(u.cache_hits),
            "judge/prompt_tokens": float(u.prompt_tokens),
            "judge/completion_tokens": float(u.completion_tokens),
            "judge/unparsed": float(u.unparsed),
            "judge/retries": float(u.retries.total(JUDGE_KIND)),
        }

    async def score(self, prompt: str, response: str, answer: Any = "") -> float:
        """The judge's score of ``response`` to ``prompt``, in [0, 1]."""
        key = (prompt, response)
        while True:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                self._usage.cache_hits += 1
                return cached
            pending = self._in_flight.get(key)
            if pending is None:
                break
            # The same pair is being judged: use its verdict, or (that call failed, or
            # the cache holds nothing) look again, so one waiter asks next, not all.
            await pending.wait()
        done = self._in_flight[key] = anyio.Event()
        try:
            value = await self._ask(prompt, response, answer)
            if self._cache_size:
                self._cache[key] = value
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
            return value
        finally:
            del self._in_flight[key]
            done.set()

    async def _ask(self, prompt: str, response: str, answer: Any) -> float:
        text = self._rubric.format(prompt=prompt, response=response, answer=answer)
        async with self._limiter:
            reply = await call_with_retry(
                lambda: self.model.complete(text, max_tokens=self._max_tokens),
                kind=JUDGE_KIND,
                policy=self._policy,
                counter=self._usage.retries,
                op="judge",
            )
        u = self._usage
        u.calls += 1
        u.prompt_tokens += reply.prompt_tokens
        u.completion_tokens += reply.completion_tokens
        value = self._verdict(reply.text, response)
        if self._samples is not None:
            await self._samples.add(text, reply, value)
        if value is None:
            u.unparsed += 1
            return 0.0
        return min(max(float(value), 0.0), 1.0)


class JudgedTask:
    """``task`` with its reward replaced by ``judge`` (one component, ``judge``); the
    prompt the judge sees is the task's prompt text (a chat prompt's last message)."""

    def __init__(self, task: Task, judge: Judge, name: str | None = None) -> None:
        self._task = task
        self.judge = judge
        self.name = name or f"{task.name}-judged"
        # what the prompt renderer reads of a task
        self.stop = getattr(task, "stop", ())
        self.skip_special_tokens = getattr(task, "skip_special_tokens", False)
        self.chat_template_options = getattr(task, "chat_template_options", {})

    def setup(self, context: TaskContext) -> None:
        """The task's own setup; the judge's sample goes to the run directory."""
        setup = getattr(self._task, "setup", None)
        if callable(setup):
            setup(context)
        bind = getattr(self.judge.model, "bind", None)
        if callable(bind):  # a judge that samples through the run's session
            bind(context)
        if context.run_dir is not None:
            self.judge.log_to(context.run_dir / JUDGE_LOG)

    def source(self, seed: int, state: Mapping[str, Any] | None = None) -> ProblemSource:
        return self._task.source(seed, state)

    def prompt(self, problem: Problem) -> str | Sequence[Mapping[str, Any]]:
        return self._task.prompt(problem)

    def eval_problems(self) -> list[Problem]:
        method = getattr(self._task, "eval_problems", None)
        return list(method()) if callable(method) else []

    def metrics(self) -> dict[str, float]:
        return self.judge.metrics()

    async def score(self, response: str, problem: Problem) -> RewardBreakdown:
        prompt = self._task.prompt(problem)
        text = prompt if isinstance(prompt, str) else str(prompt[-1].get("content", ""))
        value = await self.judge.score(text, response, problem.answer)
        return RewardBreakdown(value, {"judge": value})
