"""The embeddable engine: run the RL loop from inside another asyncio (anyio) service.

    async with Engine(EngineConfig(steps=4), task=MyTask()) as engine:
        async for step in engine.steps():     # or: result = await engine.run()
            print(step.line)

Why a context manager with its own task group: the pipeline runs as a child of the
``async with`` block, so it can never outlive it -- leaving the block (normally, by an
exception, or because the host task was cancelled mid-step) cancels the pipeline,
closes the session and stops a local server before ``__aexit__`` returns. The engine
keeps no module-level state and installs no signal handlers (the CLI calls
:meth:`Engine.request_stop` on SIGINT/SIGTERM); its loggers are its own (see
:mod:`engine.metrics` and :mod:`engine.events`).

Reliability, all in :meth:`Engine._supervise`:

* **Checkpoints** (``<run dir>/checkpoints.jsonl``): ``step-0`` before the first step,
  every ``--checkpoint-every`` steps (awaited by the trainer right after the step, so the
  saved state holds exactly that many optimizer steps), a ``final`` one, and a stop
  checkpoint (``interrupt``/``breaker``/``watchdog``/``error``) when a run stops between
  steps. Each record carries the loop state (data cursor, RNG, consumed problem ids,
  scored-but-untrained groups).
* **Exactly-once steps**: a step whose outcome is unknown makes the engine restore the
  latest checkpoint on a new training client, rewind ``metrics.jsonl`` and redo the steps
  after it (:mod:`engine.recovery`); the breaker bounds how often in a row.
* **Stops**: the breaker, the watchdog, a failed sample/reward and ``request_stop`` all
  end the run at a step boundary (:class:`~engine.stopping.StopGate`), write a stop
  checkpoint when the state can be trusted, and raise the reason.
* **Resume** (``config.resume``): the run dir's latest checkpoint is loaded (weights,
  optimizer, loop state), ``metrics.jsonl`` is cut back to it and the run continues with
  the same problem sequence and step numbers. A local server keeps its checkpoints in
  ``<run dir>/local-server`` so a new process can load them after a crash.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

import anyio
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from engine.checkpoint import (
    LOCAL_SERVER_DIR,
    CheckpointLog,
    CheckpointReason,
    CheckpointRecord,
    ResumeState,
    check_writable,
    load_resume_state,
    prepare_run_dir,
    write_config,
    write_file_atomically,
)
from engine.config import EngineConfig, stored_profile
from engine.errors import (
    ConfigError,
    Interrupted,
    NoCheckpointYet,
    ResumeError,
    RunFileError,
    RunStopped,
    Stalled,
    StepOutcomeUnknown,
    find_error,
    format_error,
    primary_error,
)
from engine.evaluation import Evaluator, eval_problems_of
from engine.events import EventLog, describe
from engine.metrics import RunLog
from engine.pipeline import Pipeline, PipelineOutcome
from engine.recovery import plan_recovery
from engine.redact import redact_config
from engine.report import REPORT_PNG, finished_run_report
from engine.results import RunResult, StepResult
from engine.retry import OpKind, RetryCounter, RetryPolicy, ServiceGuard
from engine.rollouts import RolloutLog
from engine.scoring import Scorer, parse_score_workers
from engine.service import MintSession, local_server_profile, open_session
from engine.state import LoopState
from engine.stopping import StopGate
from engine.tasks import Task, load_task
from engine.tasks.arithmetic import ARITHMETIC_ARGS
from engine.tasks.loader import task_spec
from engine.tasks.render import PromptRenderer
from engine.trackers import open_trackers
from engine.watchdog import LOOP_CLOCK, CircuitBreaker, Clock, Watchdog

__all__ = ["LOCAL_SERVER_DIR", "STOP_GRACE_S", "Engine", "StepHook"]

StepHook = Callable[[StepResult], Awaitable[None] | None]
"""Called after every trained step, on the trainer's path: keep it quick. After a
recovery the redone steps are reported again (same step numbers)."""

STOP_GRACE_S = 30.0
"""How long a stop waits for the step in flight to finish before cancelling it (the
state is then untrusted: no stop checkpoint, the previous one stands)."""

_STOP_CHECKPOINT_MAX_S = 120.0


class Engine:
    """One RL run. Construct, enter with ``async with``, then either ``await run()`` or
    iterate ``steps()`` (not both). ``console`` receives the readable output (None: quiet;
    metrics.jsonl is written either way). ``clock`` is the time of the reliability timers
    (request deadlines, the watchdog, server liveness); tests pass a manual one."""

    def __init__(
        self,
        config: EngineConfig,
        task: Task | None = None,
        *,
        on_step: StepHook | Sequence[StepHook] = (),
        console: TextIO | None = None,
        clock: Clock = LOOP_CLOCK,
    ) -> None:
        if not config.local and not config.api_key:
            raise ConfigError(
                "EngineConfig has no api_key and local=False: pass api_key (or build it with "
                "EngineConfig.from_env(), which reads MINT_API_KEY), or local=True to start "
                "the local MinT server in this process"
            )
        # config.json records the spec and arguments that rebuild the task (also one
        # passed as an object), so --resume works alike from the CLI and when embedded.
        if task is not None:
            spec, args = task_spec(task, config.task, config.task_args)
            # The object carries its own settings: the arithmetic aliases are moot.
            config = dataclasses.replace(
                config, task=spec, task_args=args, op=None, min_operand=None, max_operand=None
            )
        if config.resume is not None:
            # A resumed run keeps the settings it was started with unless given anew.
            config = config.resolved(stored_profile(_stored_config(config.resume)))
        if config.uses_local_server:
            # What the server started here will recommend, known before it starts.
            config = config.resolved(local_server_profile(config.local_model))
        # The rest is resolved once connected (open_session), before anything trains.
        self._config = config.resolved()
        self._task = task
        if not set(self._config.unresolved) & set(ARITHMETIC_ARGS):
            self._load_task()
        self._clock = clock
        self._hooks: list[StepHook] = [on_step] if callable(on_step) else list(on_step)
        self._console = console
        self._resources = contextlib.AsyncExitStack()
        self._tg: TaskGroup | None = None
        self._send: MemoryObjectSendStream[StepResult] | None = None
        self._recv: MemoryObjectReceiveStream[StepResult] | None = None
        self._session: MintSession | None = None
        self._log: RunLog | None = None
        self._events: EventLog | None = None
        self._run_dir: Path | None = None
        self._resumed: ResumeState | None = None
        self._started = False
        self._consumed = False
        self._result: RunResult | None = None
        self._error: BaseException | None = None
        self._state: LoopState | None = None
        self._metrics: list[dict[str, Any]] = []
        self._started_at = 0.0
        self._gate: StopGate | None = None
        self._pending_stop: Exception | None = None
        self._stopped: dict[str, Any] | None = None
        self._early_events = _HeldEvents()
        self._renderer: PromptRenderer | None = None
        self._rollouts: RolloutLog | None = None
        self._evaluator: Evaluator | None = None

    # -- public --------------------------------------------------------------------

    @property
    def config(self) -> EngineConfig:
        """The resolved configuration: the server's defaults filled in (by a remote
        server, once the engine is entered)."""
        return self._config

    @property
    def task(self) -> Task:
        if self._task is None:
            raise RuntimeError(
                "the task is loaded once the server's defaults are known (the engine is entered)"
            )
        return self._task

    @property
    def run_dir(self) -> Path:
        if self._run_dir is None:
            raise RuntimeError("the run directory exists once the engine is entered")
        return self._run_dir

    @property
    def state(self) -> LoopState | None:
        """The loop state after the latest trained step (the initial or resumed state
        before the first)."""
        return self._state

    @property
    def session(self) -> MintSession:
        """The connected session (its ``model_id`` changes when a checkpoint is
        restored)."""
        if self._session is None:
            raise RuntimeError("the session exists once the engine is entered")
        return self._session

    def add_step_hook(self, hook: StepHook) -> None:
        self._hooks.append(hook)

    def request_stop(self, reason: Exception | None = None) -> None:
        """Stop the run gracefully (SIGINT/SIGTERM in the CLI): at once when no step is in
        flight, else after the step in flight (at most ``STOP_GRACE_S`` later); then a
        stop checkpoint is written and ``run()``/``steps()`` raise ``reason`` (default
        :class:`~engine.errors.Interrupted`, exit code 130). Safe to call from the
        engine's event loop at any time, also before the run starts."""
        reason = reason if reason is not None else Interrupted()
        if self._events is not None:
            self._events.warning(
                "stop.requested",
                error=str(reason),
                message=f"{reason} (after the step in flight; a second signal exits at once)"
                if isinstance(reason, Interrupted)
                else f"stop requested: {reason}",
            )
        if self._gate is not None:
            self._gate.request(reason)
        elif self._pending_stop is None:
            self._pending_stop = reason

    async def steps(self) -> AsyncIterator[StepResult]:
        """Start the run and yield each step as it is trained. Raises the run's error,
        if any, after the last step it completed."""
        if self._consumed:
            raise RuntimeError("an Engine runs once: steps()/run() was already called")
        self._consumed = True
        recv = self._start()
        async with recv:
            async for step in recv:
                yield step
        if self._error is not None:
            raise self._error

    async def run(self) -> RunResult:
        """Run every step; return the final sampler path and the metrics."""
        async for _ in self.steps():
            pass
        assert self._result is not None
        return self._result

    # -- lifecycle -----------------------------------------------------------------

    async def __aenter__(self) -> Engine:
        self._started_at = time.perf_counter()
        try:
            await self._open()
        except BaseException as exc:
            if self._run_dir is not None and isinstance(exc, Exception):
                self._write_final_summary(primary_error(exc))
            await self._resources.aclose()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if self._tg is not None:
                self._tg.cancel_scope.cancel()
                # The body's own exception (e.g. the run's error re-raised by run())
                # keeps propagating as itself; only the children's errors (none: _drive
                # keeps its errors) would come out of the group.
                await self._tg.__aexit__(None, None, None)
        finally:
            self._tg = None
            # Not under a shield of ours: the resources (a local server's task group)
            # were entered before any such scope, and anyio scopes must nest. Each
            # resource shields its own shutdown.
            await self._resources.aclose()

    async def _open(self) -> None:
        cfg = self._config
        if cfg.resume is not None:
            self._resumed = self._check_resume(cfg.resume)
            self._run_dir = cfg.resume
        else:
            self._run_dir = _make_run_dir(cfg.run_dir, self._task_name, self._early_events)
        self._write_config()
        trackers = open_trackers(cfg.log_to, self._run_dir, self._config_record())
        log = RunLog(self._run_dir / "metrics.jsonl", self._console, cfg.log_format, trackers)
        self._log = log
        self._resources.callback(log.close)
        events = EventLog(
            self._run_dir,
            console=lambda level, event, fields: log.warning(event, describe(event, fields)),
        )
        self._events = events
        self._resources.callback(events.close)
        self._early_events.replay(events)
        if self._resumed is not None:
            self._load_resumed_metrics(self._resumed)
        if cfg.max_steps_off_policy >= 1 and cfg.loss == "importance_sampling":
            log.warning(
                "off_policy_loss",
                f"--max-steps-off-policy {cfg.max_steps_off_policy} with the unclipped "
                "importance_sampling loss: a clipped loss (--loss ppo) is safer off-policy",
            )
        guard = ServiceGuard(
            policies=_policies(cfg),
            counter=RetryCounter(),
            breaker=CircuitBreaker(cfg.max_consecutive_failures, log=events),
            log=events,
            clock=self._clock,
            unreachable_after=cfg.unreachable_timeout,
        )
        self._session = await self._resources.enter_async_context(
            open_session(
                cfg,
                say=lambda line: log.info("console", line),
                guard=guard,
                local_data_dir=self._run_dir / LOCAL_SERVER_DIR,
                restore_from=(
                    self._resumed.checkpoint.state_path if self._resumed is not None else None
                ),
            )
        )
        if self._session.config != self._config:  # the server decided what was left unset
            self._config = self._session.config
            if self._task is None:
                self._load_task()
            self._write_config()
        self._open_task_outputs(log)
        send, recv = anyio.create_memory_object_stream[StepResult](max(1, cfg.steps))
        self._send, self._recv = send, recv
        self._resources.callback(send.close)
        self._resources.callback(recv.close)
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg

    def _load_task(self) -> None:
        """Load the task (unless one was given) from the config's spec and arguments,
        and record the spec and arguments that rebuild it."""
        cfg = self._config
        task = self._task if self._task is not None else load_task(cfg.task, cfg.task_args)
        spec, args = task_spec(task, cfg.task, cfg.task_args)
        self._task = task
        self._config = dataclasses.replace(cfg, task=spec, task_args=args)
        if cfg.eval_every:
            eval_problems_of(task)  # a task without held-out problems: ConfigError now

    @property
    def _task_name(self) -> str:
        """The task's name; its spec while the server still decides its arguments."""
        return self._task.name if self._task is not None else self._config.task

    def _open_task_outputs(self, log: RunLog) -> None:
        """The task's renderer (its setup sees the served tokenizer), rollouts.jsonl and
        the held-out evaluator, each cut back to the checkpoint on resume."""
        assert self._session is not None
        cfg = self._config
        self._renderer = PromptRenderer(self.task, self._session.tokenizer)
        self._rollouts = RolloutLog(self.run_dir, cfg.log_rollouts, self._renderer)
        if cfg.eval_every:
            self._evaluator = Evaluator(
                self._session,
                self.task,
                self._renderer,
                Scorer(
                    self.task,
                    concurrency=cfg.score_concurrency,
                    workers=parse_score_workers(cfg.score_workers),
                ),
                self.run_dir,
                every=cfg.eval_every,
                last_step=cfg.steps,
                max_tokens=cfg.max_tokens,
                stop_at_eos=cfg.stop_at_eos,
                concurrency=cfg.concurrency,
                on_reward_error=cfg.on_reward_error,
                say=lambda line: log.info("eval", line),
                warn=lambda line: log.warning("reward_error", line),
            )
        if self._resumed is not None:
            self._rollouts.rewind(self._resumed.step)
            if self._evaluator is not None:
                self._evaluator.rewind(self._resumed.step)

    def _check_resume(self, run_dir: Path) -> ResumeState | None:
        """The run dir's stored config and latest checkpoint; a ResumeError (exit 2)
        when the current config differs in a setting that must not change. None when
        the dir holds only an unfinished start-up: the run starts over in it."""
        self._early_events = _HeldEvents()  # events.jsonl is opened once the dir checks out
        try:
            resumed = load_resume_state(
                run_dir, current_config=self._config_record(), log=self._early_events
            )
        except NoCheckpointYet:
            prepare_run_dir(run_dir)
            _note_restart(self._early_events, run_dir, "--resume")
            return None
        check_writable(run_dir)
        if resumed.step > self._config.steps:
            raise ResumeError(
                f"cannot resume {run_dir}: its latest checkpoint is at step {resumed.step}, "
                f"beyond --steps {self._config.steps}"
            )
        return resumed

    def _load_resumed_metrics(self, resumed: ResumeState) -> None:
        """Cut metrics.jsonl back to the checkpoint (the steps after it are redone) and
        keep the earlier steps for the summary."""
        path = self.run_dir / "metrics.jsonl"
        assert self._log is not None
        self._log.rewind(resumed.step, log=self._events)
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                data = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(data, dict) and isinstance(data.get("step"), int):
                self._metrics.append(data)
        assert self._events is not None
        self._events.info("resume", step=resumed.step, state_path=resumed.checkpoint.state_path)

    def _start(self) -> MemoryObjectReceiveStream[StepResult]:
        if self._tg is None or self._recv is None:
            raise RuntimeError("use the Engine inside 'async with Engine(...) as engine:'")
        if not self._started:
            self._started = True
            self._tg.start_soon(self._drive)
        return self._recv

    # -- the run -------------------------------------------------------------------

    async def _drive(self) -> None:
        """The run, as a child of the engine's task group. Errors are kept and raised to
        the consumer of steps()/run(), not to the task that entered the engine."""
        assert self._send is not None and self._log is not None
        log = self._log
        try:
            async with self._send:
                outcome = await self._supervise()
                if outcome.exhausted:
                    log.warning(
                        "source_exhausted",
                        f"the problem source ran out after {outcome.state.next_step} steps",
                    )
                final = await self._checkpoint("final", outcome.state)
                assert final.sampler_path is not None
                path = final.sampler_path
                no_report = await anyio.to_thread.run_sync(finished_run_report, self.run_dir)
                if no_report is not None:
                    log.info("report", no_report)
                log.saved(path)
                self._result = RunResult(
                    final_path=path,
                    run_dir=self.run_dir,
                    steps_completed=outcome.state.next_step,
                    metrics=tuple(self._metrics),
                    exhausted=outcome.exhausted,
                )
                self._write_summary(None)
        except Exception as exc:
            self._error = primary_error(exc)
            self._write_final_summary(self._error)
        except anyio.get_cancelled_exc_class():
            # The host cancelled the task running the engine: still leave a readable
            # run dir (an interrupt checkpoint when no step was in flight, a summary).
            with anyio.CancelScope(shield=True):
                self._error = Interrupted("cancellation of the host task")
                if self._gate is not None and self._session is not None:
                    await self._stop_checkpoint(self._error, self._gate)
                self._write_final_summary(self._error)
            raise

    async def _supervise(self) -> PipelineOutcome:
        """Train to the end, recovering from unknown step outcomes; on a stop (signal,
        breaker, watchdog, failure) write a stop checkpoint if the state can be trusted,
        then raise the reason."""
        cfg = self._config
        assert self._events is not None
        gate = StopGate()
        self._gate = gate
        if self._pending_stop is not None:
            gate.request(self._pending_stop)
        watchdog = Watchdog(cfg.stall_timeout, clock=self._clock, log=self._events)
        outcome: PipelineOutcome | None = None
        failure: Exception | None = None
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._watch, watchdog, gate)
            tg.start_soon(self._grace, gate)
            with anyio.CancelScope() as scope:
                gate.attach(scope)
                try:
                    outcome = await self._train(gate, watchdog)
                except Exception as exc:
                    leaf = primary_error(exc)
                    failure = leaf if isinstance(leaf, Exception) else exc
            tg.cancel_scope.cancel()
        if gate.reason is None and failure is None and outcome is not None:
            return outcome
        stop = gate.reason if gate.reason is not None else failure
        assert stop is not None
        await self._stop_checkpoint(stop, gate)
        raise stop

    async def _watch(self, watchdog: Watchdog, gate: StopGate) -> None:
        try:
            await watchdog.run()
        except Stalled as exc:
            gate.request(exc)

    async def _grace(self, gate: StopGate) -> None:
        await gate.requested.wait()
        await anyio.sleep(STOP_GRACE_S)
        gate.force()

    async def _train(self, gate: StopGate, watchdog: Watchdog) -> PipelineOutcome:
        """The pipeline, started again from the latest checkpoint after each step of
        unknown outcome (same code path as resuming after a crash). Each start samples
        from the checkpoint's own sampler weights: no extra snapshot."""
        assert self._session is not None and self._events is not None
        session, cfg = self._session, self._config
        if self._resumed is not None:
            state = LoopState.from_dict(self._resumed.loop_state)
            checkpoint: CheckpointRecord | None = self._resumed.checkpoint
        else:
            state, checkpoint = self._initial_state(), None
        self._state = state
        baseline = self._evaluator if self._resumed is None else None
        while True:
            if checkpoint is None or checkpoint.sampler_path is None:
                checkpoint = await self._checkpoint("periodic", state)  # recovery's base
            assert checkpoint.sampler_path is not None
            sampler = await session.open_sampler(state.next_step, checkpoint.sampler_path)
            watchdog.progress(f"sampler {state.next_step} ready")
            if baseline is not None:
                await baseline(0, sampler)
                baseline = None
            source = self.task.source(cfg.seed, state.source_state if state.next_step else None)
            pipeline = Pipeline(
                cfg,
                self.task,
                session,
                source,
                state,
                sampler,
                self._on_step,
                gate=gate,
                progress=watchdog.progress,
                renderer=self._renderer,
                evaluate=self._evaluator,
            )
            try:
                return await pipeline.run()
            except Exception as exc:
                unknown = find_error(exc, StepOutcomeUnknown)
                if unknown is None or gate.reason is not None:
                    raise
            state, checkpoint = await self._recover(unknown, gate)
            watchdog.progress(f"restored step {state.next_step}")

    def _initial_state(self) -> LoopState:
        return LoopState(0, self.task.source(self._config.seed).state(), 0)

    async def _recover(
        self, unknown: StepOutcomeUnknown, gate: StopGate
    ) -> tuple[LoopState, CheckpointRecord | None]:
        """Restore the latest checkpoint after step ``unknown.step`` had an unknown
        outcome; rewind the metrics of the steps that will be redone. Returns the
        restored state and its checkpoint (None: none yet, a fresh LoRA client)."""
        assert self._session is not None and self._log is not None
        assert self._state is not None
        completed = self._state.next_step
        latest = CheckpointLog(self.run_dir, log=self._events).latest()
        plan = plan_recovery(latest, completed_steps=completed, log=self._events)
        await self._session.restore(plan.state_path)
        gate.restored()
        if plan.redo_steps:
            self._log.rewind(plan.resume_step, log=self._events)
            if self._rollouts is not None:
                self._rollouts.rewind(plan.resume_step)
            if self._evaluator is not None:
                self._evaluator.rewind(plan.resume_step)
            self._metrics = [m for m in self._metrics if m["step"] <= plan.resume_step]
        state = (
            LoopState.from_dict(plan.loop_state)
            if plan.loop_state is not None
            else self._initial_state()
        )
        self._state = state
        return state, latest

    async def _on_step(self, result: StepResult) -> None:
        assert self._log is not None and self._send is not None
        self._state = result.state
        for key, count in self.session.retries.take().items():
            result.metrics.setdefault(key, count)  # the run's own calls: restores, checkpoints
        self._metrics.append(result.metrics)
        self._log.step(result.metrics, result.line)
        if self._rollouts is not None:
            self._rollouts.write(result)
        dropped = result.metrics["dropped/missing_logprobs"]
        if dropped:
            self._log.warning(
                "missing_logprobs",
                f"step {result.step}: dropped {dropped} responses that came without sampler "
                "logprobs (--on-missing-logprobs drop)",
            )
        for group in result.groups:
            if group.reward_error is not None:
                self._log.warning(
                    "reward_error",
                    f"step {result.step}: {group.reward_error}; the group was left out of "
                    "the step (--on-reward-error skip)",
                )
        if self._config.checkpoint_due(result.step):
            try:
                await self._checkpoint("periodic", result.state)
            except Exception as exc:
                assert self._gate is not None
                self._gate.request(exc)  # the step is trained and logged: stop after it
        for hook in self._hooks:
            value = hook(result)
            if inspect.isawaitable(value):
                await value
        await self._send.send(result)

    # -- checkpoints -----------------------------------------------------------------

    async def _checkpoint(self, reason: CheckpointReason, state: LoopState) -> CheckpointRecord:
        """save_state + sampler weights (retried), then a durable record of both with
        the loop state. The final one's sampler is the run's ``Saved:`` path."""
        assert self._session is not None
        step = state.next_step
        if reason == "final":
            names = ("final", f"{self.task.name}-final")
        else:
            names = (f"step-{step}", f"step-{step}")
        state_path, sampler_path = await self._session.save_checkpoint(*names)
        return await self._record(reason, state_path, sampler_path, state)

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
        await CheckpointLog(self.run_dir, log=self._events).aappend(record)
        return record

    async def _stop_checkpoint(self, stop: Exception, gate: StopGate) -> None:
        """One bounded save_state attempt when the state holds exactly the completed
        steps; otherwise (a step in flight or of unknown outcome) the latest checkpoint
        stands. Either way, say where a resume would continue."""
        assert self._session is not None and self._events is not None
        reason: CheckpointReason = stop.reason if isinstance(stop, RunStopped) else "error"
        state = self._state
        saved: CheckpointRecord | None = None
        note = ""
        if state is not None and gate.clean:
            limit = min(self._config.request_timeout, _STOP_CHECKPOINT_MAX_S)
            try:
                name = f"{reason}-step-{state.next_step}"
                with anyio.CancelScope(shield=True):
                    paths = await self._session.save_checkpoint(name, name, once_within=limit)
                    saved = await self._record(reason, *paths, state)
            except Exception as exc:
                note = f"the {reason} checkpoint failed ({format_error(exc)[7:]}); "
        else:
            note = "a step was in flight or of unknown outcome, so no new checkpoint; "
        latest = saved or CheckpointLog(self.run_dir, log=self._events).latest()
        where = (
            f"resume from step {latest.step} with: python -m engine.run --resume {self.run_dir}"
            if latest is not None
            else "no checkpoint to resume from"
        )
        self._stopped = {
            "reason": reason,
            "checkpoint_step": latest.step if latest is not None else None,
            "checkpoint_written": saved is not None,
        }
        self._events.warning(
            "run.stopped",
            reason=reason,
            error=format_error(stop)[7:],
            checkpoint_step=latest.step if latest is not None else None,
            message=f"run stopped ({reason}): {note}{where}",
        )

    # -- files ---------------------------------------------------------------------

    def _config_record(self) -> dict[str, Any]:
        return {
            **self._config.public_dict(),
            "task_repr": repr(self._task),
            "task_name": self._task_name,
        }

    def _write_config(self) -> None:
        write_config(self.run_dir, self._config_record())

    def _write_final_summary(self, error: BaseException) -> None:
        """The summary of a failed run; a failure to write it is logged, never raised
        over the run's own error."""
        try:
            self._write_summary(error)
        except RunFileError as exc:
            if self._events is not None:
                with contextlib.suppress(RunFileError):  # the same full disk
                    self._events.error("summary.failed", error=str(exc))

    def _write_summary(self, error: BaseException | None) -> None:
        metrics = self._metrics
        first, last = (metrics[0], metrics[-1]) if metrics else ({}, {})
        counter = self._session.retries.totals() if self._session is not None else {}
        summary: dict[str, Any] = {
            "status": _status(error),
            "error": str(error) if error else None,
            "stopped": self._stopped,
            "task": self._task_name,
            "base_model": self._config.base_model,
            "server": self._config.public_dict()["server"],
            "steps_planned": self._config.steps,
            "steps_completed": len(metrics),
            "resumed_from_step": self._resumed.step if self._resumed is not None else None,
            "max_steps_off_policy": self._config.max_steps_off_policy,
            "loss": self._config.loss,
            "first_avg_reward": first.get("avg_reward"),
            "last_avg_reward": last.get("avg_reward"),
            "best_avg_reward": max((m["avg_reward"] for m in metrics), default=None),
            "max_staleness": max((m["off_policy/staleness"] for m in metrics), default=None),
            "retries": counter,
            "seconds": round(time.perf_counter() - self._started_at, 3),
            "final_path": self._result.final_path if self._result else None,
        }
        summary = redact_config(summary)
        text = json.dumps(summary, indent=2, sort_keys=True, default=str) + "\n"
        write_file_atomically(self.run_dir / "summary.json", text.encode())
        summary.update(report=(self.run_dir / REPORT_PNG).exists(), run_dir=self.run_dir)
        markdown = _summary_markdown(summary, metrics)
        write_file_atomically(self.run_dir / "summary.md", markdown.encode())


