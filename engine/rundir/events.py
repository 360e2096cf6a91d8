"""The run's reliability events: retries, breaker trips, checkpoints, recoveries, stops.

Why a sink of its own: these are not per-step metrics (``metrics.jsonl`` holds exactly one
line per trained step) but a person debugging a run needs every one of them, in order,
with the error that caused it. Each event becomes one JSON line in
``<run dir>/events.jsonl``; warnings and errors are also shown on the console as one
readable line (or as JSON with ``--log-format json``). Everything is redacted on the way
out. The logger is built with ``structlog.wrap_logger`` (never the global structlog
configuration), so two engines in one process keep separate logs.

:class:`EventLog` has the ``info/warning/error(event, **fields)`` shape of a structlog
logger, which is what the reliability modules (:mod:`engine.session.retry`,
:mod:`engine.supervision.watchdog`, :mod:`engine.rundir.checkpoint_log`,
:mod:`engine.supervision.recovery`) accept as their ``log``.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping, MutableMapping
from pathlib import Path
from typing import IO, Any

import structlog

from engine.errors import RunFileError
from engine.redact import redact_processor

__all__ = ["EVENTS_FILE", "QUIET", "EventLog", "HeldEvents", "describe"]

EVENTS_FILE = "events.jsonl"


ConsoleSink = Callable[[str, str, Mapping[str, Any]], None]
"""``(level, event, redacted fields)`` -> shows a warning/error to the user."""


class _FileSink:
    """A structlog "logger" that appends each rendered event as one flushed line; safe
    to call from worker threads (checkpoint appends run in one)."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._file: IO[str] = path.open("a", encoding="utf-8")
        self._lock = threading.Lock()

    def msg(self, message: str) -> None:
        with self._lock:
            if not self._file.closed:
                try:
                    self._file.write(message + "\n")
                    self._file.flush()
                except OSError as exc:  # a full disk: say which file
                    raise RunFileError(self._path, exc) from exc

    info = warning = error = msg

    def close(self) -> None:
        with self._lock:
            self._file.close()


def _render(_: Any, __: str, event: MutableMapping[str, Any]) -> str:
    return json.dumps(event, default=str, allow_nan=False)


class EventLog:
    """``events.jsonl`` of one run, plus the console for warnings and errors."""

    def __init__(self, run_dir: Path, console: ConsoleSink | None = None) -> None:
        self.path = run_dir / EVENTS_FILE
        self._sink = _FileSink(self.path)
        self._console = console
        self._logger = structlog.wrap_logger(
            self._sink,
            processors=[
                structlog.processors.add_log_level,
                structlog.processors.TimeStamper(fmt="iso", utc=True, key="time"),
                redact_processor,
                self._to_console,
                _render,
            ],
        )

    def _to_console(
        self, _: Any, method: str, event: MutableMapping[str, Any]
    ) -> MutableMapping[str, Any]:
        if self._console is not None and method in ("warning", "error"):
            fields = {k: v for k, v in event.items() if k not in ("event", "level", "time")}
            self._console(method, str(event["event"]), fields)
        return event

    def info(self, event: str, **fields: Any) -> None:
        self._logger.info(event, **fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._logger.warning(event, **fields)

    def error(self, event: str, **fields: Any) -> None:
        self._logger.error(event, **fields)

    def close(self) -> None:
        self._sink.close()


class HeldEvents:
    """Events logged before events.jsonl exists (while the run dir is being chosen),
    replayed into it once it does."""

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


class _Quiet:
    def info(self, event: str, **fields: Any) -> None:
        pass

    warning = error = info


QUIET = _Quiet()
"""A log that drops every event, for callers that report in their own words."""


def describe(event: str, fields: Mapping[str, Any]) -> str:
    """One readable sentence for a reliability event (the console line)."""
    f = dict(fields)
    if event == "retry":
        wait = f.get("wait_s")
        return (
            f"retrying {f.get('op')} (attempt {f.get('attempt')} of {f.get('max_attempts')} "
            f"failed{'' if wait is None else f'; next in {wait:g}s'}): {f.get('error')}"
        )
    if event in ("retry.gave_up", "retry.permanent"):
        return f"{f.get('op')} failed after {f.get('attempts')} attempt(s): {f.get('error')}"
    if event == "train_step.failed":
        return f"train step {f.get('step')} failed ({f.get('outcome')}): {f.get('error')}"
    if event == "recovery.plan":
        return (
            f"restoring {f.get('restore')} and redoing {f.get('redo_steps')} step(s) from "
            f"step {f.get('resume_step')}"
        )
    if event == "breaker.open":
        return (
            f"circuit breaker open: {f.get('failures')} consecutive {f.get('kind')} failures "
            f"({f.get('error')})"
        )
    if event == "watchdog.stalled":
        return f"no progress for {f.get('seconds')}s (last progress: {f.get('last_progress')})"
    message = f.pop("message", None)
    if isinstance(message, str):
        return message
    details = " ".join(f"{k}={v}" for k, v in f.items())
    return f"{event}: {details}" if details else event
