"""Scoring: every response of every arrived group is rewarded concurrently, under a bound.

Why: a reward is user code of any speed -- a regex, a 0.1 s CPU-bound verifier, a 0.25 s
call to a judge model. Scoring one response after another makes a slow reward stall
every stage; scoring them all at once (``--score-concurrency`` at a time) costs about one
call per step. Where a reward runs depends on what it is:

* an ``async def`` reward runs on the event loop (a judge over HTTP);
* a plain function runs in a worker thread (``--score-workers threads``, the default; one
  thread per group, the groups concurrently: threads run Python one at a time anyway),
  or in a pool of worker processes (``--score-workers processes:N``, each response a
  call) when it is CPU-bound Python that threads cannot run in parallel; the task is
  then pickled once per call, so it must be picklable (checked before the run starts:
  one clear line otherwise).

A task may also reward a whole group at once with ``score_group(responses, problem)``
(rankings, pairwise judges); it then replaces ``score`` and returns one reward per
response, in order.

Whatever order calls finish in, a group's rewards are in response order, and the trainer
assembles datums in problem order, so results never depend on scoring order.

A reward that never returns must not keep the process alive: worker threads are daemon
threads that a stop abandons (they die with the process), worker processes are killed
on cancellation. A reward that raises anything -- even ``SystemExit`` or
``KeyboardInterrupt`` -- is a :class:`RewardError` for that group, never an exit.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import numbers
import os
import pickle
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import anyio
import anyio.to_process

from engine.common.extras import require
from engine.common.threads import in_daemon_thread
from engine.config.values import ScoreWorkers
from engine.core.problems import Problem, RewardBreakdown, Task
from engine.envs.types import EnvTask, is_env_task
from engine.errors import ConfigError, EngineError, classify, primary_error

__all__ = [
    "RewardError",
    "Scorer",
    "check_picklable",
    "check_reward",
    "check_rewards",
    "check_score_workers",
]

T = TypeVar("T")


class RewardError(EngineError):
    """The task's reward function raised (or returned garbage) for a problem."""

    def __init__(self, problem: Problem, cause: BaseException) -> None:
        if isinstance(cause, Exception) and not isinstance(cause, EngineError):
            detail = classify(cause).message
        else:
            detail = str(cause) or type(cause).__name__
        question = problem.question  # (its start: a huge one would push out the cause)
        quoted = repr(question if len(question) <= 80 else question[:80] + "...")
        super().__init__(f"the reward function failed on problem {problem.id} ({quoted}): {detail}")
        self.problem = problem
        self.trace: str = getattr(cause, _TRACE, None) or "".join(traceback.format_exception(cause))
        """The traceback of what the reward raised (from its worker, when it ran in one)."""


_TRACE = "_engine_reward_trace"
"""Where a worker keeps the formatted traceback on the exception it hands back (the
attribute pickles with the exception; the traceback object does not)."""


class _Raised(EngineError):
    """What a reward raised that is not an ``Exception`` (SystemExit, KeyboardInterrupt):
    reported like any other reward failure, never an exit."""

    def __init__(self, exc: BaseException) -> None:
        super().__init__(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)


class Scorer:
    """Rewards groups for one run: ``await scorer.score(problem, responses)``."""

    def __init__(self, task: Task, *, concurrency: int, workers: ScoreWorkers) -> None:
        self._task = task
        self._limiter = anyio.CapacityLimiter(concurrency)
        self._processes = (
            anyio.CapacityLimiter(workers.count) if workers.kind == "processes" else None
        )
        group_fn = getattr(task, "score_group", None)
        self._group_fn: Callable[..., Any] | None = group_fn if callable(group_fn) else None
        fn = self._group_fn or task.score
        self._is_async = inspect.iscoroutinefunction(fn)
        self._in_threads = not self._is_async and self._processes is None

    async def score(self, problem: Problem, responses: Sequence[str]) -> list[RewardBreakdown]:
        """The rewards of one group, in response order; raises RewardError."""
        try:
            if self._group_fn is not None:
                async with self._limiter:
                    raw = await self._call(self._group_fn, list(responses), problem)
                rewards = check_rewards(raw, len(responses), "task.score_group", "responses")
            elif self._in_threads:
                # One worker thread per group: threads run Python one at a time anyway,
                # and a thread per response costs more than a cheap reward itself.
                async with self._limiter:
                    raw = await self._call(_score_each, self._task.score, responses, problem)
                rewards = [check_reward(r) for r in raw]
            else:
                rewards = [RewardBreakdown(0.0)] * len(responses)
                async with anyio.create_task_group() as tg:
                    for i, response in enumerate(responses):
                        tg.start_soon(self._score_one, rewards, i, response, problem)
        except RewardError:
            raise
        except anyio.get_cancelled_exc_class():
            raise
        except BaseExceptionGroup as group:
            raise RewardError(problem, primary_error(group)) from None
        except BaseException as exc:
            raise RewardError(problem, exc) from None
        return rewards

    async def _score_one(
        self, out: list[RewardBreakdown], i: int, response: str, problem: Problem
    ) -> None:
        async with self._limiter:
            out[i] = check_reward(await self._call(self._task.score, response, problem))

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self._is_async:
            try:
                return await fn(*args)
            except (anyio.get_cancelled_exc_class(), Exception):
                raise
            except BaseException as exc:  # SystemExit, KeyboardInterrupt from user code
                raise _Raised(exc) from None
        if self._processes is not None:
            try:
                outcome = await anyio.to_process.run_sync(
                    _run_in_worker_process, fn, *args, cancellable=True, limiter=self._processes
                )
            except anyio.BrokenWorkerProcess:
                raise EngineError(
                    "its worker process died before it answered (the reward crashed the "
                    "process, called os._exit, or was killed: the worker's stderr above may "
                    "say more)"
                ) from None
        else:
            outcome = await in_daemon_thread(_run_guarded, fn, *args, name="engine-reward")
        value, error = outcome
        if error is not None:
            raise error
        return value