class _HeldEvents:
    """Events logged before events.jsonl exists, replayed into it once it does."""

    def __init__(self) -> None:
        self._held: list[tuple[str, str, dict[str, Any]]] = []

    def info(self, event: str, **fields: Any) -> None:
        self._held.append(("info", event, fields))

    def warning(self, event: str, **fields: Any) -> None:
        self._held.append(("warning", event, fields))

    def error(self, event: str, **fields: Any) -> None:
        self._held.append(("error", event, fields))

    def replay(self, target: EventLog) -> None:
        for level, event, fields in self._held:
            getattr(target, level)(event, **fields)
        self._held.clear()


def _status(error: BaseException | None) -> str:
    """finished | interrupted (SIGINT/SIGTERM) | stopped (breaker, watchdog) | failed."""
    if error is None:
        return "finished"
    if isinstance(error, Interrupted):
        return "interrupted"
    return "stopped" if isinstance(error, RunStopped) else "failed"


def _policies(cfg: EngineConfig) -> dict[OpKind, RetryPolicy]:
    """The retry policy of each kind of call, from the run's knobs."""
    base = RetryPolicy(
        max_attempts=cfg.retry_attempts,
        initial_wait=cfg.retry_backoff,
        max_wait=max(30.0, cfg.retry_backoff),
        jitter=cfg.retry_backoff,
        attempt_timeout=cfg.request_timeout,
    )
    policies = {kind: base for kind in OpKind}
    policies[OpKind.TRAIN_STEP] = base.scaled(max_attempts=1)
    return policies


