"""The pipelined RL loop: sampler -> scorer -> trainer, joined by bounded streams.

Stages (anyio tasks in one task group):

* **sampler** reads the problems of each step from the seeded source, waits for
  *admission* -- the newest policy version must be at least ``step - K`` -- and then
  starts every group of the step concurrently (at most ``concurrency`` requests in
  flight), each tagged with the version of the sampler that produced it.
* **scorer** rewards each group as soon as it arrives (a synchronous reward function
  runs in a worker thread, off the event loop).
* **trainer** assembles step ``s`` from exactly the groups of step ``s`` (problem ``i``
  of step ``s`` is problem ``s * batch + i`` of the source), in problem order, even when
  they were sampled by different (bounded-stale) versions; submits forward_backward and
  optim_step back to back, snapshots the new weights as version ``s + 1`` and publishes
  it to :class:`~engine.policy.PolicyVersions`.

Admission bounds staleness: a group of step ``s`` starts only once version ``>= s - K``
exists, so at most ``K + 1`` steps of groups are started but untrained and every trained
group satisfies ``s - version <= K``. With ``K = 0`` this is the MinT quickstart's
on-policy loop (same problems, datums and skip rules), only with concurrent sampling and
one server round per train step. Groups are consumed oldest step first; nothing sampled
is discarded. Every stream's buffer is bounded by ``(K + 1) * batch``.

Reliability: a step is "in flight" from its first submission until its metrics are
logged (:class:`~engine.stopping.StopGate`), so a stop only ever lands between steps. A
failed sample request or reward function does not tear the task group down mid-step: it
asks the gate to stop (after the step in flight). A reward function that raises names the
problem; with ``--on-reward-error skip`` its group is dropped from the step (no datums),
counted (``groups/reward_errors``) and logged instead. A train-step failure propagates as
:class:`~engine.errors.StepOutcomeUnknown` for the engine to restore a checkpoint. Every
sampled group and trained step counts as progress for the watchdog.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from tinker import types

from engine.config import EngineConfig
from engine.errors import EngineError, classify
from engine.metrics import ActivityMeter, quickstart_line, reward_metrics
from engine.policy import PolicyVersions
from engine.results import StepResult, StepTimeline
from engine.rl import GroupDatums, group_datums, kl_sample_train
from engine.service import MintSession, SampleResult, SamplerHandle, TrainResult, TrainSubmission
from engine.state import LoopState, ScoredGroup
from engine.stopping import StopGate
from engine.tasks.base import Problem, ProblemSource, RewardBreakdown, Task

__all__ = ["Pipeline", "PipelineOutcome"]

StepCallback = Callable[[StepResult], Awaitable[None]]
ProgressCallback = Callable[[str], None]


class RewardError(EngineError):
    """The task's reward function raised (or returned garbage) for a problem."""

    def __init__(self, problem: Problem, cause: BaseException) -> None:
        detail = classify(cause).message if isinstance(cause, Exception) else str(cause)
        super().__init__(
            f"the reward function failed on problem {problem.id} ({problem.question!r}): {detail}"
        )
        self.problem = problem


@dataclass(frozen=True)
class _GroupJob:
    step: int
    index: int
    problem: Problem
    prompt_tokens: tuple[int, ...]


@dataclass(frozen=True)
class _SampledGroup:
    job: _GroupJob
    result: SampleResult
    started: float
    finished: float


@dataclass(frozen=True)
class PipelineOutcome:
    steps_completed: int
    exhausted: bool
    state: LoopState


class _StepAssembly:
    """The trainer's view of the step being assembled: submitted chunks (streaming
    mode), datums in submission order, and the skip counts."""

    def __init__(self) -> None:
        self.submission = TrainSubmission()
        self.datums: list[types.Datum] = []
        self.submitted: set[int] = set()
        self.train_start: float | None = None
        self.empty = 0
        self.zero_advantage = 0
        self.missing_logprobs = 0
        self.constant_groups = 0
        self.used_groups = 0
        self.reward_errors = 0

    def add(self, built: GroupDatums | None) -> None:
        if built is None:  # the reward function failed on this group
            self.reward_errors += 1
            return
        self.datums.extend(built.datums)
        self.empty += built.skipped_empty
        self.zero_advantage += built.skipped_zero_advantage
        self.missing_logprobs += built.dropped_missing_logprobs
        self.constant_groups += int(built.constant_reward)
        self.used_groups += int(bool(built.datums))


