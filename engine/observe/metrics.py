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

__all__ = ["RunLog", "detail_line"]


def _fmt(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return format(value, spec)


def detail_line(m: Mapping[str, Any]) -> str:
    """The readable second line of a step: staleness, groups trained of sampled (and the
    reserves dynamic sampling added), KL, loss, time split, idleness (a supervised
    step's: its groups, summed loss, train time and idleness), then the tokens billed
    (and their estimated cost), and the server's sampling queue when it made the step's
    samples wait."""
    tokens = tokens_text(m)
    queued = _queue_text(m)
    return (
        _detail(m)
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


def _detail(m: Mapping[str, Any]) -> str:
    if "dpo/pairs" in m:
        return (
            f"  chosen_reward={_fmt(m.get('dpo/chosen_reward'), '+.4f')} "
            f"rejected_reward={_fmt(m.get('dpo/rejected_reward'), '+.4f')} "
            f"tokens={m['dpo/tokens']} | train {m['time/train']:.2f}s "
            f"wait {m['time/wait']:.2f}s | trainer idle {m['trainer/idle_ratio']:.0%}"
        )
    if "sft/loss" in m:
        return (
            f"  groups={m['groups/used']}/{m['groups/total']} "
            f"loss:sum={_fmt(m['optim/loss'], '.4g')} | train {m['time/train']:.2f}s "
            f"wait {m['time/wait']:.2f}s | trainer idle {m['trainer/idle_ratio']:.0%} "
            f"| {m['throughput/tokens_per_s']:.0f} tok/s"
        )
    extra = m.get("refill/extra_groups", 0)
    refilled = f" (+{extra} refill)" if extra else ""
    return (
        f"  versions={m['sampling_client/step_min']}..{m['sampling_client/step_max']} "
        f"staleness={m['off_policy/staleness']} "
        f"groups={m['groups/used']}/{m['groups/total']}{refilled} "
        f"kl_v1={_fmt(m['optim/kl_sample_train_v1'], '+.4f')} "
        f"kl_v2={_fmt(m['optim/kl_sample_train_v2'], '.4f')} "
        f"loss={_fmt(m['optim/loss'], '.4g')} | "
        f"sample {m['time/sample']:.2f}s score {m['time/score']:.2f}s "
        f"train {m['time/train']:.2f}s wait {m['time/wait']:.2f}s | "
        f"trainer idle {m['trainer/idle_ratio']:.0%} sampler idle {m['sampler/idle_ratio']:.0%} "
        f"| {m['throughput/samples_per_s']:.1f} samples/s {m['throughput/tokens_per_s']:.0f} tok/s"
    )


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


def _console_renderer(_: Any, method: str, event: MutableMapping[str, Any]) -> str:
    name = event.get("event")
    if name == "step":
        return f"{event['line']}\n{detail_line(event)}"
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
            renderer = _json_renderer if log_format == "json" else _console_renderer

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
