"""The run directory: which one a run uses, its config.json, the resume check, and the
summaries.

A run dir holds (docs/run-directory.md has the full table):

* ``config.json`` -- the run's redacted config with the task's spec and arguments, so
  ``--resume`` rebuilds the same run (:meth:`RunDirectory.write_config`);
* ``checkpoints.jsonl`` (:mod:`engine.rundir.checkpoint_log`), ``metrics.jsonl``
  (:mod:`engine.observe.metrics`), ``events.jsonl`` (:mod:`engine.rundir.events`),
  ``rollouts.jsonl`` and ``eval.jsonl``;
* ``summary.json`` / ``summary.md`` -- how the run ended, written whatever the ending
  (:meth:`RunDirectory.write_summary`);
* ``local-server/`` -- the data of a local server the engine started.

Which directories a run may use (:func:`prepare_run_dir`): a new or empty one, or one
that holds only an unfinished start-up (an engine ``config.json`` but no checkpoint and
no trained step: a process killed before its step-0 checkpoint); never one that holds a
run (resume it instead) or someone else's files, and never one that cannot be written.
A resumed run (:func:`load_resume_state`) must keep every setting that changes what is
trained; a setting's ``resume`` marker says whether it may change
(:func:`engine.config.resume_rule`).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from engine.common.files import unwritable_reason, write_file_atomically
from engine.common.steplog import read_step_lines
from engine.config import EngineConfig
from engine.core.state import LoopState
from engine.envs.types import AnyTask
from engine.errors import (
    ConfigError,
    Interrupted,
    NoCheckpointYet,
    ResumeError,
    RunFileError,
    RunStopped,
)
from engine.loop.evaluation import EVAL_FILE
from engine.objectives import Objective, figure, objective_named, summary_figures
from engine.observe.headline import headline_figures
from engine.observe.idle import no_training_summary
from engine.observe.metrics import RunLog
from engine.observe.run_report import REPORT_PNG
from engine.observe.tokens import Prices, tokens_summary, tokens_summary_line
from engine.redact import redact_config
from engine.rundir.checkpoint_log import CHECKPOINTS_FILE, CheckpointLog
from engine.rundir.events import QUIET, EventLog, HeldEvents
from engine.rundir.lock import LOCK_FILE, RunDirLock
from engine.rundir.record import RunRecord
from engine.rundir.resume import (
    CONFIG_FILE,
    DATA_DIGEST,
    METRICS_FILE,
    ResumeState,
    has_trained_steps,
    load_resume_state,
    read_run_config,
)

__all__ = [
    "CONFIG_FILE",
    "DATA_DIGEST",
    "LOCAL_SERVER_DIR",
    "METRICS_FILE",
    "SUMMARY_FILES",
    "ResumeState",
    "RunDirectory",
    "check_writable",
    "load_resume_state",
    "prepare_run_dir",
    "read_run_config",
    "write_config",
]

SUMMARY_JSON = "summary.json"
SUMMARY_MD = "summary.md"
SUMMARY_FILES = (SUMMARY_JSON, SUMMARY_MD)
"""config.json's fingerprint of the task's data (a task with a ``data_digest``: the
dataset tasks); a resume on other data is refused."""
LOCAL_SERVER_DIR = "local-server"
"""Where, inside the run dir, a local server started by the engine keeps its data."""


def write_config(run_dir: str | os.PathLike[str], config: Mapping[str, Any]) -> dict[str, Any]:
    """Write ``<run_dir>/config.json`` (redacted, atomic) and return what was written."""
    directory = Path(run_dir)
    directory.mkdir(parents=True, exist_ok=True)
    safe = redact_config(config)
    text = json.dumps(safe, indent=2, sort_keys=True, default=str) + "\n"
    write_file_atomically(directory / CONFIG_FILE, text.encode())
    return safe


# --------------------------------------------------------------------------- choosing it


def check_writable(directory: Path) -> None:
    """ConfigError (one line, before anything starts) when files cannot be created in
    ``directory``: a read-only run dir would otherwise fail at its first write."""
    reason = unwritable_reason(directory)
    if reason is not None:
        raise ConfigError(
            f"run directory {directory} is not writable ({reason}); fix its permissions "
            "or choose another --run-dir"
        )


def _engine_config(directory: Path) -> dict[str, Any] | None:
    """The run config in ``directory``, or None when its config.json (if any) is not one
    the engine wrote."""
    try:
        data = json.loads((directory / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and {"task_name", "server"} <= data.keys() else None


def _is_unfinished_startup(directory: Path) -> bool:
    """An engine run dir whose process stopped before its first checkpoint: nothing was
    trained, so a new run may start over in it."""
    return (
        _engine_config(directory) is not None
        and CheckpointLog(directory, log=QUIET).latest() is None
        and not has_trained_steps(directory)
    )


def _forget_unfinished_startup(directory: Path) -> None:
    """Remove the summary an earlier start-up may have left (the new run writes its
    own); events.jsonl keeps the earlier start-up's lines, the rest is rewritten."""
    for name in SUMMARY_FILES:
        (directory / name).unlink(missing_ok=True)