class Pipeline:
    """One run of the loop from ``state`` to ``config.steps``."""

    def __init__(
        self,
        config: EngineConfig,
        task: Task,
        session: MintSession,
        source: ProblemSource,
        state: LoopState,
        sampler: SamplerHandle,
        on_step: StepCallback,
        *,
        gate: StopGate,
        progress: ProgressCallback = lambda what: None,
    ) -> None:
        if config.learning_rate is None:
            raise ValueError("the config must be resolved before it runs")
        self._config = config
        self._lr: float = config.learning_rate
        self._task = task
        self._session = session
        self._source = source
        self._state = state
        self._versions = PolicyVersions(sampler)
        self._on_step = on_step
        self._gate = gate
        self._progress = progress
        self._k = config.max_steps_off_policy
        self._bound = (self._k + 1) * config.batch
        self._slots = anyio.Semaphore(config.concurrency)
        self._sampling = ActivityMeter()
        self._source_before: dict[int, dict[str, Any]] = {}
        self._exhausted = False
        self._params = types.SamplingParams(
            max_tokens=config.max_tokens,
            temperature=config.temperature,
            seed=config.sampling_seed,
            stop=(
                [session.eos_token_id]
                if config.stop_at_eos and session.eos_token_id is not None
                else None
            ),
        )
        self._score_is_async = inspect.iscoroutinefunction(task.score)

    async def run(self) -> PipelineOutcome:
        sampled_send, sampled_recv = anyio.create_memory_object_stream[_SampledGroup](self._bound)
        scored_send, scored_recv = anyio.create_memory_object_stream[ScoredGroup](self._bound)
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._sample_stage, tg, sampled_send)
            tg.start_soon(self._score_stage, sampled_recv, scored_send)
            completed = await self._train_stage(scored_recv)
        return PipelineOutcome(completed, self._exhausted, self._state)

    # -- sampler ---------------------------------------------------------------------

    async def _sample_stage(
        self, tg: TaskGroup, send: MemoryObjectSendStream[_SampledGroup]
    ) -> None:
        cfg = self._config
        pending = {(g.step, g.index) for g in self._state.pending_groups}
        async with send:
            for step in range(self._state.next_step, cfg.steps):
                before = self._source.state()
                problems: list[Problem] = []
                for _ in range(cfg.batch):
                    problem = self._source.next()
                    if problem is None:
                        self._exhausted = True
                        return
                    problems.append(problem)
                self._source_before[step] = before
                await self._versions.wait_for(step - self._k)  # admission control
                for index, problem in enumerate(problems):
                    if (step, index) in pending:
                        continue  # sampled and scored before a resume: reused as is
                    job = _GroupJob(
                        step,
                        index,
                        problem,
                        tuple(self._session.encode(self._task.prompt(problem))),
                    )
                    await self._slots.acquire()
                    tg.start_soon(self._sample_group, job, self._versions.current, send.clone())

    async def _sample_group(
        self,
        job: _GroupJob,
        sampler: SamplerHandle,
        send: MemoryObjectSendStream[_SampledGroup],
    ) -> None:
        async with send:
            started = time.perf_counter()
            self._sampling.begin()
            samples = tokens = 0
            try:
                result = await self._session.sample(
                    sampler, job.prompt_tokens, self._config.group, self._params
                )
                samples = len(result.completions)
                tokens = sum(len(c.tokens) for c in result.completions)
            except Exception as exc:
                # Retries are spent (or the breaker is open): stop after the step in
                # flight instead of cancelling it half-way.
                self._gate.request(exc)
                return
            finally:
                self._sampling.end(items=samples, tokens=tokens)
                self._slots.release()
            self._progress(f"step {job.step + 1} group {job.index} sampled")
            await send.send(_SampledGroup(job, result, started, time.perf_counter()))

    # -- scorer ----------------------------------------------------------------------

    async def _score_stage(
        self,
        receive: MemoryObjectReceiveStream[_SampledGroup],
        send: MemoryObjectSendStream[ScoredGroup],
    ) -> None:
        async with receive, send:
            async for sampled in receive:
                t0 = time.perf_counter()
                job = sampled.job
                reward_error: str | None = None
                try:
                    rewards = await self._score_group(sampled)
                except Exception as exc:
                    error = RewardError(job.problem, exc)
                    if self._config.on_reward_error == "fail":
                        # Stop after the step in flight; until then keep the streams
                        # open (closing them would break the sampler tasks mid-send).
                        self._gate.request(error)
                        await anyio.sleep_forever()
                    reward_error = str(error)
                    rewards = [RewardBreakdown(0.0)] * len(sampled.result.completions)
                await send.send(
                    ScoredGroup(
                        step=job.step,
                        index=job.index,
                        problem=job.problem,
                        prompt_tokens=job.prompt_tokens,
                        version=sampled.result.version,
                        completions=sampled.result.completions,
                        rewards=tuple(rewards),
                        sample_started=sampled.started,
                        sample_finished=sampled.finished,
                        score_seconds=time.perf_counter() - t0,
                        reward_error=reward_error,
                    )
                )

    async def _score_group(self, sampled: _SampledGroup) -> list[RewardBreakdown]:
        problem = sampled.job.problem
        completions = sampled.result.completions
        if self._score_is_async:
            rewards = []
            for c in completions:
                value = self._task.score(self._session.decode(c.tokens), problem)
                rewards.append(_checked(await value if inspect.isawaitable(value) else value))
            return rewards

        def score_all() -> list[RewardBreakdown]:
            return [
                _checked(self._task.score(self._session.decode(c.tokens), problem))
                for c in completions
            ]

        return await anyio.to_thread.run_sync(score_all, abandon_on_cancel=True)

    # -- trainer ---------------------------------------------------------------------

    async def _train_stage(self, receive: MemoryObjectReceiveStream[ScoredGroup]) -> int:
        cfg = self._config
        buffer: dict[int, dict[int, ScoredGroup]] = {}
        now = time.perf_counter()
        for g in self._state.pending_groups:
            # Restored from a checkpoint: ready now (their old clock values mean nothing).
            ready = dataclasses.replace(g, sample_started=now, sample_finished=now)
            buffer.setdefault(g.step, {})[g.index] = ready
        step = self._state.next_step
        completed = 0
        assembly = _StepAssembly()
        last_end = time.perf_counter()
        complete_at = last_end

        def pending() -> tuple[ScoredGroup, ...]:
            """Every group scored for a later step, including those that arrived while
            the step trained (still in the stream): a checkpoint keeps them all."""
            while True:
                try:
                    group = receive.receive_nowait()
                except (anyio.WouldBlock, anyio.EndOfStream):
                    break
                buffer.setdefault(group.step, {})[group.index] = group
            return tuple(g for later in sorted(buffer) for g in buffer[later].values())

        async def advance() -> None:
            nonlocal step, completed, assembly, last_end, complete_at
            while len(buffer.get(step, ())) == cfg.batch:
                complete_at = max(complete_at, last_end)
                groups = buffer.pop(step)
                await self._train_step(step, groups, pending, assembly, last_end, complete_at)
                last_end = time.perf_counter()
                step += 1
                completed += 1
                assembly = _StepAssembly()
                await self._stream(step, buffer, assembly, final=False)

        async with receive:
            await advance()
            async for group in receive:
                buffer.setdefault(group.step, {})[group.index] = group
                if group.step == step:
                    complete_at = time.perf_counter()
                    await self._stream(step, buffer, assembly, final=False)
                await advance()
        return completed

    def _build(self, group: ScoredGroup) -> GroupDatums | None:
        if group.reward_error is not None:
            return None
        return group_datums(
            group.prompt_tokens,
            group.completions,
            group.totals,
            on_missing_logprobs=self._config.on_missing_logprobs,
        )

    async def _stream(
        self,
        step: int,
        buffer: dict[int, dict[int, ScoredGroup]],
        assembly: _StepAssembly,
        *,
        final: bool,
    ) -> None:
        """Streaming minibatches: submit forward_backward for every ``M`` arrived groups
        of the current step (and, with ``final``, for whatever is left)."""
        m = self._config.stream_minibatches
        if m is None and not final:
            return
        arrived = buffer.get(step, {})
        waiting = [i for i in sorted(arrived) if i not in assembly.submitted]
        chunk_size = m or len(waiting) or 1
        while waiting and (len(waiting) >= chunk_size or final):
            chunk, waiting = waiting[:chunk_size], waiting[chunk_size:]
            datums: list[types.Datum] = []
            for i in chunk:
                built = self._build(arrived[i])
                assembly.add(built)
                if built is not None:
                    datums.extend(built.datums)
                assembly.submitted.add(i)
            if datums:
                await self._gate.begin_step(step + 1)
                if assembly.train_start is None:
                    assembly.train_start = time.perf_counter()
                await self._session.submit_forward_backward(
                    assembly.submission,
                    datums,
                    self._config.loss,
                    self._config.loss_fn_config(),
                    step=step + 1,
                )

    async def _train_step(
        self,
        step: int,
        groups: dict[int, ScoredGroup],
        pending: Callable[[], tuple[ScoredGroup, ...]],
        assembly: _StepAssembly,
        last_end: float,
        complete_at: float,
    ) -> None:
        cfg = self._config
        ordered = [groups[i] for i in range(cfg.batch)]
        await self._stream(step, {step: groups}, assembly, final=True)
        await self._gate.begin_step(step + 1)
        if assembly.train_start is None:
            assembly.train_start = time.perf_counter()
        optim = (
            await self._session.submit_optim_step(self._lr, step=step + 1)
            if assembly.datums
            else None
        )
        current = self._versions.current
        publish: SamplerHandle | None = None

        async def snapshot() -> None:
            nonlocal publish
            if optim is None:  # no update: the weights (and the sampler) are unchanged
                publish = SamplerHandle(step + 1, current.client)
                return
            try:
                publish = await self._session.save_sampler(step + 1)
            except Exception as exc:
                # The step itself may still complete: record it, then stop.
                self._gate.request(exc)

        try:
            async with anyio.create_task_group() as tg:
                if step + 1 < cfg.steps:
                    # Submitted right behind the optim step: it snapshots the new weights.
                    tg.start_soon(snapshot)
                if optim is None and not assembly.submission.futures:
                    result = _NO_TRAINING
                else:
                    result = await self._session.finish_train_step(
                        assembly.submission, optim, step=step + 1
                    )
        except BaseException:
            self._gate.step_failed()
            raise
        if publish is not None:
            self._versions.publish(publish)
        train_end = time.perf_counter()
        self._state = self._next_state(step, ordered, pending())
        await self._on_step(
            self._step_result(step, ordered, assembly, result, last_end, complete_at, train_end)
        )
        self._progress(f"step {step + 1} trained")
        self._gate.end_step()

    def _step_result(
        self,
        step: int,
        groups: Sequence[ScoredGroup],
        assembly: _StepAssembly,
        result: Any,
        last_end: float,
        complete_at: float,
        train_end: float,
    ) -> StepResult:
        cfg = self._config
        versions = [g.version for g in groups]
        staleness = step - min(versions)
        if staleness > self._k:
            raise EngineError(
                f"internal error: step {step + 1} trained on data {staleness} versions old "
                f"(bound {self._k})"
            )
        kl = kl_sample_train(assembly.datums, result.loss_fn_outputs)
        step_time = max(train_end - last_end, 1e-9)
        busy, samples, tokens = self._sampling.take()
        assert assembly.train_start is not None
        train_time = train_end - assembly.train_start
        scored = [g for g in groups if g.reward_error is None]
        failed = [g for g in groups if g.reward_error is not None]
        metrics: dict[str, Any] = {
            "step": step + 1,
            **reward_metrics(scored),
            "datums": len(assembly.datums),
            "groups/total": len(groups),
            "groups/used": assembly.used_groups,
            "groups/skipped": assembly.constant_groups,
            "groups/reward_errors": len(failed),
            "reward_errors/problem_ids": [g.problem.id for g in failed],
            "skipped/empty_responses": assembly.empty,
            "skipped/zero_advantage": assembly.zero_advantage,
            "dropped/missing_logprobs": assembly.missing_logprobs,
            "sampling_client/step_min": min(versions),
            "sampling_client/step_max": max(versions),
            "sampling_client/step_mean": sum(versions) / len(versions),
            "off_policy/staleness": staleness,
            "optim/kl_sample_train_v1": kl.v1,
            "optim/kl_sample_train_v2": kl.v2,
            "optim/loss": result.metrics.get("loss:sum"),
            "optim/lr": self._lr,
            "optim/trained_tokens": kl.tokens,
            "time/sample": max(g.sample_finished for g in groups)
            - min(g.sample_started for g in groups),
            "time/score": sum(g.score_seconds for g in groups),
            "time/train": train_time,
            "time/wait": max(0.0, complete_at - last_end),
            "time/step": step_time,
            "trainer/idle_ratio": _ratio(1.0 - train_time / step_time),
            "sampler/idle_ratio": _ratio(1.0 - busy / step_time),
            "throughput/samples_per_s": samples / step_time,
            "throughput/tokens_per_s": tokens / step_time,
            "progress/done_frac": (step + 1) / cfg.steps,
            "problem_ids": [g.problem.id for g in groups],
            "problems/digest": _problems_digest(groups),
            **self._session.retries.take(),
        }
        timeline = StepTimeline(
            sample_start=min(g.sample_started for g in groups),
            sample_end=max(g.sample_finished for g in groups),
            train_start=assembly.train_start,
            train_end=train_end,
        )
        return StepResult(
            step=step + 1,
            metrics=metrics,
            line=quickstart_line(step + 1, metrics),
            datums=tuple(assembly.datums),
            groups=tuple(groups),
            timeline=timeline,
            state=self._state,
        )

    def _next_state(
        self, step: int, groups: Sequence[ScoredGroup], pending: tuple[ScoredGroup, ...]
    ) -> LoopState:
        """The state after ``step``: the source as it stood before the next step's
        problems were drawn, and the groups already scored for later steps."""
        self._source_before.pop(step, None)
        source_state = self._source_before.get(step + 1) or self._source.state()
        trained = (*self._state.trained_problem_ids, *(g.problem.id for g in groups))
        return LoopState(
            next_step=step + 1,
            source_state=source_state,
            sampler_version=self._versions.current.version,
            trained_problem_ids=trained,
            pending_groups=pending,
        )


_NO_TRAINING = TrainResult([], {}, {})
"""A step without datums: nothing was submitted (the quickstart skips its optim_step)."""


def _problems_digest(groups: Sequence[ScoredGroup]) -> str:
    """A short fingerprint of a step's problems (questions and answers, in order): two
    runs trained the same problem sequence iff their per-step digests match."""
    h = hashlib.sha256()
    for g in groups:
        h.update(f"{g.problem.id}\x1f{g.problem.question}\x1f{g.problem.answer!r}\x1e".encode())
    return h.hexdigest()[:16]


def _ratio(value: float) -> float:
    return min(1.0, max(0.0, value))


def _checked(reward: Any) -> RewardBreakdown:
    """A task's score as a RewardBreakdown (a bare number is accepted), or a clear error."""
    if isinstance(reward, int | float) and not isinstance(reward, bool):
        reward = RewardBreakdown(float(reward))
    if not isinstance(reward, RewardBreakdown):
        raise EngineError(
            f"task.score must return a RewardBreakdown or a number, got {type(reward).__name__}"
        )
    if not math.isfinite(reward.total):
        raise EngineError(f"task.score returned a non-finite reward ({reward.total})")
    return reward
