"""The embeddable engine: run the RL loop from inside another asyncio (anyio) service.

    async with Engine(EngineConfig(steps=4), task=MyTask()) as engine:
        async for step in engine.steps():     # or: result = await engine.run()
            print(step.line)

Why a context manager with its own task group: the pipeline runs as a child of the
``async with`` block, so it can never outlive it -- leaving the block (normally, by an
exception, or because the host task was cancelled mid-step) cancels the pipeline,
closes the session and stops a local server before ``__aexit__`` returns. The engine
keeps no module-level state and installs no signal handlers; its loggers are its own
(see :mod:`engine.metrics`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

import anyio
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from engine.config import EngineConfig
from engine.errors import ConfigError, EngineError
from engine.metrics import RunLog
from engine.pipeline import Pipeline
from engine.redact import redact_config
from engine.results import RunResult, StepResult
from engine.service import MintSession, open_session
from engine.state import LoopState
from engine.tasks import Task, load_task

__all__ = ["Engine", "StepHook"]

StepHook = Callable[[StepResult], Awaitable[None] | None]
"""Called after every trained step, on the trainer's path: keep it quick."""


class Engine:
    """One RL run. Construct, enter with ``async with``, then either ``await run()`` or
    iterate ``steps()`` (not both). ``console`` receives the readable output (None: quiet;
    metrics.jsonl is written either way)."""

    def __init__(
        self,
        config: EngineConfig,
        task: Task | None = None,
        *,
        on_step: StepHook | Sequence[StepHook] = (),
        console: TextIO | None = None,
    ) -> None:
        self._config = config.resolved()
        cfg = self._config
        assert cfg.op is not None and cfg.min_operand is not None and cfg.max_operand is not None
        self._task: Task = task or load_task(
            cfg.task, op=cfg.op, min_operand=cfg.min_operand, max_operand=cfg.max_operand
        )
        self._hooks: list[StepHook] = [on_step] if callable(on_step) else list(on_step)
        self._console = console
        self._resources = contextlib.AsyncExitStack()
        self._tg: TaskGroup | None = None
        self._send: MemoryObjectSendStream[StepResult] | None = None
        self._recv: MemoryObjectReceiveStream[StepResult] | None = None
        self._session: MintSession | None = None
        self._log: RunLog | None = None
        self._run_dir: Path | None = None
        self._started = False
        self._consumed = False
        self._result: RunResult | None = None
        self._error: BaseException | None = None
        self._state: LoopState | None = None
        self._metrics: list[dict[str, Any]] = []
        self._started_at = 0.0

    # -- public --------------------------------------------------------------------

    @property
    def config(self) -> EngineConfig:
        """The resolved configuration (profile defaults filled in)."""
        return self._config

    @property
    def task(self) -> Task:
        return self._task

    @property
    def run_dir(self) -> Path:
        if self._run_dir is None:
            raise RuntimeError("the run directory exists once the engine is entered")
        return self._run_dir

    @property
    def state(self) -> LoopState | None:
        """The loop state after the latest trained step (None before the first)."""
        return self._state

    def add_step_hook(self, hook: StepHook) -> None:
        self._hooks.append(hook)

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
                self._write_summary(_unwrap(exc))
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
                await self._tg.__aexit__(exc_type, exc, tb)
        finally:
            self._tg = None
            # Not under a shield of ours: the resources (a local server's task group)
            # were entered before any such scope, and anyio scopes must nest. Each
            # resource shields its own shutdown.
            await self._resources.aclose()

    async def _open(self) -> None:
        cfg = self._config
        self._run_dir = _make_run_dir(cfg.run_dir, self._task.name)
        self._write_config()
        log = RunLog(self._run_dir / "metrics.jsonl", self._console, cfg.log_format)
        self._log = log
        self._resources.callback(log.close)
        if cfg.max_steps_off_policy >= 1 and cfg.loss == "importance_sampling":
            log.warning(
                "off_policy_loss",
                f"--max-steps-off-policy {cfg.max_steps_off_policy} with the unclipped "
                "importance_sampling loss: a clipped loss (--loss ppo) is safer off-policy",
            )
        self._session = await self._resources.enter_async_context(
            open_session(cfg, say=lambda line: log.info("console", line))
        )
        if cfg.base_model is None:
            self._config = dataclasses.replace(cfg, base_model=self._session.info.base_model)
            self._write_config()
        send, recv = anyio.create_memory_object_stream[StepResult](max(1, cfg.steps))
        self._send, self._recv = send, recv
        self._resources.callback(send.close)
        self._resources.callback(recv.close)
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg

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
        assert self._session is not None and self._send is not None and self._log is not None
        session, log, cfg = self._session, self._log, self._config
        try:
            async with self._send:
                source = self._task.source(cfg.seed)
                state = LoopState(0, source.state(), 0)
                sampler = await session.save_sampler(0)
                pipeline = Pipeline(cfg, self._task, session, source, state, sampler, self._on_step)
                outcome = await pipeline.run()
                if outcome.exhausted:
                    log.warning(
                        "source_exhausted",
                        f"the problem source ran out after {outcome.steps_completed} steps",
                    )
                path = await session.save_weights_for_sampler(f"{self._task.name}-final")
                log.saved(path)
                self._result = RunResult(
                    final_path=path,
                    run_dir=self.run_dir,
                    steps_completed=outcome.steps_completed,
                    metrics=tuple(self._metrics),
                    exhausted=outcome.exhausted,
                )
                self._write_summary(None)
        except Exception as exc:
            self._error = _unwrap(exc)
            self._write_summary(self._error)

    async def _on_step(self, result: StepResult) -> None:
        assert self._log is not None and self._send is not None
        self._state = result.state
        self._metrics.append(result.metrics)
        self._log.step(result.metrics, result.line)
        dropped = result.metrics["dropped/missing_logprobs"]
        if dropped:
            self._log.warning(
                "missing_logprobs",
                f"step {result.step}: dropped {dropped} responses that came without sampler "
                "logprobs (--on-missing-logprobs drop)",
            )
        for hook in self._hooks:
            value = hook(result)
            if inspect.isawaitable(value):
                await value
        await self._send.send(result)

    # -- files ---------------------------------------------------------------------

    def _write_config(self) -> None:
        data = {
            **self._config.public_dict(),
            "task_repr": repr(self._task),
            "task_name": self._task.name,
        }
        _write_json(self.run_dir / "config.json", redact_config(data))

    def _write_summary(self, error: BaseException | None) -> None:
        metrics = self._metrics
        first, last = (metrics[0], metrics[-1]) if metrics else ({}, {})
        summary: dict[str, Any] = {
            "status": "failed" if error else "finished",
            "error": str(error) if error else None,
            "task": self._task.name,
            "base_model": self._config.base_model,
            "server": self._config.public_dict()["server"],
            "steps_planned": self._config.steps,
            "steps_completed": len(metrics),
            "max_steps_off_policy": self._config.max_steps_off_policy,
            "loss": self._config.loss,
            "first_avg_reward": first.get("avg_reward"),
            "last_avg_reward": last.get("avg_reward"),
            "best_avg_reward": max((m["avg_reward"] for m in metrics), default=None),
            "max_staleness": max((m["off_policy/staleness"] for m in metrics), default=None),
            "seconds": round(time.perf_counter() - self._started_at, 3),
            "final_path": self._result.final_path if self._result else None,
        }
        summary = redact_config(summary)
        _write_json(self.run_dir / "summary.json", summary)
        (self.run_dir / "summary.md").write_text(_summary_markdown(summary, metrics))


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


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


def _make_run_dir(configured: Path | None, task_name: str) -> Path:
    """``configured`` (created if missing; refused if it already holds a run), else a
    fresh ``runs/<timestamp>-<task>`` under the working directory."""
    if configured is not None:
        if (configured / "metrics.jsonl").exists():
            raise ConfigError(
                f"run directory {configured} already holds a run (metrics.jsonl); "
                "choose another --run-dir"
            )
        try:
            configured.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot create run directory {configured}: {exc}") from exc
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


def _unwrap(exc: BaseException) -> BaseException:
    """The single error inside (nested) task-group exception groups, else ``exc``."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    if isinstance(exc, BaseExceptionGroup):
        for leaf in exc.exceptions:
            if isinstance(leaf, EngineError):
                return _unwrap(leaf)
    return exc