def check_reward(reward: Any, producer: str = "task.score") -> RewardBreakdown:
    """A reward (what ``producer`` returned) as a RewardBreakdown (a bare number is
    accepted) whose total and components are finite numbers, or a clear error (a reward
    error of the group; an agent's is its episode's error)."""
    if _is_number(reward):
        reward = RewardBreakdown(float(reward))
    if not isinstance(reward, RewardBreakdown):
        raise EngineError(
            f"{producer} must return a RewardBreakdown or a number, got {type(reward).__name__}"
        )
    if not _is_number(reward.total) or not math.isfinite(reward.total):
        raise EngineError(f"{producer} returned a non-finite or non-numeric total {reward.total!r}")
    if not isinstance(reward.components, Mapping):
        raise EngineError(
            f"{producer} returned components that are not a mapping of names to numbers "
            f"({type(reward.components).__name__})"
        )
    for name, value in reward.components.items():
        if not isinstance(name, str) or not _is_number(value) or not math.isfinite(value):
            raise EngineError(
                f"{producer} returned the component {name!r}: {value!r}; components must "
                "be finite numbers named by strings"
            )
    return RewardBreakdown(
        float(reward.total), {name: float(v) for name, v in reward.components.items()}
    )


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_rewards(raw: object, n: int, producer: str, items: str) -> list[RewardBreakdown]:
    """What a group-scoring hook (``producer``) returned for ``n`` ``items``, checked: a
    sequence of ``n`` rewards, each as :func:`check_reward` wants it (else EngineError)."""
    if isinstance(raw, str | bytes) or not isinstance(raw, Sequence):
        raise EngineError(f"{producer} must return a sequence of rewards, got {type(raw).__name__}")
    if len(raw) != n:
        raise EngineError(f"{producer} returned {len(raw)} rewards for {n} {items}")
    return [check_reward(r) for r in raw]


def _score_each(
    score: Callable[[str, Problem], Any], responses: Sequence[str], problem: Problem
) -> list[Any]:
    return [score(response, problem) for response in responses]


def _run_guarded(fn: Callable[..., Any], *args: Any) -> tuple[Any, BaseException | None]:
    """Run a reward in a worker; anything it raises comes back as a value (so that a
    SystemExit in a worker thread or process is a reward error, not an exit)."""
    try:
        return fn(*args), None
    except BaseException as exc:
        error = exc if isinstance(exc, Exception) else _Raised(exc)
        with contextlib.suppress(AttributeError):  # an exception type that refuses attributes
            setattr(error, _TRACE, "".join(traceback.format_exception(exc)))
        return None, error


def _run_in_worker_process(fn: Callable[..., Any], *args: Any) -> tuple[Any, BaseException | None]:
    """:func:`_run_guarded` in a worker process, with fd 1 pointing at stderr meanwhile:
    the worker answers on its stdout, so a reward's write to fd 1 (a ``subprocess.run``
    without captured output, an ``os.write(1, ...)``) would corrupt the answer."""
    sys.stdout.flush()
    answer_fd = os.dup(1)
    os.dup2(2, 1)
    try:
        return _run_guarded(fn, *args)
    finally:
        sys.stdout.flush()
        os.dup2(answer_fd, 1)
        os.close(answer_fd)


def check_score_workers(task: Task | EnvTask, workers: ScoreWorkers) -> None:
    """ConfigError (one line) when ``workers`` are processes or Ray and the task's reward
    (an environment task: the task itself) cannot be sent to them, called before
    anything is spent (the engine checks it as it loads the task)."""
    if workers.kind == "threads":
        return
    if workers.kind == "ray":
        from engine.envs.ray_workers import RAY_FEATURE, ray_dumps

        if not is_env_task(task):
            raise ConfigError(
                f"--score-workers ray runs environment tasks, and {task.name!r} is a "
                "single-turn task: use threads or processes:N"
            )
        require("ray", RAY_FEATURE)
        check_picklable(_worker_payload(task), str(workers), ray_dumps())
        return
    if is_env_task(task):  # its environments are stepped in the worker processes
        check_picklable(_worker_payload(task), str(workers))
        return
    group_fn = getattr(task, "score_group", None)
    fn = group_fn if callable(group_fn) else task.score
    if not inspect.iscoroutinefunction(fn):
        check_picklable(fn)


def _worker_payload(task: object) -> object:
    """What of an environment task the workers get: ``task.worker_payload`` (an agent
    task: its agent function) or the task itself."""
    return getattr(task, "worker_payload", task)


def check_picklable(
    fn: object, workers: str = "processes", dumps: Callable[[Any], bytes] = pickle.dumps
) -> None:
    """ConfigError (one line) when ``fn`` cannot be sent to ``workers`` (pickled by
    ``dumps``)."""
    try:
        dumps(fn)
    except Exception as exc:
        raise ConfigError(
            f"--score-workers {workers} needs a picklable task, and {fn!r} is not ({exc}); "
            "define the task at module level of an importable module, or use "
            "--score-workers threads"
        ) from exc