def prepare_run_dir(directory: Path) -> bool:
    """Make ``directory`` ready for a NEW run and return True when it held an unfinished
    start-up that the run now starts over in. Created when missing; refused with a
    ConfigError (one line, exit 2) when it holds a run (metrics or a checkpoint), when it
    holds files but no engine run (the engine would overwrite the user's config.json and
    summary.md), or when it cannot be written."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        reason = (exc.strerror or str(exc)).lower()
        raise ConfigError(f"cannot create run directory {directory}: {reason}") from None
    if _engine_config(directory) is not None:
        if not _is_unfinished_startup(directory):
            raise ConfigError(
                f"run directory {directory} already holds a run; continue it with --resume "
                f"{directory}, or choose another --run-dir"
            )
        check_writable(directory)
        _forget_unfinished_startup(directory)
        return True
    if any(not _is_temp_file(e.name) and e.name != LOCK_FILE for e in directory.iterdir()):
        raise ConfigError(
            f"run directory {directory} is not empty and holds no engine run; choose a new "
            "or empty --run-dir (the engine would overwrite files there)"
        )
    check_writable(directory)
    return False


def _is_temp_file(name: str) -> bool:
    """A temp file of :func:`write_file_atomically` left by a crash."""
    return name.startswith(".") and name.endswith(".tmp")


# --------------------------------------------------------------------------- one run's


def config_record(config: EngineConfig, task: AnyTask | None) -> dict[str, Any]:
    """What config.json holds: the public config, the task's name and its repr (while
    the server still decides the task's arguments: its spec, and None)."""
    name = task.name if task is not None else config.task.spec
    record = {**config.public_dict(), "task_repr": repr(task), "task_name": name}
    digest = getattr(task, "data_digest", None)
    if isinstance(digest, str):
        record[DATA_DIGEST] = digest
    return record


