"""Supervision of one run: checkpoints, exactly-once recovery, stops.

:class:`Supervisor` runs the pipeline of an entered :class:`~engine.engine.Engine` to
its end and is the one place that decides what happens when something goes wrong:

* **Checkpoints** (``<run dir>/checkpoints.jsonl``): ``step-0`` before the first step,
  every ``--checkpoint-every`` steps (submitted by the trainer right behind the step's
  optim_step, so the saved state holds exactly that many optimizer steps, and recorded
  here once saved), a ``final`` one, and a stop
  checkpoint (``interrupt``/``breaker``/``watchdog``/``error``) when a run stops between
  steps. Each record carries the loop state (data cursor, RNG, consumed problem ids,
  scored-but-untrained groups).
* **Exactly-once steps**: a step whose outcome is unknown makes it restore the latest
  checkpoint on a new training client, rewind the run's record
  (:class:`~engine.rundir.record.RunRecord`) and redo the steps after it
  (:mod:`engine.supervision.recovery`); the breaker bounds how often in a row.
* **Stops**: the breaker, the watchdog, a failed sample/reward and a stop request all
  end the run at a step boundary (:class:`~engine.loop.stopping.StopGate`; after
  :data:`STOP_GRACE_S` the step in flight is cancelled), write a stop checkpoint when
  the state can be trusted, and raise the reason.
* **Resume**: a resumed run starts from the run dir's latest checkpoint (weights,
  optimizer, loop state), the same code path as a recovery.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import anyio

from engine.common.clock import Clock
from engine.config import EngineConfig
from engine.core.state import LoopState
from engine.envs.scoring import RewardError
from engine.envs.types import AnyTask, is_env_task
from engine.errors import (
    ConfigError,
    RunStopped,
    Stalled,
    StepOutcomeUnknown,
    StopRequested,
    find_error,
    format_error,
    primary_error,
)
from engine.loop.pipeline import Pipeline, PipelineOutcome, checkpoint_name
from engine.loop.recipe import StageContext
from engine.loop.results import RunResult, StepResult
from engine.loop.stopping import StopGate
from engine.loop.teacher import Teacher, open_teacher
from engine.objectives import ObjectiveRun, RunContext, objective_named
from engine.observe.idle import (
    failed_episodes_warning,
    no_tool_calls_warning,
    no_training_warning,
)
from engine.observe.run_report import finished_run_report
from engine.observe.tokens import Prices, cumulative_counts, token_metrics
from engine.rundir.checkpoint_log import CheckpointReason, CheckpointRecord
from engine.rundir.record import RunRecord
from engine.rundir.rollout_log import RolloutLog
from engine.rundir.teacher_weights import teacher_weights
from engine.session.api import PendingCheckpoint, SamplerHandle, Session
from engine.session.queue_watch import QueueObserver
from engine.session.retry import RetryCounter
from engine.session.usage import MeteredSession, TokenCounts, TokenMeter
from engine.supervision.recovery import plan_recovery
from engine.supervision.watchdog import Watchdog
from engine.tasks.dataset import raw_prompts_warning
from engine.tasks.render import PromptRenderer

__all__ = ["STOP_GRACE_S", "RunService", "StepHook", "Supervisor"]

StepHook = Callable[[StepResult], Awaitable[None] | None]
"""Called after every trained step, on the trainer's path: keep it quick. After a
recovery the redone steps are reported again (same step numbers)."""

STOP_GRACE_S = 30.0
"""How long a stop waits for the step in flight to finish before cancelling it (the
state is then untrusted: no stop checkpoint, the previous one stands)."""

_STOP_CHECKPOINT_MAX_S = 120.0


@dataclasses.dataclass(frozen=True)
class RunService:
    """The service a supervised run trains on: its session, the counters each step's
    metrics take from it (the SDK's retries, the sampling queue's answers), and its
    local server's data dir (None: not a local server; a teacher run's weights are
    copied there)."""

    session: Session
    retries: RetryCounter
    queue: QueueObserver
    local_server_dir: Path | None


class Supervisor:
    """Trains one entered run to its end on ``service``, recording it in ``record`` (and
    its log and events). ``hooks`` (the engine's live list) run after each step is
    recorded; ``publish`` then hands the step to the engine's consumer."""

    def __init__(
        self,
        config: EngineConfig,
        task: AnyTask,
        *,
        service: RunService,
        record: RunRecord,
        clock: Clock,
        hooks: Sequence[StepHook],
        publish: Callable[[StepResult], Awaitable[None]],
    ) -> None:
        self.gate = StopGate()
        """Where stop requests go; a stop requested before the run starts ends it before
        its first step."""
        self.state: LoopState | None = None
        """The loop state after the latest trained step (the initial or resumed state
        before the first)."""
        self._config = config
        self._task = task
        kept = record.steps[-1] if record.steps else {}
        self._tokens = TokenMeter(cumulative_counts(kept))  # a resumed run's total goes on
        self._prices = Prices.of(config)
        session = MeteredSession(service.session, self._tokens)  # every billed call of the run
        self._session = session
        self._retries = service.retries
        self._queue = service.queue
        self._run_record = record
        self._log = log = record.log
        self._events = record.events
        self._clock = clock
        self._hooks = hooks
        self._publish = publish
        self._local_server_dir = service.local_server_dir
        self._failed_saves = 0  # reserved checkpoint saves failed in a row
        self._objective = self._open_objective(task)
        context = session.info.max_context
        if (
            is_env_task(task)
            and context is not None
            and config.environment.env_max_tokens > context
        ):
            log.info(
                "env_max_tokens",
                f"episodes stop at the model's context of {context} tokens "
                f"(--env-max-tokens {config.environment.env_max_tokens} is larger): "
                "outcome max_tokens",
            )
        self._raw_prompts = raw_prompts_warning(task, session.tokenizer)
        if self._raw_prompts is not None:
            log.warning("raw_prompts", self._raw_prompts)
        self._supervising = False
        self._said_all_empty = False
        self._initial: tuple[PendingCheckpoint, LoopState] | None = None
        """The step-0 checkpoint while it saves behind the first steps."""

    # -- the run -------------------------------------------------------------------

    async def run(self) -> RunResult:
        """Train every step, then the final checkpoint and the report. A stop the
        embedding code asked for (:class:`~engine.errors.StopRequested`) ends it after
        its stop checkpoint with a result; any other stop or error is raised (after the
        stop checkpoint)."""
        outcome = await self._supervise()
        if isinstance(outcome, CheckpointRecord | None):  # stopped by the caller
            no_report = await anyio.to_thread.run_sync(finished_run_report, self._run_record.path)
            if no_report is not None:
                self._log.info("report", no_report)
            final_path = outcome.sampler_path if outcome is not None else None
            if final_path is not None:
                self._log.saved(final_path)
            return RunResult(
                final_path=final_path,
                run_dir=self._run_record.path,
                steps_completed=len(self._run_record.steps),
                metrics=self._run_record.steps,
                stopped=True,
            )
        if outcome.exhausted:
            self._log.warning(
                "source_exhausted",
                f"the problem source ran out after {outcome.state.next_step} steps",
            )
        final = await self._checkpoint("final", outcome.state)
        assert final.sampler_path is not None
        no_report = await anyio.to_thread.run_sync(finished_run_report, self._run_record.path)
        if no_report is not None:
            self._log.info("report", no_report)
        self._log.saved(final.sampler_path)
        return RunResult(
            final_path=final.sampler_path,
            run_dir=self._run_record.path,
            steps_completed=outcome.state.next_step,
            metrics=self._run_record.steps,
            exhausted=outcome.exhausted,
        )

    async def stop_after_cancellation(self, stop: Exception) -> None:
        """The host cancelled the run: the stop checkpoint of :meth:`run`'s stops, when
        the run had started. Call it shielded."""
        if self._supervising:
            await self._stop_checkpoint(stop)

    async def _supervise(self) -> PipelineOutcome | CheckpointRecord | None:
        """Train to the end, recovering from unknown step outcomes; on a stop (signal,
        breaker, watchdog, failure) write a stop checkpoint if the state can be trusted,
        then raise the reason; a stop the caller asked for returns the checkpoint a
        resume would continue from (None: none) instead."""
        self._supervising = True
        gate = self.gate
        watchdog = Watchdog(
            self._config.pipeline.stall_timeout, clock=self._clock, log=self._events
        )
        outcome: PipelineOutcome | None = None
        failure: Exception | None = None
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._watch, watchdog)
            tg.start_soon(self._grace)
            with anyio.CancelScope() as scope:
                gate.attach(scope)
                try:
                    outcome = await self._train(watchdog)
                except Exception as exc:
                    leaf = primary_error(exc)
                    failure = leaf if isinstance(leaf, Exception) else exc
            tg.cancel_scope.cancel()
        if gate.reason is None and failure is None and outcome is not None:
            return outcome
        stop = gate.reason if gate.reason is not None else failure
        assert stop is not None
        left = self._tokens.unrecorded()
        if left != TokenCounts():  # in no step's metrics: kept here, not lost
            self._events.info(
                "tokens.unrecorded",
                **dataclasses.asdict(left),
                message="tokens billed by steps not recorded before the stop",
            )
        latest = await self._stop_checkpoint(stop)
        if isinstance(stop, StopRequested):
            return latest
        raise stop

    async def _watch(self, watchdog: Watchdog) -> None:
        try:
            await watchdog.run()
        except Stalled as exc:
            self.gate.request(exc)

    async def _grace(self) -> None:
        await self.gate.requested.wait()
        await anyio.sleep(STOP_GRACE_S)
        self.gate.force()

    async def _train(self, watchdog: Watchdog) -> PipelineOutcome:
        """The pipeline, started again from the latest checkpoint after each step of
        unknown outcome (same code path as resuming after a crash). Each start samples
        from the checkpoint's own sampler weights: no extra snapshot."""
        session, cfg, gate = self._session, self._config, self.gate
        resumed = self._run_record.resumed_from
        checkpoint: CheckpointRecord | None
        if resumed is not None:
            state, checkpoint = LoopState.from_dict(resumed.loop_state), resumed
        else:
            state, checkpoint = self._initial_state(), None
        self.state = state
        baseline = self._objective.evaluator if resumed is None else None
        fresh = resumed is None and cfg.model.init_from is None  # a new LoRA: its base's weights
        await self._objective.start()
        while True:
            before_training: Callable[[], Awaitable[None]] | None = None
            if checkpoint is None and fresh:
                # Step 0 samples from the base model at once; the step-0 checkpoint
                # (recovery's base) is reserved right before step 0's training calls, so
                # that both start the server's clock together, and is recorded before
                # any step.
                before_training = functools.partial(self._reserve_step_0_checkpoint, state)
                sampler = await session.open_base_sampler()
            else:
                if checkpoint is None or checkpoint.sampler_path is None:
                    checkpoint = await self._checkpoint("periodic", state)  # recovery's base
                assert checkpoint.sampler_path is not None
                sampler = await session.open_sampler(state.next_step, checkpoint.sampler_path)
            fresh = False
            watchdog.progress(f"sampler {state.next_step} ready")
            recipe = await self._objective.recipe(sampler, resumed is not None)
            if baseline is not None:
                await baseline(0, sampler)
                baseline = None
            source = self._task.source(
                cfg.task.seed, state.source_state if state.next_step else None
            )
            context = StageContext.start(
                cfg.pipeline,
                session,
                source,
                state,
                sampler,
                gate,
                progress=watchdog.progress,
                on_reward_error=self._reward_failed,
            )
            pipeline = Pipeline(
                context,
                recipe,
                self._on_step,
                learning_rate=cfg.training.learning_rate,
                checkpoint_due=cfg.checkpoint_due,
                evaluate=self._objective.evaluator,
                before_training=before_training,
            )
            try:
                return await pipeline.run()
            except Exception as exc:
                unknown = find_error(exc, StepOutcomeUnknown)
                if unknown is None or gate.reason is not None:
                    raise
            self._initial = None  # the abandoned client's, if still unsaved
            state, checkpoint = await self._recover()
            watchdog.progress(f"restored step {state.next_step}")

    def _open_objective(self, task: AnyTask) -> ObjectiveRun:
        """The run's objective (its plan and evaluator); the run record keeps the
        rollouts."""
        config, session, record, log = self._config, self._session, self._run_record, self._log
        objective = objective_named(config.training.objective)
        renderer = PromptRenderer(
            task,
            session.tokenizer,
            keep_stop_text=config.sampling.keep_stop_text,
            run_dir=record.path,
            session=session,
        )
        record.keep_rollouts(
            RolloutLog(
                record.path,
                config.logging.log_rollouts,
                renderer,
                supervised=objective.logs_conversations,
            )
        )
        return objective.open(
            RunContext(
                config,
                task,
                session,
                renderer,
                record.path,
                say=lambda line: log.info("eval", line),
                warn=lambda line: log.warning("reward_error", line),
                track=log.track,
                initial_sampler=self._initial_sampler,
                teacher=self._open_teacher,
            )
        )

    async def _open_teacher(self) -> Teacher:
        """``--teacher``'s sampler (``--objective distill``), checked once per run."""
        source = self._config.distillation.teacher
        assert source is not None, "the settings pair --objective distill with --teacher"
        weights = teacher_weights(source, self._local_server_dir)
        teacher = await open_teacher(self._session, source, weights)
        self._log.info("teacher", f"Teacher: {weights} (the student's tokenizer)")
        return teacher

    async def _initial_sampler(self) -> SamplerHandle:
        """A resumed run's initial weights (the reference of ``--objective dpo``): the
        sampler weights of its step-0 checkpoint."""
        initial = self._run_record.initial_checkpoint()
        if initial is None or initial.sampler_path is None:
            raise ConfigError(
                f"--objective {self._config.training.objective}: {self._run_record.path} has "
                "no step-0 checkpoint with sampler weights, the run's initial weights it "
                "scores against"
            )
        return await self._session.open_sampler(0, initial.sampler_path)

    async def _reserve_step_0_checkpoint(self, state: LoopState) -> None:
        pending = await self._session.submit_checkpoint(0, checkpoint_name(0))
        self._initial = (pending, state)

    def _reward_failed(self, error: RewardError) -> None:
        """Keep the reward's traceback in events.jsonl (the console shows one line; with
        ``--log-level debug`` the traceback too)."""
        self._events.info(
            "reward.failed", problem_id=error.problem.id, error=str(error), traceback=error.trace
        )
        if self._config.logging.log_level == "debug":
            self._log.warning("reward_traceback", f"{error}\n{error.trace.rstrip()}")

    def _initial_state(self) -> LoopState:
        return LoopState(0, self._task.source(self._config.task.seed).state(), 0)

    async def _recover(self) -> tuple[LoopState, CheckpointRecord | None]:
        """Restore the latest checkpoint after a step had an unknown outcome; rewind the
        run's record to it (the steps after it are redone). Returns the restored state
        and its checkpoint (None: none yet, a fresh LoRA client)."""
        assert self.state is not None
        latest = self._run_record.latest_checkpoint()
        plan = plan_recovery(latest, completed_steps=self.state.next_step, log=self._events)
        await self._session.restore(plan.state_path)
        self.gate.restored()
        self._run_record.rewind(plan.resume_step)
        state = (
            LoopState.from_dict(plan.loop_state)
            if plan.loop_state is not None
            else self._initial_state()
        )
        self.state = state
        return state, latest

    async def _on_step(self, result: StepResult) -> None:
        """Record a trained step (metrics, rollouts, warnings), checkpoint when due, run
        the hooks, publish it."""
        if self._initial is not None:
            # Before anything of the step: a run whose step-0 saves keep failing fails
            # here with no trained step recorded, as if the save had been awaited first.
            (initial, initial_state), self._initial = self._initial, None
            paths = await self._saved_paths(initial)
            if paths is not None:
                await self._record("periodic", *paths, initial_state)
        self.state = result.state
        for key, count in self._retries.take().items():
            result.metrics.setdefault(key, count)  # the run's own calls: restores, checkpoints
        result.metrics.update(token_metrics(*self._tokens.take(result.step), self._prices))
        result.metrics.update(self._queue.take())  # the server's sampling queue (408s)
        task_metrics = getattr(self._task, "metrics", None)  # e.g. a judge's cost so far
        if callable(task_metrics):
            for key, value in task_metrics().items():
                result.metrics.setdefault(key, value)
        self._run_record.append(result)
        dropped = result.metrics.get("dropped/missing_logprobs", 0)
        if dropped:
            self._log.warning(
                "missing_logprobs",
                f"step {result.step}: dropped {dropped} responses that came without sampler "
                "logprobs (--on-missing-logprobs drop)",
            )
        if result.metrics.get("response_len/empty_frac") == 1.0 and not self._said_all_empty:
            self._said_all_empty = True
            raw = self._raw_prompts is not None
            self._log.warning("empty_responses", all_empty_warning(result.step, raw))
        for group in result.groups:
            if group.too_long is not None:
                self._log.warning(
                    "prompt_too_long",
                    f"step {result.step}: {group.too_long}; the group was left out of the step",
                )
            if group.reward_error is not None:
                self._log.warning(
                    "reward_error",
                    f"step {result.step}: {group.reward_error}; the group was left out of "
                    "the step (--on-reward-error skip)",
                )
        episodes = [t for g in result.groups for t in g.trajectories]
        failed = failed_episodes_warning(result.step, episodes)
        if failed is not None:
            first = episodes[0].error
            self._events.warning(
                "step.episodes_failed", step=result.step, first_error=first, message=failed
            )
        idle = no_training_warning(self._run_record.steps)
        if idle is not None:
            self._events.warning("run.no_training", step=result.step, message=idle)
        untooled = no_tool_calls_warning(self._run_record.steps)
        if untooled is not None:
            self._events.warning("run.no_tool_calls", step=result.step, message=untooled)
        if result.checkpoint is not None:
            await self._record_saved(result.checkpoint, result.state)
        for hook in self._hooks:
            value = hook(result)
            if inspect.isawaitable(value):
                await value
        await self._publish(result)

    # -- checkpoints -----------------------------------------------------------------

    async def _checkpoint(self, reason: CheckpointReason, state: LoopState) -> CheckpointRecord:
        """save_state + sampler weights (retried), then a durable record of both with
        the loop state. The final one's sampler is the run's ``Saved:`` path."""
        step = state.next_step
        if reason == "final":
            names = ("final", f"{self._task.name}-final")
        else:
            names = (checkpoint_name(step), checkpoint_name(step))
        state_path, sampler_path = await self._session.save_checkpoint(*names)
        return await self._record(reason, state_path, sampler_path, state)

    async def _record_saved(self, pending: PendingCheckpoint, state: LoopState) -> None:
        """Record a checkpoint submitted behind a step once it is saved; when saves
        keep failing, stop the run after the steps in flight."""
        try:
            paths = await self._saved_paths(pending)
        except Exception as exc:
            self.gate.request(exc)
            return
        if paths is not None:
            await self._record("periodic", *paths, state)

    async def _saved_paths(self, pending: PendingCheckpoint) -> tuple[str, str] | None:
        """The paths of a reserved checkpoint once saved, or None when its save failed:
        it is not recorded and the run goes on from the latest recorded checkpoint (a
        recovery redoes the steps since, each once; with none, from a fresh LoRA). The
        save cannot be retried in place (the model's sequence has moved on), so the
        --max-consecutive-failures-th failed save in a row raises."""
        try:
            paths = await self._session.finish_checkpoint(pending)
        except Exception as exc:
            self._failed_saves += 1
            if self._failed_saves >= self._config.session.max_consecutive_failures:
                raise
            message = (
                f"the checkpoint of step {pending.step} was not saved "
                f"({format_error(exc)[7:]}); the run goes on and the latest recorded "
                "checkpoint stands"
            )
            self._events.warning("checkpoint.failed", step=pending.step, error=message)
            self._log.warning("checkpoint_failed", message)
            return None
        self._failed_saves = 0
        return paths

    async def _record(
        self, reason: CheckpointReason, state_path: str, sampler_path: str, state: LoopState
    ) -> CheckpointRecord:
        record = CheckpointRecord(
            step=state.next_step,
            state_path=state_path,
            sampler_path=sampler_path,
            reason=reason,
            loop_state=state.to_dict(),
        )
        await self._run_record.add_checkpoint(record)
        return record

    async def _stop_checkpoint(self, stop: Exception) -> CheckpointRecord | None:
        """One bounded save_state attempt when the state holds exactly the completed
        steps; otherwise (a step in flight or of unknown outcome) the latest checkpoint
        stands. Either way, say where a resume would continue, and return that
        checkpoint (None: none)."""
        reason: CheckpointReason = stop.reason if isinstance(stop, RunStopped) else "error"
        state = self.state
        saved: CheckpointRecord | None = None
        note = ""
        if state is not None and self.gate.clean:
            limit = min(self._config.session.request_timeout, _STOP_CHECKPOINT_MAX_S)
            try:
                name = f"{reason}-step-{state.next_step}"
                with anyio.CancelScope(shield=True):
                    paths = await self._session.save_checkpoint(name, name, once_within=limit)
                    saved = await self._record(reason, *paths, state)
            except Exception as exc:
                note = f"the {reason} checkpoint failed ({format_error(exc)[7:]}); "
        else:
            note = "a step was in flight or of unknown outcome, so no new checkpoint; "
        run_dir = self._run_record.path
        latest = saved or self._run_record.latest_checkpoint()
        where = (
            f"resume from step {latest.step} with: python -m engine.run --resume {run_dir}"
            if latest is not None
            else "no checkpoint to resume from"
        )
        self._run_record.stop(reason, checkpoint=latest, written=saved is not None)
        self._events.warning(
            "run.stopped",
            reason=reason,
            error=format_error(stop)[7:],
            checkpoint_step=latest.step if latest is not None else None,
            message=f"run stopped ({reason}): {note}{where}",
        )
        return latest


def all_empty_warning(step: int, raw_prompts: bool = False) -> str:
    """What a step whose responses were all empty says (once per run); ``raw_prompts``:
    a dataset's string prompts went raw to a model with a chat template."""
    return (
        f"step {step}: every response was empty: the model likely cannot answer this "
        "prompt format (the packaged model answers only the quickstart's 'Question: What "
        "is A + B?\\nAnswer:' prompts; docs/export-and-eval.md says which model suits "
        "which task)"
        + (
            "; the string prompts were sent raw: --task-arg chat=true sends them through "
            "the model's chat template"
            if raw_prompts
            else ""
        )
    )
