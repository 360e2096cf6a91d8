"""The pipelined RL loop: rollout -> trainer (submitter -> finisher).

Stages (anyio tasks in one task group, joined by bounded memory streams; every message
carries what the next stage needs, no stage reads another's state):

* **rollout** draws the problems of each step from the seeded source and announces the
  step (:class:`_StepOpened`, with the source's state after its problems), waits for
  *admission* -- the newest policy version must be at least ``step - K`` -- and then
  starts every group of the step concurrently, each one task that runs the group's
  episodes and computes its rewards (:class:`~engine.envs.rollout.EpisodeRunner`; a
  single-turn task is a group of one-turn episodes sampled in one request and rewarded
  by the :class:`~engine.loop.scoring.Scorer`, see :mod:`engine.envs.single_turn`).
  Every turn samples from the newest sampler (at most ``--concurrency`` requests in
  flight) and records its version; a group's version is that of its oldest turn.
* **trainer**, two tasks. The *submitter* assembles step ``s`` from exactly its groups
  (problem ``i`` of step ``s`` is problem ``s * batch + i`` of the source), in problem
  order whatever versions sampled them and whatever order they were scored in, and
  submits forward_backward + optim_step + the snapshot of the weights after it (version
  ``s + 1``) back to back, without awaiting anything: while step ``s``'s results are
  outstanding it already submits step ``s + 1`` (``--submit-ahead`` steps at most), so
  the server's clock never idles between steps. It files every group it receives with
  the finisher (a bounded stream). The *finisher* awaits each submitted step in order,
  publishes its snapshot to :class:`~engine.loop.policy.PolicyVersions` and hands the
  :class:`~engine.loop.results.StepResult` to ``on_step``; its loop state keeps every
  filed group of a later step (nothing sampled is lost on resume), and the trainer's busy
  time comes from the step's own timestamps. Only the sampling meter (written by the
  rollout tasks, read per step) and the in-flight count (the finisher makes room for
  the submitter) are shared.

Admission bounds staleness (every trained group is at most K versions behind, whatever
its later turns sampled from; nothing sampled is discarded): docs/architecture.md, "The
staleness bound", explains it.

Reliability: a step is "in flight" from its first submission until its metrics are
recorded (:class:`~engine.supervision.stopping.StopGate`), so a stop only ever lands between steps
(after every step in flight). A periodic checkpoint is submitted right behind the optim
step it follows (:meth:`~engine.session.api.Session.submit_checkpoint`), so it holds
exactly the steps before it while the next steps are already submitted behind it; the
checkpointer awaits it with the step's result (:attr:`StepResult.checkpoint`) and
records it only once it is saved. A failed sample request or reward function asks the gate to
stop instead of tearing the task group down mid-step; with ``--on-reward-error skip`` a
failing group is dropped from its step (no datums), counted and logged. A train-step or
snapshot failure propagates as :class:`~engine.errors.StepOutcomeUnknown` for the engine
to restore a checkpoint and redo every step submitted after it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from engine.common.clock import Stopwatch
from engine.config import EngineConfig
from engine.envs.datums import episode_group_datums
from engine.envs.executors import RemoteGroup, Workers, env_workers
from engine.envs.metrics import episode_metrics
from engine.envs.rollout import EpisodeRunner, GroupRollout, SampledAction, turn_settings
from engine.envs.single_turn import TaskGroupBuilder
from engine.envs.types import (
    EnvContext,
    EnvGroupBuilder,
    EnvTask,
    EpisodeLimits,
    Observation,
    StopCondition,
    is_env_task,
)
from engine.errors import EngineError
from engine.loop.evaluation import Evaluator
from engine.loop.policy import PolicyVersions
from engine.loop.results import StepResult, StepTimeline
from engine.loop.rl import Completion, Datum, GroupDatums, group_datums, kl_sample_train
from engine.loop.scoring import RewardError, Scorer, check_score_workers, parse_score_workers
from engine.loop.state import LoopState, ScoredGroup
from engine.observe.metrics import (
    ActivityMeter,
    quickstart_line,
    response_metrics,
    reward_metrics,
)
from engine.session.api import (
    LossSpec,
    PendingCheckpoint,
    PendingSnapshot,
    SamplerHandle,
    Session,
    StepTicket,
    TrainResult,
)
from engine.session.retry import tally_retries
from engine.supervision.stopping import StopGate
from engine.tasks.base import Problem, ProblemSource, RewardBreakdown, Task
from engine.tasks.render import PromptRenderer

__all__ = ["Pipeline", "PipelineOutcome", "checkpoint_name"]

StepCallback = Callable[[StepResult], Awaitable[None]]
ProgressCallback = Callable[[str], None]


@dataclass(frozen=True)
class _StepOpened:
    """The sampler drew step ``step``'s problems; ``source_after`` is the source's state
    after them (= before the next step's): the loop state once the step is trained."""

    step: int
    source_after: dict[str, Any]


@dataclass(frozen=True)
class _GroupJob:
    step: int
    index: int
    problem: Problem
    builder: EnvGroupBuilder
    admitted: int
    """The sampler version the group was admitted under."""
    prompt_tokens: tuple[int, ...] = ()
    """A single-turn task's prompt (its groups keep the single-turn record)."""


_RolledOut = _StepOpened | ScoredGroup


@dataclass(frozen=True)
class _Assembled:
    """What a step trains on and what was left out, and why."""

    datums: tuple[Datum, ...]
    empty: int
    zero_advantage: int
    missing_logprobs: int
    constant_groups: int
    used_groups: int
    masked: int


class _StepAssembly:
    """The submitter's view of the step being assembled: the datums of each group (built
    once), the datums in submission order (the order of the trainer's outputs) and the
    step's ticket."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.ticket = StepTicket(_steps_done(step))
        self.built: dict[int, GroupDatums] = {}
        self.datums: list[Datum] = []
        self.train_start: float | None = None

    def assembled(self, groups: Sequence[ScoredGroup]) -> _Assembled:
        built = [(g, self.built[g.index]) for g in groups]
        return _Assembled(
            datums=tuple(self.datums),
            empty=sum(b.skipped_empty for _, b in built),
            zero_advantage=sum(b.skipped_zero_advantage for _, b in built),
            missing_logprobs=sum(b.dropped_missing_logprobs for _, b in built),
            masked=sum(b.masked for _, b in built),
            constant_groups=sum(1 for g, b in built if g.trainable and b.constant_reward),
            used_groups=sum(1 for _, b in built if b.datums),
        )


@dataclass(frozen=True)
class _SubmittedStep:
    """A step whose calls are submitted: everything the finisher needs to finish it.
    ``step`` is 0-based, like every ``step`` in this module (see :func:`_steps_done`)."""

    step: int
    groups: tuple[ScoredGroup, ...]
    assembled: _Assembled
    ticket: StepTicket
    snapshot: PendingSnapshot | None
    checkpoint: PendingCheckpoint | None
    state: LoopState
    train_start: float
    wait: float


@dataclass(frozen=True)
class PipelineOutcome:
    steps_completed: int
    exhausted: bool
    state: LoopState


class _InFlight:
    """How many submitted steps are not yet recorded; the submitter waits for room."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._count = 0
        self._changed = anyio.Event()

    async def acquire(self) -> None:
        while self._count >= self._limit:
            await self._changed.wait()
        self._count += 1

    def release(self) -> None:
        self._count -= 1
        self._changed.set()
        self._changed = anyio.Event()


class _Submitted:
    """How many steps the submitter has submitted; the rollout stage waits on it."""

    def __init__(self, steps: int) -> None:
        self._steps = steps
        self._changed = anyio.Event()

    async def wait_for(self, steps: int) -> None:
        while self._steps < steps:
            await self._changed.wait()

    def reached(self, steps: int) -> None:
        self._steps = steps
        self._changed.set()
        self._changed = anyio.Event()


class Pipeline:
    """One run of the loop from ``state`` to ``config.pipeline.steps``."""

    def __init__(
        self,
        config: EngineConfig,
        task: Task | EnvTask,
        session: Session,
        source: ProblemSource,
        state: LoopState,
        sampler: SamplerHandle,
        on_step: StepCallback,
        *,
        gate: StopGate,
        progress: ProgressCallback = lambda what: None,
        clock: Stopwatch = time.perf_counter,
        renderer: PromptRenderer | None = None,
        evaluate: Evaluator | None = None,
        on_reward_error: Callable[[RewardError], None] = lambda error: None,
        before_training: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """``before_training`` is awaited once, right before the first call that trains
        (the first step's first submission)."""
        if config.training.learning_rate is None:
            raise ValueError("the config must be resolved before it runs")
        self._config = config
        self._lr: float = config.training.learning_rate
        self._loss = LossSpec(config.training.loss, config.training.loss_fn_config())
        self._task = task
        self._session = session
        self._source = source
        self._state = state
        self._versions = PolicyVersions(sampler)
        self._on_step = on_step
        self._gate = gate
        self._progress = progress
        self._clock = clock
        self._k = config.pipeline.max_steps_off_policy
        self._bound = (self._k + 2) * (config.pipeline.batch + 1)
        self._slots = anyio.Semaphore(config.pipeline.concurrency)
        self._sampling = ActivityMeter(clock)
        self._in_flight = _InFlight(config.pipeline.submit_ahead + 1)
        self._submitted = _Submitted(state.next_step)
        self._exhausted = False
        self._renderer = renderer or PromptRenderer(task, session.tokenizer)
        self._evaluate = evaluate
        self._on_reward_error = on_reward_error
        self._before_training = before_training
        context = session.info.max_context
        self._max_prompt = context - config.sampling.max_tokens if context is not None else None
        stop_strings, stop_token_ids = self._renderer.stops(stop_at_eos=config.sampling.stop_at_eos)
        self._stop = StopCondition(stop_strings, stop_token_ids)
        workers = parse_score_workers(config.scoring.score_workers)
        self._env_workers: Workers | None = None
        if is_env_task(task):
            check_score_workers(task, workers)
            self._env_workers = env_workers(workers)
            self._env_task: EnvTask | None = task
            self._env_context = EnvContext(
                self._renderer.context,
                self._stop,
                config.environment.episode_limits().within(context),
            )
            limits: EpisodeLimits | None = self._env_context.limits
            self._max_prompt = None  # an episode's context is bounded by its limits
            self._scorer: Scorer | None = None
        else:
            self._env_task, limits = None, None
            self._scorer = Scorer(
                task, concurrency=config.scoring.score_concurrency, workers=workers
            )
        self._runner = EpisodeRunner(self._sample_turn, limits, clock=clock)
        ahead = config.pipeline.sample_ahead
        self._sample_ahead = ahead if ahead is not None or self._env_task is not None else 0

    async def run(self) -> PipelineOutcome:
        rolled_send, rolled_recv = anyio.create_memory_object_stream[_RolledOut](self._bound)
        submitted_send, submitted_recv = anyio.create_memory_object_stream[_SubmittedStep](
            self._config.pipeline.submit_ahead + 1
        )
        # Every group the submitter files, for the finisher's checkpoints (at most K + 1
        # steps of groups are untrained at once, well within the bound).
        filed_send, filed_recv = anyio.create_memory_object_stream[ScoredGroup](self._bound)
        async with contextlib.AsyncExitStack() as workers:
            if self._env_workers is not None:  # a pool or a Ray cluster, for this run
                await workers.enter_async_context(self._env_workers)
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._rollout_stage, tg, rolled_send)
                tg.start_soon(self._submit_stage, rolled_recv, submitted_send, filed_send)
                completed, state = await self._finish_stage(submitted_recv, filed_recv)
        return PipelineOutcome(completed, self._exhausted, state)

    # -- rollout ---------------------------------------------------------------------

    async def _rollout_stage(self, tg: TaskGroup, send: MemoryObjectSendStream[_RolledOut]) -> None:
        cfg = self._config
        pending = {(g.step, g.index) for g in self._state.pending_groups}
        async with send:
            for step in range(self._state.next_step, cfg.pipeline.steps):
                problems: list[Problem] = []
                for _ in range(cfg.pipeline.batch):
                    problem = self._source.next()
                    if problem is None:
                        self._exhausted = True
                        return
                    problems.append(problem)
                await send.send(_StepOpened(step, self._source.state()))
                await self._versions.wait_for(step - self._k)  # admission control
                if self._sample_ahead is not None:
                    await self._submitted.wait_for(step - self._sample_ahead)
                for index, problem in enumerate(problems):
                    if (step, index) in pending:
                        continue  # rolled out before a resume: reused as is
                    job = self._job(step, index, problem)
                    if self._max_prompt is not None and len(job.prompt_tokens) > self._max_prompt:
                        await send.send(self._not_sampled(job))
                        continue
                    tg.start_soon(self._rollout_group, job, send.clone())

    def _job(self, step: int, index: int, problem: Problem) -> _GroupJob:
        admitted = self._versions.current.version
        if self._env_task is not None:
            builder = self._env_task.group_builder(
                problem, self._config.pipeline.group, self._env_context
            )
            if self._env_workers is not None:
                builder = RemoteGroup(builder, self._env_workers)
            return _GroupJob(step, index, problem, builder, admitted)
        assert self._scorer is not None
        prompt = tuple(self._renderer.prompt_tokens(problem))
        observation = Observation(prompt, self._stop)
        group = TaskGroupBuilder(
            problem, observation, self._config.pipeline.group, self._scorer, self._renderer
        )
        return _GroupJob(step, index, problem, group, admitted, prompt)

    async def _rollout_group(
        self, job: _GroupJob, send: MemoryObjectSendStream[_RolledOut]
    ) -> None:
        async with send:
            try:
                rollout = await self._runner.run_group(job.builder, job.problem)
            except Exception as exc:
                # Sampling retries are spent (or the breaker is open): stop after the
                # steps in flight instead of cancelling them half-way.
                self._gate.request(exc)
                return
            if rollout.error is not None:
                self._on_reward_error(rollout.error)
            if rollout.error is not None and self._config.scoring.on_reward_error == "fail":
                # Stop after the steps in flight; until then keep the streams open
                # (closing them would break the other rollout tasks mid-send).
                self._gate.request(rollout.error)
                await anyio.sleep_forever()
            self._progress(f"step {_steps_done(job.step)} group {job.index} rolled out")
            await send.send(self._scored(job, rollout))

    def _scored(self, job: _GroupJob, rollout: GroupRollout) -> ScoredGroup:
        """The group as the trainer takes it: a single-turn task's keeps the
        single-turn record (prompt, completions, rewards); an environment's keeps its
        trajectories."""
        trajectories = rollout.trajectories
        group = ScoredGroup(
            step=job.step,
            index=job.index,
            problem=job.problem,
            prompt_tokens=job.prompt_tokens,
            version=min((t.version for t in trajectories if t.turns), default=job.admitted),
            completions=(),
            rewards=tuple(
                RewardBreakdown(t.total_reward, t.group_reward.components) for t in trajectories
            ),
            sample_started=rollout.started,
            sample_finished=rollout.episodes_finished,
            score_started=rollout.episodes_finished,
            score_finished=rollout.rewards_finished,
            retries=rollout.retries,
            reward_error=None if rollout.error is None else str(rollout.error),
        )
        if self._env_task is None:
            turns = [t.turns[0] for t in trajectories]
            return dataclasses.replace(
                group,
                completions=tuple(Completion(t.action, t.logprobs, t.stop_reason) for t in turns),
                rewards=tuple(t.group_reward for t in trajectories),
            )
        first = trajectories[0].turns if trajectories else ()
        return dataclasses.replace(
            group, prompt_tokens=first[0].observation if first else (), episodes=trajectories
        )

    async def _sample_turn(
        self, observation: Observation, n: int, room: int | None
    ) -> list[SampledAction]:
        """``n`` actions for ``observation`` from the newest sampler."""
        cfg = self._config
        settings = turn_settings(
            observation,
            room,
            max_tokens=cfg.sampling.max_tokens,
            temperature=cfg.sampling.temperature,
            seed=cfg.sampling.sampling_seed,
        )
        async with self._slots:
            sampler = self._versions.current
            self._sampling.begin()
            samples = tokens = 0
            try:
                result = await self._session.sample(sampler, observation.tokens, n, settings)
                samples = len(result.completions)
                tokens = sum(len(c.tokens) for c in result.completions)
            finally:
                self._sampling.end(items=samples, tokens=tokens)
        return [
            SampledAction(c, result.version, result.retries if i == 0 else 0)
            for i, c in enumerate(result.completions)
        ]

    def _not_sampled(self, job: _GroupJob) -> ScoredGroup:
        """A group whose prompt cannot fit the context: part of its step, never sampled
        (the server would refuse it, and one refusal would stop the run)."""
        context = self._session.info.max_context
        reason = (
            f"problem {job.problem.id}'s prompt of {len(job.prompt_tokens)} tokens plus "
            f"--max-tokens {self._config.sampling.max_tokens} exceeds the model's context of "
            f"{context} tokens"
        )
        now = self._clock()
        return ScoredGroup(
            step=job.step,
            index=job.index,
            problem=job.problem,
            prompt_tokens=job.prompt_tokens,
            version=job.admitted,
            completions=(),
            rewards=(),
            sample_started=now,
            sample_finished=now,
            score_started=now,
            score_finished=now,
            too_long=reason,
        )

    # -- trainer: submitter ----------------------------------------------------------

    async def _submit_stage(
        self,
        receive: MemoryObjectReceiveStream[_RolledOut],
        send: MemoryObjectSendStream[_SubmittedStep],
        filed: MemoryObjectSendStream[ScoredGroup],
    ) -> None:
        cfg = self._config
        now = self._clock()
        waiting: dict[int, dict[int, ScoredGroup]] = {}  # step -> index -> group
        for g in self._state.pending_groups:
            # Restored from a checkpoint: ready now (their old clock values mean nothing).
            restored = dataclasses.replace(
                g, sample_started=now, sample_finished=now, score_started=now, score_finished=now
            )
            waiting.setdefault(g.step, {})[g.index] = restored
        source_after: dict[int, dict[str, Any]] = {}
        trained = self._state.trained_problem_ids
        submitted_at = complete_at = now
        async with receive, send, filed:
            for step in range(self._state.next_step, cfg.pipeline.steps):
                assembly = _StepAssembly(step)
                while True:
                    arrived = waiting.get(step, {})
                    complete = len(arrived) == cfg.pipeline.batch and step in source_after
                    await self._submit_ready(assembly, arrived, complete=complete)
                    if complete:
                        break
                    try:
                        message = await receive.receive()
                    except anyio.EndOfStream:
                        return  # the source ran out
                    if isinstance(message, _StepOpened):
                        source_after[message.step] = message.source_after
                    else:
                        waiting.setdefault(message.step, {})[message.index] = message
                        await filed.send(message)
                        if message.step == step:
                            complete_at = self._clock()
                arrived = waiting.pop(step)
                groups = tuple(arrived[i] for i in range(cfg.pipeline.batch))
                await self._open(assembly)
                done = _steps_done(step)
                snapshot: PendingSnapshot | None = None
                if assembly.datums:
                    await self._session.submit_optim_step(assembly.ticket, self._lr)
                    if done < cfg.pipeline.steps or self._evaluates(done):
                        # Right behind the optim step: it snapshots the new weights.
                        snapshot = await self._session.submit_snapshot(done)
                checkpoint: PendingCheckpoint | None = None
                if cfg.checkpoint_due(done):
                    # Behind it too: it saves exactly the steps trained so far.
                    checkpoint = await self._session.submit_checkpoint(done, checkpoint_name(done))
                trained = (*trained, *(g.problem.id for g in groups))
                if self._sample_ahead is not None:
                    # The next step's sample requests would queue in the SDK ahead of this
                    # step's calls, which it posts a round trip apart: let them land first.
                    await self._session.delivered(done)
                self._submitted.reached(done)
                state = LoopState(
                    next_step=done,
                    source_state=source_after.pop(step),
                    sampler_version=done,
                    trained_problem_ids=trained,
                )
                assert assembly.train_start is not None
                await send.send(
                    _SubmittedStep(
                        step,
                        groups,
                        assembly.assembled(groups),
                        assembly.ticket,
                        snapshot,
                        checkpoint,
                        state,
                        assembly.train_start,
                        max(0.0, complete_at - submitted_at),
                    )
                )
                submitted_at = self._clock()

    async def _submit_ready(
        self, assembly: _StepAssembly, arrived: dict[int, ScoredGroup], *, complete: bool
    ) -> None:
        """Submit forward_backward for what is ready: every group once the step is
        complete; with ``--stream-minibatches M`` each ``M`` arrived groups before that."""
        m = self._config.pipeline.stream_minibatches
        waiting = [i for i in sorted(arrived) if i not in assembly.built]
        size = len(waiting) if complete else (m or 0)
        while size and len(waiting) >= size:
            chunk, waiting = waiting[:size], waiting[size:]
            datums: list[Datum] = []
            for i in chunk:
                built = self._datums(arrived[i])
                assembly.built[i] = built
                datums.extend(built.datums)
            if datums:
                await self._open(assembly)
                await self._session.submit_forward_backward(assembly.ticket, datums, self._loss)
                assembly.datums.extend(datums)

    async def _open(self, assembly: _StepAssembly) -> None:
        """Mark the step in flight before its first submission: room among the steps in
        flight, and no stop pending."""
        if assembly.train_start is not None:
            return
        await self._in_flight.acquire()
        await self._gate.begin_step(assembly.ticket.step)
        if self._before_training is not None:
            before, self._before_training = self._before_training, None
            await before()
        assembly.train_start = self._clock()

    def _datums(self, group: ScoredGroup) -> GroupDatums:
        if not group.trainable:
            return GroupDatums([], [], 0, 0, 0)
        if group.episodes:
            return episode_group_datums(
                group.episodes, on_missing_logprobs=self._config.training.on_missing_logprobs
            )
        return group_datums(
            group.prompt_tokens,
            group.completions,
            group.totals,
            on_missing_logprobs=self._config.training.on_missing_logprobs,
        )

    # -- trainer: finisher -----------------------------------------------------------

    async def _finish_stage(
        self,
        receive: MemoryObjectReceiveStream[_SubmittedStep],
        filed: MemoryObjectReceiveStream[ScoredGroup],
    ) -> tuple[int, LoopState]:
        completed = 0
        state = self._state
        last_end = self._clock()
        untrained = {(g.step, g.index): g for g in self._state.pending_groups}
        async with receive, filed:
            async for submitted in receive:
                step = submitted.step
                done = _steps_done(step)
                try:
                    result = (
                        await self._session.finish_train_step(submitted.ticket)
                        if submitted.ticket.submitted
                        else _NO_TRAINING
                    )
                    with tally_retries() as snapshot_retries:
                        if submitted.snapshot is not None:
                            handle = await self._session.finish_snapshot(submitted.snapshot)
                        else:  # no update: the weights (and the sampler) are unchanged
                            handle = SamplerHandle(done, self._versions.current.client)
                except BaseException:
                    self._gate.step_failed()
                    raise
                # Trained now, before the next version lets a step sample: progress is
                # never marked after the samples it admits were sent.
                self._progress(f"step {done} trained")
                if done < self._config.pipeline.steps:
                    self._versions.publish(handle)
                end = self._clock()
                state = dataclasses.replace(
                    submitted.state,
                    sampler_version=self._versions.current.version,
                    pending_groups=_untrained_after(step, untrained, filed),
                )
                step_result = self._step_result(
                    submitted, result, state, last_end, end, snapshot_retries.count
                )
                if self._evaluate is not None and self._evaluates(done):
                    step_result.metrics.update(await self._evaluate(done, handle))
                await self._on_step(step_result)
                self._gate.end_step(done)
                self._in_flight.release()
                last_end = end
                completed += 1
        return completed, state

    def _evaluates(self, completed_steps: int) -> bool:
        return self._evaluate is not None and self._evaluate.due(completed_steps)

    def _step_result(
        self,
        submitted: _SubmittedStep,
        result: TrainResult,
        state: LoopState,
        last_end: float,
        train_end: float,
        snapshot_retries: int,
    ) -> StepResult:
        cfg = self._config
        step, groups, assembled = submitted.step, submitted.groups, submitted.assembled
        done = _steps_done(step)
        versions = [g.version for g in groups]
        staleness = step - min(versions)
        if staleness > self._k:
            raise EngineError(
                f"internal error: step {done} trained on data {staleness} versions old "
                f"(bound {self._k})"
            )
        kl = kl_sample_train(assembled.datums, result.logprobs)
        step_time = max(train_end - last_end, 1e-9)
        sampling_busy, samples, tokens = self._sampling.take()
        # Steps are trained in order: from this step's first submission (or the end of
        # the previous step, if later) to its end, the trainer was busy.
        training_busy = train_end - max(submitted.train_start, last_end)
        scored = [g for g in groups if g.trainable]
        failed = [g for g in groups if g.reward_error is not None]
        metrics: dict[str, Any] = {
            "step": done,
            **reward_metrics(scored),
            **response_metrics(groups),
            "datums": len(assembled.datums),
            "groups/total": len(groups),
            "groups/used": assembled.used_groups,
            "groups/trained_frac": assembled.used_groups / len(groups),
            "groups/skipped": assembled.constant_groups,
            "groups/reward_errors": len(failed),
            "reward_errors/problem_ids": [g.problem.id for g in failed],
            "groups/too_long": sum(1 for g in groups if g.too_long is not None),
            "skipped/empty_responses": assembled.empty,
            "skipped/zero_advantage": assembled.zero_advantage,
            "dropped/missing_logprobs": assembled.missing_logprobs,
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
            "time/score": _union_length([(g.score_started, g.score_finished) for g in groups]),
            "time/train": train_end - submitted.train_start,
            "time/wait": submitted.wait,
            "time/step": step_time,
            "trainer/idle_ratio": _ratio(1.0 - training_busy / step_time),
            "sampler/idle_ratio": _ratio(1.0 - sampling_busy / step_time),
            "throughput/samples_per_s": samples / step_time,
            "throughput/tokens_per_s": tokens / step_time,
            "progress/done_frac": done / cfg.pipeline.steps,
            "problem_ids": [g.problem.id for g in groups],
            "problems/digest": _problems_digest(groups),
            "retries/sample": sum(g.retries for g in groups),
            "retries/save_sampler": snapshot_retries,
            **episode_metrics([e for g in groups for e in g.episodes]),
        }
        if self._env_task is not None:
            metrics["skipped/masked_episodes"] = assembled.masked
        timeline = StepTimeline(
            sample_start=min(g.sample_started for g in groups),
            sample_end=max(g.sample_finished for g in groups),
            train_start=submitted.train_start,
            train_end=train_end,
        )
        return StepResult(
            step=done,
            metrics=metrics,
            line=quickstart_line(done, metrics),
            datums=assembled.datums,
            groups=groups,
            timeline=timeline,
            state=state,
            checkpoint=submitted.checkpoint,
        )


def _steps_done(step: int) -> int:
    """The steps trained once 0-based ``step`` is: the number that tickets, the stop
    gate, metrics, logs and checkpoints give the step (they count from 1), the policy
    version its update produces, and the index of the next step."""
    return step + 1


def checkpoint_name(completed_steps: int) -> str:
    """The server-side name of the checkpoint after ``completed_steps`` steps."""
    return f"step-{completed_steps}"


def _untrained_after(
    step: int,
    untrained: dict[tuple[int, int], ScoredGroup],
    filed: MemoryObjectReceiveStream[ScoredGroup],
) -> tuple[ScoredGroup, ...]:
    """Every group filed by the submitter so far of a step after ``step`` (what a
    checkpoint after ``step`` must keep, so nothing sampled is lost on resume)."""
    while True:
        try:
            group = filed.receive_nowait()
        except (anyio.WouldBlock, anyio.EndOfStream):
            break
        untrained[(group.step, group.index)] = group
    for key in [k for k in untrained if k[0] <= step]:
        del untrained[key]
    return tuple(untrained[k] for k in sorted(untrained))


_NO_TRAINING = TrainResult([], {}, {})
"""A step without datums: nothing was submitted (the quickstart skips its optim_step)."""


def _problems_digest(groups: Sequence[ScoredGroup]) -> str:
    """A short fingerprint of a step's problems (questions and answers, in order): two
    runs trained the same problem sequence iff their per-step digests match."""
    h = hashlib.sha256()
    for g in groups:
        h.update(f"{g.problem.id}\x1f{g.problem.question}\x1f{g.problem.answer!r}\x1e".encode())
    return h.hexdigest()[:16]


def _union_length(intervals: Sequence[tuple[float, float]]) -> float:
    """Total length covered by ``intervals`` (overlapping spans counted once)."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def _ratio(value: float) -> float:
    return min(1.0, max(0.0, value))