class RunDirectory:
    """One run's directory as the engine writes it: chosen (or checked, for a resume)
    by :meth:`open` before anything else starts; :meth:`attach` opens the run's
    :class:`~engine.rundir.record.RunRecord`, from which the summary is written."""

    def __init__(
        self,
        path: Path,
        *,
        resumed: ResumeState | None,
        held: HeldEvents,
        started_at: float,
        lock: RunDirLock,
    ) -> None:
        self.path = path
        self._lock = lock
        self.resumed = resumed
        """The checkpoint a resumed run continues from (None: a new run)."""
        self._held = held
        self._started_at = started_at

    @classmethod
    def open(cls, config: EngineConfig, task: AnyTask | None, *, started_at: float) -> RunDirectory:
        """The run's directory: ``config.checkpoints.resume`` checked against ``config``
        (ResumeError, exit 2), else ``config.logging.run_dir`` made ready for a new run,
        else a fresh ``runs/<timestamp>-<task>`` under the working directory."""
        held = HeldEvents()  # events.jsonl is opened once the directory checks out
        record = config_record(config, task)
        resumed: ResumeState | None = None
        if config.checkpoints.resume is not None:
            path = config.checkpoints.resume
            # Locked before its checkpoints are read: a run still training refuses.
            lock = RunDirLock.acquire(path) if path.is_dir() else None
            try:
                resumed = _check_resume(path, record, config.pipeline.steps, held)
            except BaseException:
                if lock is not None:
                    lock.release()
                raise
        else:
            path = _make_run_dir(config.logging.run_dir, record["task_name"], held)
            lock = None
        lock = lock or RunDirLock.acquire(path)
        return cls(path, resumed=resumed, held=held, started_at=started_at, lock=lock)

    def close(self) -> None:
        """Release the run dir for another process (the process ending does too)."""
        self._lock.release()

    def write_config(self, config: EngineConfig, task: AnyTask | None) -> None:
        write_config(self.path, config_record(config, task))

    def attach(self, log: RunLog, events: EventLog) -> RunRecord:
        """Replay into events.jsonl what happened while the directory was chosen, and
        open the run's record (on resume: rewound to the checkpoint, the steps after it
        are redone)."""
        self._held.replay(events)
        resumed = self.resumed.checkpoint if self.resumed is not None else None
        return RunRecord(self.path, log, events, resumed=resumed)

    def write_summary(
        self,
        config: EngineConfig,
        error: BaseException | None,
        *,
        record: RunRecord | None,
        task_name: str,
        retries: Mapping[str, int],
        final_path: str | None,
    ) -> None:
        """summary.json and summary.md (atomic; RunFileError naming the file), from
        ``record`` (None: the run failed before its record was opened)."""
        metrics = record.steps if record is not None else ()
        first, last = (metrics[0], metrics[-1]) if metrics else ({}, {})
        evals = _eval_records(self.path / EVAL_FILE)
        objective = objective_named(config.training.objective)
        summary: dict[str, Any] = {
            "status": _status(error, stopped=record is not None and record.stopped is not None),
            "error": str(error) if error else None,
            "stopped": record.stopped if record is not None else None,
            "task": task_name,
            "base_model": config.model.base_model,
            "server": config.public_dict()["server"],
            "steps_planned": config.pipeline.steps,
            "steps_completed": len(metrics),
            "resumed_from_step": self.resumed.step if self.resumed is not None else None,
            "max_steps_off_policy": config.pipeline.max_steps_off_policy,
            "loss": objective.loss_name(config),
            "first_avg_reward": first.get("avg_reward"),
            "last_avg_reward": last.get("avg_reward"),
            "best_avg_reward": max(
                (m["avg_reward"] for m in metrics if "avg_reward" in m), default=None
            ),
            "objective": config.training.objective,
            **summary_figures(metrics),
            "max_staleness": max((m["off_policy/staleness"] for m in metrics), default=None),
            "retries": dict(retries),
            "seconds": round(time.perf_counter() - self._started_at, 3),
            "final_path": final_path,
            "no_training": no_training_summary(metrics),
            "held_out": held_out_summary(evals, objective.held_out_values),
            "tokens": tokens_summary(last),
            "headlines": [f.to_dict() for f in headline_figures(metrics, evals)],
        }
        summary = redact_config(summary)
        text = json.dumps(summary, indent=2, sort_keys=True, default=str) + "\n"
        write_file_atomically(self.path / SUMMARY_JSON, text.encode())
        summary.update(report=(self.path / REPORT_PNG).exists(), run_dir=self.path)
        markdown = _summary_markdown(summary, metrics, evals, Prices.of(config))
        write_file_atomically(self.path / SUMMARY_MD, markdown.encode())

    def write_failure_summary(
        self,
        config: EngineConfig,
        error: BaseException,
        *,
        record: RunRecord | None,
        task_name: str,
        retries: Mapping[str, int],
        final_path: str | None,
        events: EventLog | None,
    ) -> None:
        """The summary of a run that did not finish; a failure to write it is logged,
        never raised over the run's own error."""
        try:
            self.write_summary(
                config,
                error,
                record=record,
                task_name=task_name,
                retries=retries,
                final_path=final_path,
            )
        except RunFileError as exc:
            if events is not None:
                with contextlib.suppress(RunFileError):  # the same full disk
                    events.error("summary.failed", error=str(exc))


def _check_resume(
    run_dir: Path, record: Mapping[str, Any], steps: int, held: HeldEvents
) -> ResumeState | None:
    """The run dir's latest checkpoint; a ResumeError (exit 2) when the config
    ``record`` differs in a setting that must not change. None when the dir holds only
    an unfinished start-up: the run starts over in it."""
    try:
        resumed = load_resume_state(run_dir, current_config=record, log=held)
    except NoCheckpointYet:
        prepare_run_dir(run_dir)
        _note_restart(held, run_dir, "--resume")
        return None
    check_writable(run_dir)
    if resumed.step > steps:
        raise ResumeError(
            f"cannot resume {run_dir}: its latest checkpoint is at step {resumed.step}, "
            f"beyond --steps {steps}"
        )
    try:
        LoopState.from_dict(resumed.loop_state)
    except (KeyError, TypeError, ValueError) as exc:
        raise ResumeError(
            f"cannot resume {run_dir}: its latest checkpoint (step {resumed.step} in "
            f"{CHECKPOINTS_FILE}) has no usable loop state ({type(exc).__name__}: {exc}); "
            "the file is damaged or was not written by the engine"
        ) from None
    return resumed


