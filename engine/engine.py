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
:mod:`engine.observe.metrics` and :mod:`engine.rundir.events`).

:class:`Engine` is a small facade with a lifecycle (unopened, opening, opened, running,
closed; httpx's ``ClientState`` is the model): entering it opens everything a run needs
into one :class:`_OpenRun` -- the run directory (:mod:`engine.rundir.directory`), the
logs, the session and the :class:`~engine.supervision.supervisor.Supervisor` that trains,
checkpoints, recovers and stops. Calls in the wrong state raise a RuntimeError that says what to do.
Resuming (``config.checkpoints.resume``) continues the run dir's latest checkpoint; a local server
keeps its checkpoints in ``<run dir>/local-server`` so a new process can load them
after a crash.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

import anyio
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from engine.catalog import load_task, preferred_local_model, task_spec
from engine.common.clock import LOOP_CLOCK, Clock
from engine.config import EngineConfig, Profile, check_installed
from engine.core.state import LoopState
from engine.envs.scoring import check_score_workers
from engine.envs.types import AnyTask
from engine.errors import ConfigError, Interrupted, StopRequested, primary_error
from engine.loop.evaluation import eval_problems_of
from engine.loop.results import RunResult, StepResult
from engine.objectives import checked_objective, objective_named
from engine.observe.metrics import RunLog
from engine.observe.trackers import open_trackers
from engine.rundir.directory import LOCAL_SERVER_DIR, RunDirectory, config_record
from engine.rundir.events import EventLog, describe
from engine.rundir.record import RunRecord
from engine.rundir.resume import resumed_config
from engine.session.api import Session
from engine.session.capabilities import check_run_capabilities
from engine.session.opening import SharedLocalServer, open_session
from engine.session.preflight import local_server_profile
from engine.session.queue_watch import QueueObserver
from engine.session.retry import RetryCounter, service_guard
from engine.supervision.supervisor import RunService, StepHook, Supervisor

__all__ = ["Engine", "SessionFactory", "StepHook", "load_run_task", "prepare_run"]

SessionFactory = Callable[[EngineConfig], contextlib.AbstractAsyncContextManager[Session]]
"""Opens a session for a config (entered when the engine is, left when it is)."""

_BY_CALLER = "Engine.request_stop()"
_LEFT_EARLY = "the embedding code leaving steps() or the engine before the run ended"


class _Lifecycle(enum.Enum):
    """Where an :class:`Engine` is in its one life (httpx's ``ClientState`` is the model)."""

    UNOPENED = "unopened"  # constructed, not entered
    OPENING = "opening"  # entering: the run dir, logs and session are being opened
    OPENED = "opened"  # inside ``async with``; the run has not started
    RUNNING = "running"  # steps()/run() started the run
    CLOSED = "closed"  # left ``async with`` (or entering it failed)


@dataclass
class _OpenRun:
    """Everything that exists once the engine is entered, and the run's outcome."""

    files: RunDirectory
    record: RunRecord
    events: EventLog
    session: Session
    retries: RetryCounter
    supervisor: Supervisor
    send: MemoryObjectSendStream[StepResult]
    recv: MemoryObjectReceiveStream[StepResult]
    task_group: TaskGroup
    resources: contextlib.AsyncExitStack
    result: RunResult | None = None
    error: BaseException | None = None
    done: anyio.Event = dataclasses.field(default_factory=anyio.Event)
    """Set once the run has ended, whatever the ending."""


class Engine:
    """One RL run. Construct, enter with ``async with``, then either ``await run()`` or
    iterate ``steps()`` (not both). ``console`` receives the readable output (None: quiet;
    metrics.jsonl is written either way). ``clock`` is the time of the reliability timers
    (request deadlines, the watchdog, server liveness); tests pass a manual one.

    ``session`` (as httpx takes a transport): None connects as the config says (a MinT
    server, or the local one); a :class:`~engine.session.api.Session` is used as is
    (its owner opens and closes it); a factory ``config -> async context manager of a
    Session`` is entered and left with the engine. A given session serves the config as
    resolved here: the settings it leaves to a server must be set; it starts from
    ``init_from`` when that is set (:meth:`Session.restore`).

    ``local_server``: a local server kept for runs in sequence (:mod:`engine.stages`),
    used instead of one of the engine's own; its data dir holds the run's checkpoints.
    An engine runs one stage: a config's ``then`` (a second stage) is recorded in its
    config.json for :class:`~engine.stages.Stages`, which runs both."""

    def __init__(
        self,
        config: EngineConfig,
        task: AnyTask | None = None,
        *,
        on_step: StepHook | Sequence[StepHook] = (),
        console: TextIO | None = None,
        clock: Clock = LOOP_CLOCK,
        session: Session | SessionFactory | None = None,
        local_server: SharedLocalServer | None = None,
    ) -> None:
        if not isinstance(config, EngineConfig):
            raise TypeError(
                f"Engine(config, task=...) takes an EngineConfig first, got a "
                f"{type(config).__name__}: pass a task object as task=..."
            )
        if isinstance(task, str | type):
            raise TypeError(
                f"Engine(config, task=...) takes a task object, got {task!r}: a task spec "
                "string goes in EngineConfig(task=...), a task class is instantiated first"
            )
        if session is None and not config.session.local and not config.session.api_key_value:
            raise ConfigError(
                "EngineConfig has no api_key and local=False: pass api_key (or build it with "
                "EngineConfig.from_env(), which reads MINT_API_KEY), or local=True to start "
                "the local MinT server in this process"
            )
        self._config = config
        self._left_to_server = config.unresolved
        """The settings the caller left to the server, named on the console once chosen."""
        self._task = task
        self._clock = clock
        self._session_source = session
        self._local_server = local_server
        self._hooks: list[StepHook] = [on_step] if callable(on_step) else list(on_step)
        self._console = console
        self._lifecycle = _Lifecycle.UNOPENED
        self._run: _OpenRun | None = None
        self._run_dir: Path | None = None
        self._pending_stop: Exception | None = None

    # -- public --------------------------------------------------------------------

    @property
    def config(self) -> EngineConfig:
        """The configuration: as given until the engine is entered, then resolved (the
        profiles known before connecting, then a remote server's defaults)."""
        return self._config

    @property
    def task(self) -> AnyTask:
        if self._task is None:
            raise RuntimeError(
                "the task is loaded once the server's defaults are known (the engine is entered)"
            )
        return self._task

    @property
    def run_dir(self) -> Path:
        """The run directory, once chosen on entering (also after the engine is left)."""
        if self._run_dir is None:
            raise RuntimeError(
                "the run directory exists once the engine is entered: "
                "use 'async with Engine(...) as engine:'"
            )
        return self._run_dir

    @property
    def state(self) -> LoopState | None:
        """The loop state after the latest trained step (the initial or resumed state
        before the first)."""
        return self._run.supervisor.state if self._run is not None else None

    @property
    def session(self) -> Session:
        """The connected session (its ``model_id`` changes when a checkpoint is
        restored)."""
        if self._run is None:
            raise RuntimeError(
                "the session exists once the engine is entered: "
                "use 'async with Engine(...) as engine:'"
            )
        return self._run.session

    def add_step_hook(self, hook: StepHook) -> None:
        self._hooks.append(hook)

    def request_stop(self, reason: Exception | None = None) -> None:
        """Stop the run gracefully (SIGINT/SIGTERM in the CLI): at once when no step is in
        flight, else after the step in flight (at most
        :data:`~engine.supervision.supervisor.STOP_GRACE_S` later); then a stop checkpoint is
        written and the run ends normally: ``steps()`` ends, ``run()`` and :attr:`result`
        give the :class:`~engine.loop.results.RunResult` (``stopped`` True). With a
        ``reason`` (an exception), ``run()``/``steps()`` raise it instead (the CLI's
        signals raise :class:`~engine.errors.Interrupted`, exit code 130). Safe to call
        from the engine's event loop at any time, also before the run starts; a no-op once
        the engine is closed."""
        reason = reason if reason is not None else StopRequested(_BY_CALLER)
        if self._lifecycle is _Lifecycle.CLOSED:
            return
        if self._run is None:
            if self._pending_stop is None:
                self._pending_stop = reason
            return
        self._stop(reason)

    def _stop_left_early(self) -> None:
        assert self._run is not None
        if self._run.supervisor.gate.reason is None:
            self._stop(StopRequested(_LEFT_EARLY))

    def _stop(self, reason: Exception) -> None:
        assert self._run is not None
        if isinstance(reason, StopRequested):
            message = f"{reason} (after the step in flight)"
        elif not isinstance(reason, Interrupted):
            message = f"stop requested: {reason}"
        elif reason.signal_name.startswith("SIG"):
            message = f"{reason} (after the step in flight; a second signal exits at once)"
        else:
            message = f"{reason} (after the step in flight)"
        self._run.events.warning("stop.requested", error=str(reason), message=message)
        self._run.supervisor.gate.request(reason)

    async def steps(self) -> AsyncIterator[StepResult]:
        """Start the run and yield each step as it is trained. Raises the run's error,
        if any, after the last step it completed."""
        run = self._start()
        finished = False
        try:
            async with run.recv:
                async for step in run.recv:
                    yield step
            finished = True
        finally:
            if not finished and not run.done.is_set():
                # Left early (a break, a return, an error in the loop body): stop after
                # the step in flight, with a stop checkpoint of what was trained.
                self._stop_left_early()
        if run.error is not None:
            raise run.error

    async def run(self) -> RunResult:
        """Run every step (or until :meth:`request_stop`); return the final sampler path
        and the metrics."""
        async for _ in self.steps():
            pass
        assert self._run is not None and self._run.result is not None
        return self._run.result

    @property
    def result(self) -> RunResult | None:
        """How the run ended (the object ``run()`` returns), once it has; also after
        leaving ``steps()`` early, with every step trained (those after the last one the
        loop saw included). None while it runs, or when it failed."""
        return self._run.result if self._run is not None else None

    # -- lifecycle -----------------------------------------------------------------

    async def __aenter__(self) -> Engine:
        if self._lifecycle is not _Lifecycle.UNOPENED:
            raise RuntimeError(
                f"this Engine was already entered (it is {self._lifecycle.value}): an Engine "
                "runs once; create a new Engine for another run"
            )
        self._lifecycle = _Lifecycle.OPENING
        try:
            self._resolve()
            self._run = await self._open(started_at=time.perf_counter())
        except BaseException:
            self._lifecycle = _Lifecycle.CLOSED
            raise
        self._lifecycle = _Lifecycle.OPENED
        if self._pending_stop is not None:  # requested before the engine was open
            self._run.supervisor.gate.request(self._pending_stop)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._run is None or self._lifecycle is _Lifecycle.CLOSED:
            return
        run = self._run
        started = self._lifecycle is _Lifecycle.RUNNING
        self._lifecycle = _Lifecycle.CLOSED
        try:
            if started and not run.done.is_set() and (exc is None or isinstance(exc, Exception)):
                # The block ends before the run did: stop it as a signal would (after the
                # step in flight, bounded by the stop grace) so what was trained is kept.
                self._stop_left_early()
                await run.done.wait()
            run.task_group.cancel_scope.cancel()
            # The body's own exception (e.g. the run's error re-raised by run()) keeps
            # propagating as itself; only the children's errors (none: _drive keeps its
            # errors) would come out of the group.
            await run.task_group.__aexit__(None, None, None)
        finally:
            # Not under a shield of ours: the resources (a local server's task group)
            # were entered before any such scope, and anyio scopes must nest. Each
            # resource shields its own shutdown.
            await run.resources.aclose()

    async def _open(self, *, started_at: float) -> _OpenRun:
        """The run dir, logs, session, supervisor and the run's task group. A failure
        once the run dir exists leaves a summary there saying why."""
        files = RunDirectory.open(self._config, self._task, started_at=started_at)
        self._run_dir = files.path
        resources = contextlib.AsyncExitStack()
        resources.callback(files.close)
        events: EventLog | None = None
        record: RunRecord | None = None
        session: Session | None = None
        retries = RetryCounter()
        queue = QueueObserver()
        try:
            cfg = self._config
            files.write_config(cfg, self._task)
            trackers = open_trackers(cfg.logging.log_to, files.path, config_record(cfg, self._task))
            log = RunLog(
                files.path / "metrics.jsonl",
                self._console,
                cfg.logging.log_format,
                trackers,
                step_detail=objective_named(cfg.training.objective).step_detail,
            )
            resources.callback(log.close)
            events = EventLog(
                files.path,
                console=lambda level, event, fields: log.warning(event, describe(event, fields)),
            )
            resources.callback(events.close)
            record = files.attach(log, events)
            if (
                cfg.pipeline.max_steps_off_policy >= 1
                and cfg.training.loss == "importance_sampling"
                and not cfg.training.tis_cap
            ):
                log.warning(
                    "off_policy_loss",
                    f"--max-steps-off-policy {cfg.pipeline.max_steps_off_policy} with the "
                    "unclipped importance_sampling loss: a clipped loss (--loss ppo) or a "
                    "truncated one (--tis-cap) is safer off-policy",
                )
            if self._session_source is None:
                opened = await resources.enter_async_context(
                    open_session(
                        cfg,
                        say=lambda line: log.info("console", line),
                        guard=service_guard(cfg, log=events, clock=self._clock),
                        local_data_dir=files.path / LOCAL_SERVER_DIR,
                        restore_from=(
                            files.resumed.checkpoint.state_path
                            if files.resumed is not None
                            else None
                        ),
                        local_server=self._local_server,
                    )
                )
                session, retries, queue = opened, opened.retries, opened.queue
                # Before the first sample: refuse what the server lacks of the settings.
                await check_run_capabilities(
                    opened,
                    objective_named(opened.config.training.objective).needs(opened.config),
                    say=lambda line: log.info("console", line),
                )
                if opened.config != self._config:  # the server decided what was left unset
                    self._config = opened.config
                    if self._task is None:
                        self._load_task()
                    files.write_config(self._config, self._task)
                if files.resumed is None and self._left_to_server:
                    chosen = self._config.setting_values(self._left_to_server)
                    log.info("console", f"Recommended by the server: {', '.join(chosen)}")
            else:
                session = await self._given_session(resources)
                if files.resumed is not None:
                    await session.restore(files.resumed.checkpoint.state_path)
                elif cfg.model.init_from is not None:
                    await session.restore(
                        cfg.model.init_from, optimizer=cfg.model.init_from_optimizer
                    )
            send, recv = anyio.create_memory_object_stream[StepResult](max(1, cfg.pipeline.steps))
            resources.callback(send.close)
            resources.callback(recv.close)
            supervisor = Supervisor(
                self._config,
                self.task,
                service=RunService(session, retries, queue, self._local_server_dir(files.path)),
                record=record,
                clock=self._clock,
                hooks=self._hooks,
                publish=functools.partial(_publish, send),
            )
            task_group = anyio.create_task_group()
            await task_group.__aenter__()
        except BaseException as exc:
            if isinstance(exc, Exception):
                files.write_failure_summary(
                    self._config,
                    primary_error(exc),
                    record=record,
                    task_name=self._task_name,
                    retries=retries.totals(),
                    final_path=None,
                    events=events,
                )
            await resources.aclose()
            raise
        return _OpenRun(
            files, record, events, session, retries, supervisor, send, recv, task_group, resources
        )

    async def _given_session(self, resources: contextlib.AsyncExitStack) -> Session:
        """The caller's session, or the one its factory opens (left with the engine)."""
        given = self._session_source
        if self._config.unresolved:
            raise ConfigError(
                "a given session cannot resolve settings from a server: set "
                + ", ".join(self._config.unresolved)
            )
        if isinstance(given, Session):
            return given
        assert given is not None
        return await resources.enter_async_context(given(self._config))

    def _local_server_dir(self, run_dir: Path) -> Path | None:
        """The data dir of the run's local server (None: not a local server)."""
        if not self._config.uses_local_server:
            return None
        kept = self._local_server.data_dir if self._local_server is not None else None
        return kept if kept is not None else run_dir / LOCAL_SERVER_DIR

    def _resolve(self) -> None:
        self._config, self._task = prepare_run(self._config, self._task)

    def _load_task(self) -> None:
        self._config, self._task = load_run_task(self._config, self._task)

    @property
    def _task_name(self) -> str:
        """The task's name; its spec while the server still decides its arguments."""
        return self._task.name if self._task is not None else self._config.task.spec

    def _start(self) -> _OpenRun:
        if self._lifecycle in (_Lifecycle.UNOPENED, _Lifecycle.OPENING):
            raise RuntimeError("use the Engine inside 'async with Engine(...) as engine:'")
        if self._lifecycle is _Lifecycle.RUNNING:
            raise RuntimeError("an Engine runs once: steps()/run() was already called")
        if self._lifecycle is _Lifecycle.CLOSED or self._run is None:
            raise RuntimeError(
                "this Engine is closed (its 'async with' block has ended): create a new "
                "Engine for another run"
            )
        self._lifecycle = _Lifecycle.RUNNING
        self._run.task_group.start_soon(self._drive, self._run)
        return self._run

    # -- the run -------------------------------------------------------------------

    async def _drive(self, run: _OpenRun) -> None:
        """The run, as a child of the engine's task group. Errors are kept and raised to
        the consumer of steps()/run(), not to the task that entered the engine."""
        try:
            async with run.send:
                run.result = await run.supervisor.run()
                run.files.write_summary(
                    self._config,
                    None,
                    record=run.record,
                    task_name=self._task_name,
                    retries=run.retries.totals(),
                    final_path=run.result.final_path,
                )
        except Exception as exc:
            run.error = primary_error(exc)
            self._write_failure_summary(run, run.error)
        except anyio.get_cancelled_exc_class():
            # The host cancelled the task running the engine: still leave a readable
            # run dir (an interrupt checkpoint when no step was in flight, a summary).
            with anyio.CancelScope(shield=True):
                stop = Interrupted("cancellation of the host task")
                run.error = stop
                await run.supervisor.stop_after_cancellation(stop)
                self._write_failure_summary(run, stop)
            raise
        finally:
            run.done.set()

    def _write_failure_summary(self, run: _OpenRun, error: BaseException) -> None:
        run.files.write_failure_summary(
            self._config,
            error,
            record=run.record,
            task_name=self._task_name,
            retries=run.retries.totals(),
            final_path=run.result.final_path if run.result is not None else None,
            events=run.events,
        )


def prepare_run(config: EngineConfig, task: AnyTask | None) -> tuple[EngineConfig, AnyTask | None]:
    """What an engine does before connecting, on entering (``Engine(...)`` itself reads
    nothing): the config checked against its objective and what is installed, resolved
    from every profile known then (a resumed run's config.json, the local server's
    model), and the task loaded, unless its arguments are still the server's to decide
    (then None)."""
    changes: dict[str, Any] = {}
    profiles: list[Profile] = []
    if task is not None:
        # config.json records the spec and arguments that rebuild the task (also one
        # passed as an object), so --resume works alike from the CLI and embedded.
        spec, args = task_spec(task, config.task.spec, config.task.args)
        changes["task"] = {"spec": spec, "args": args}
    config = resumed_config(config)  # a resumed run keeps its settings unless given anew
    checked_objective(config)
    check_installed(config)
    if config.uses_local_server:
        # A task may name the model it runs on (the shipped environments do); what
        # the server started here will recommend is known before it starts.
        spec = changes.get("task", {}).get("spec", config.task.spec)
        local_model = config.session.local_model or preferred_local_model(task, spec)
        changes["local_model"] = local_model
        profiles.append(local_server_profile(local_model))
    # Resolved once from every profile known now; a remote server's recommendations
    # fill what is left once connected (open_session), before anything trains.
    resolved = config.resolved(*profiles, **changes)
    if resolved.unresolved_task_args:
        return resolved, task
    return load_run_task(resolved, task)


def load_run_task(config: EngineConfig, task: AnyTask | None) -> tuple[EngineConfig, AnyTask]:
    """The task (``task``, else loaded from the config's spec and arguments), checked
    against the config before anything is spent, and the config recording the spec and
    arguments that rebuild it."""
    task = (
        task
        if task is not None
        else load_task(config.task.spec, config.task.args, objective=config.training.objective)
    )
    spec, args = task_spec(task, config.task.spec, config.task.args)
    check_score_workers(task, config.scoring.score_workers)
    objective_named(config.training.objective).check_task(task)
    if config.evaluation.eval_every:
        eval_problems_of(task)  # a task without held-out problems: ConfigError now
    return config.replace(task={"spec": spec, "args": args}), task


async def _publish(send: MemoryObjectSendStream[StepResult], step: StepResult) -> None:
    """Hand a step to the consumer of steps(); one that left early reads no more."""
    with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
        await send.send(step)
