"""Per-step metrics: what they are called, how they are measured, where they go.

Names follow the field (tinker-cookbook, prime-rl, verl, PipelineRL) so dashboards and
habits carry over: ``env/all/reward/total``, ``optim/kl_sample_train_v1``,
``sampling_client/step_min``, ``time/<span>``, ``trainer/idle_ratio``,
``progress/done_frac``, ``retries/<kind>``.

Each engine writes through its own structlog loggers (``structlog.wrap_logger``), never
the global configuration, so two engines in one process do not share sinks: JSON lines
to ``<run dir>/metrics.jsonl`` always; to the console either readable lines (the MinT
quickstart's ``Step N: ...`` line as-is, then a detail line) or the same JSON; and to
the experiment trackers of ``--log-to`` (:mod:`engine.observe.trackers`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import IO, Any, Literal, TextIO

import structlog

from engine.common.files import truncate_metrics
from engine.errors import RunFileError
from engine.observe.tokens import tokens_text
from engine.observe.trackers import MetricSink
from engine.redact import redact_processor

__all__ = ["RunLog", "StepDetail", "detail_line"]

StepDetail = Callable[[Mapping[str, Any]], str]
"""A step's metrics -> its objective's part of the step's second console line."""


def detail_line(m: Mapping[str, Any], own: str) -> str:
    """The readable second line of a step: the objective's ``own`` part (RL's
    staleness, groups, KL, loss, time split and idleness: its
    :meth:`~engine.objectives.base.Objective.step_detail`), then the tokens billed (and
    their estimated cost), and the server's sampling queue when it made the step's
    samples wait."""
    tokens = tokens_text(m)
    queued = _queue_text(m)
    return (
        own
        + ("" if tokens is None else f" | {tokens}")
        + ("" if queued is None else f" | {queued}")
    )


def _queue_text(m: Mapping[str, Any]) -> str | None:
    """``queued 3x pos<=5 eta<=2.0s`` (the queue's 408s of the step), None when none."""
    waits = m.get("queue/waits")
    if not waits:
        return None
    parts = [f"queued {waits}x"]
    if m.get("queue/position_max") is not None:
        parts.append(f"pos<={m['queue/position_max']}")
    if m.get("queue/eta_s_max") is not None:
        parts.append(f"eta<={m['queue/eta_s_max']:.1f}s")
    return " ".join(parts)


class _LineLogger:
    """A structlog logger that writes each rendered event as one line and flushes."""

    def __init__(self, write: Callable[[str], None]) -> None:
        self._write = write

    def msg(self, message: str) -> None:
        self._write(message)

    info = warning = error = msg


def _json_renderer(_: Any, __: str, event: MutableMapping[str, Any]) -> str:
    return json.dumps(event, default=str, allow_nan=False)


def _nan_to_none(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    for key, value in event.items():
        if isinstance(value, float) and not math.isfinite(value):
            event[key] = None
    return event


def _console_renderer(
    step_detail: StepDetail, _: Any, method: str, event: MutableMapping[str, Any]
) -> str:
    name = event.get("event")
    if name == "step":
        return f"{event['line']}\n{detail_line(event, step_detail(event))}"
    if name == "saved":
        return f"\nSaved: {event['path']}"
    if method in ("warning", "error"):
        return f"{method.capitalize()}: {event.get('message', name)}"
    return str(event.get("message", name))


class RunLog:
    """One run's event sinks. ``step`` events go to metrics.jsonl, the console and the
    trackers; other events (warnings, the final ``saved``) go to the console only. The
    log owns the trackers: :meth:`close` closes them."""

    def __init__(
        self,
        metrics_path: Path,
        console: TextIO | None,
        log_format: Literal["console", "json"],
        trackers: Sequence[tuple[str, MetricSink]] = (),
        *,
        step_detail: StepDetail,
    ) -> None:
        self._trackers = list(trackers)
        self._path = metrics_path
        self._file: IO[str] = metrics_path.open("a", encoding="utf-8")
        base: list[Any] = [
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True, key="time"),
            _nan_to_none,
            redact_processor,
        ]
        self._jsonl = structlog.wrap_logger(
            _LineLogger(self._write_file), processors=[*base, _json_renderer]
        )
        self._console: Any = None
        if console is not None:
            console_renderer = functools.partial(_console_renderer, step_detail)
            renderer = _json_renderer if log_format == "json" else console_renderer

            def write_console(line: str) -> None:
                console.write(line + "\n")
                console.flush()

            self._console = structlog.wrap_logger(
                _LineLogger(write_console), processors=[*base, renderer]
            )

    def _write_file(self, line: str) -> None:
        try:
            self._file.write(line + "\n")
            self._file.flush()
        except OSError as exc:  # a full disk: say which file
            raise RunFileError(self._path, exc) from exc

    @property
    def path(self) -> Path:
        """The metrics.jsonl this log appends to."""
        return self._path

    def step(self, metrics: Mapping[str, Any], line: str) -> None:
        self._jsonl.info("step", **metrics)
        if self._console is not None:
            self._console.info("step", line=line, **metrics)
        self.track(int(metrics["step"]), metrics)

    def track(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Send ``metrics`` to the trackers at ``step``: a step's, or the evaluation of the
        starting weights (step 0), which has no step of its own."""
        for name, tracker in list(self._trackers):
            try:
                tracker.log_step(step, metrics)
            except Exception as exc:  # a dashboard must not stop the training
                self._trackers.remove((name, tracker))
                with contextlib.suppress(Exception):
                    tracker.close()
                self.warning(
                    "tracker_failed",
                    f"{name} stopped logging at step {step} ({exc!r}); "
                    "metrics.jsonl keeps every step",
                )

    def warning(self, event: str, message: str, **fields: Any) -> None:
        if self._console is not None:
            self._console.warning(event, message=message, **fields)

    def info(self, event: str, message: str, **fields: Any) -> None:
        if self._console is not None:
            self._console.info(event, message=message, **fields)

    def saved(self, path: str) -> None:
        """``Saved: <path>``; in JSON mode a ``saved`` event (the CLI also prints the
        plain line to stderr so it is never lost in the JSON)."""
        if self._console is not None:
            self._console.info("saved", path=path)

    def rewind(self, keep_through_step: int, log: Any = None) -> int:
        """Drop the metrics lines of steps after ``keep_through_step`` (a recovery redoes
        them, and each step must appear once); returns how many were dropped."""
        self._file.close()
        try:
            return truncate_metrics(self._path, keep_through_step, log=log)
        finally:
            self._file = self._path.open("a", encoding="utf-8")

    def close(self) -> None:
        self._file.close()
        for _, tracker in self._trackers:
            tracker.close()