def _note_restart(events: HeldEvents, run_dir: Path, how: str) -> None:
    events.warning(
        "run_dir.restarted",
        run_dir=str(run_dir),
        message=f"{run_dir} held only an unfinished start-up (no checkpoint, no trained "
        f"step): {how} starts the run over in it from step 0",
    )


def _make_run_dir(configured: Path | None, task_name: str, events: HeldEvents) -> Path:
    """``configured`` (see :func:`prepare_run_dir`), else a fresh
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


def _status(error: BaseException | None, *, stopped: bool = False) -> str:
    """finished | interrupted (SIGINT/SIGTERM) | stopped (breaker, watchdog, or the
    embedding code, whose stop ends the run without an error) | failed."""
    if error is None:
        return "stopped" if stopped else "finished"
    if isinstance(error, Interrupted):
        return "interrupted"
    return "stopped" if isinstance(error, RunStopped) else "failed"


def _eval_records(path: Path) -> list[dict[str, Any]]:
    """The held-out evaluations of ``eval.jsonl``, step 0 first (none without one)."""
    try:
        return read_step_lines(path).records
    except OSError:
        return []


def held_out_summary(
    evals: Sequence[Mapping[str, Any]], values: Sequence[str]
) -> dict[str, Any] | None:
    """The first and last of the held-out evaluations ``evals`` (step, problems, mean
    reward, component means and the objective's own ``values``), or None without one."""
    if not evals:
        return None

    def figures(record: Mapping[str, Any]) -> dict[str, Any]:
        means = {
            k.removeprefix("eval/"): v
            for k, v in record.items()
            if k.startswith("eval/") and (f"{k}/rate" in record or k in values)
        }
        reward = {"reward": record.get("eval/reward/total")}
        return {"step": record["step"], "problems": record.get("eval/problems"), **reward, **means}

    return {"first": figures(evals[0]), "last": figures(evals[-1])}


def _held_out_line(held: Mapping[str, Any], objective: Objective) -> str:
    first, last = held["first"], held["last"]
    names = [k for k in first if k not in ("step", "problems") and k in last]
    changes = ", ".join(
        f"{name} {first[name]:.3f} -> {last[name]:.3f}"
        for name in names
        if isinstance(first[name], int | float) and isinstance(last[name], int | float)
    )
    how, rows = objective.held_out
    problems = f", {first['problems']:g} {rows}" if first.get("problems") else ""
    return f"- held-out ({how}{problems}), step {first['step']} -> {last['step']}: {changes}"


def _summary_markdown(
    s: dict[str, Any],
    metrics: Sequence[Mapping[str, Any]],
    evals: Sequence[Mapping[str, Any]],
    prices: Prices,
) -> str:
    num = figure
    objective = objective_named(s["objective"])
    lines = [
        f"# Run summary: {s['task']} on {s['base_model']}",
        "",
        f"- status: **{s['status']}**" + (f" -- {s['error']}" if s["error"] else ""),
        f"- server: {s['server']}; loss: {s['loss']}; "
        f"max steps off-policy: {s['max_steps_off_policy']}",
        f"- steps: {s['steps_completed']} of {s['steps_planned']} in {s['seconds']:.1f}s",
        *(f"- {headline.line}" for headline in headline_figures(metrics, evals)),
        *(
            [
                f"- avg reward: first {num(s['first_avg_reward'])}, last "
                f"{num(s['last_avg_reward'])}, best {num(s['best_avg_reward'])}"
            ]
            if objective.samples
            else []
        ),
        f"- max staleness: {s['max_staleness']}",
        *([tokens_summary_line(tokens, prices)] if (tokens := s["tokens"]) else []),
        *([_held_out_line(held, objective)] if (held := s["held_out"]) else []),
        *(
            [
                f"- **trained nothing** for {idle['untrained_steps']} steps (longest run: "
                f"steps {idle['longest_streak'][0]}-{idle['longest_streak'][1]}): "
                f"{idle['likely_cause']}"
            ]
            if (idle := s["no_training"])
            else []
        ),
        f"- final sampler: {s['final_path'] or 'not saved'}",
        f"- report: ![report]({REPORT_PNG})"
        if s["report"]
        else f"- report: `python -m engine.report {s['run_dir']}` draws it",
        "",
    ]
    lines += objective.summary_table(metrics)
    return "\n".join(lines) + "\n"