def _stored_config(run_dir: Path) -> Mapping[str, Any]:
    """The run dir's config.json, or nothing when it cannot be read (resuming then
    fails with the reason)."""
    try:
        data = json.loads((run_dir / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, Mapping) else {}


def _summary_markdown(s: dict[str, Any], metrics: list[dict[str, Any]]) -> str:
    def num(v: Any) -> str:
        return "n/a" if v is None else f"{v:.3f}"

    lines = [
        f"# Run summary: {s['task']} on {s['base_model']}",
        "",
        f"- status: **{s['status']}**" + (f" -- {s['error']}" if s["error"] else ""),
        f"- server: {s['server']}; loss: {s['loss']}; "
        f"max steps off-policy: {s['max_steps_off_policy']}",
        f"- steps: {s['steps_completed']} of {s['steps_planned']} in {s['seconds']:.1f}s",
        f"- avg reward: first {num(s['first_avg_reward'])}, last {num(s['last_avg_reward'])}, "
        f"best {num(s['best_avg_reward'])}",
        f"- max staleness: {s['max_staleness']}",
        f"- final sampler: {s['final_path'] or 'not saved'}",
        f"- report: ![report]({REPORT_PNG})"
        if s["report"]
        else f"- report: `python -m engine.report {s['run_dir']}` draws it",
        "",
        "| step | avg_reward | datums | staleness | kl_v1 | time/step (s) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for m in metrics:
        kl = m.get("optim/kl_sample_train_v1")
        lines.append(
            f"| {m['step']} | {m['avg_reward']:.3f} | {m['datums']} | "
            f"{m['off_policy/staleness']} | {'n/a' if kl is None else f'{kl:+.4f}'} | "
            f"{m['time/step']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def _note_restart(events: _HeldEvents, run_dir: Path, how: str) -> None:
    events.warning(
        "run_dir.restarted",
        run_dir=str(run_dir),
        message=f"{run_dir} held only an unfinished start-up (no checkpoint, no trained "
        f"step): {how} starts the run over in it from step 0",
    )


def _make_run_dir(configured: Path | None, task_name: str, events: _HeldEvents) -> Path:
    """``configured`` (see :func:`engine.checkpoint.prepare_run_dir`), else a fresh
    ``runs/<timestamp>-<task>`` under the working directory."""
    if configured is not None:
        if prepare_run_dir(configured):
            _note_restart(events, configured, "this run")
        return configured
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    base = Path.cwd() / "runs" / f"{stamp}-{task_name}"
    for n in range(1, 1000):
        candidate = base if n == 1 else base.with_name(f"{base.name}-{n}")
        try:
            candidate.mkdir(parents=True, exist_ok=False)
        except FileExistsError:
            continue
        except OSError as exc:
            raise ConfigError(f"cannot create run directory {candidate}: {exc}") from exc
        return candidate
    raise ConfigError(f"cannot find a free run directory name near {base}")
