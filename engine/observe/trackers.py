"""Experiment trackers beside metrics.jsonl: Weights & Biases and TensorBoard.

``--log-to wandb,tensorboard`` (``EngineConfig.log_to``) opens one sink per tracker in
the run directory; every step's numeric metrics go to each under the names of
metrics.jsonl (``env/all/reward/total``, ``time/step``...), at the step's number.

- ``wandb``: a W&B run named after the run directory, files under ``<run dir>/wandb``.
  W&B's own variables apply (``WANDB_MODE=offline`` needs no network or account;
  ``WANDB_PROJECT``, ``WANDB_ENTITY``, ``WANDB_API_KEY``). The run's config is
  ``config.json`` (no API key); console capture, system metrics, git and command-line
  metadata are off (a ``--api-key`` flag would otherwise be recorded). W&B keeps one
  process-wide background service (it sets ``WANDB_SERVICE`` in the environment).
- ``tensorboard``: event files under ``<run dir>/tensorboard``
  (``tensorboard --logdir <run dir>``), written with the tensorboard package's own
  event writer (no TensorFlow, no torch).

A resumed run opens new tracker runs and logs the steps it (re)trains.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from engine.config.values import TRACKERS
from engine.errors import ConfigError

__all__ = [
    "MetricSink",
    "TensorBoardSink",
    "WandbSink",
    "open_trackers",
    "scalar_metrics",
]


class MetricSink(Protocol):
    """Where a step's metrics go besides metrics.jsonl."""

    def log_step(self, step: int, metrics: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


def scalar_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The finite numbers of a step's metrics (lists, strings, flags and missing values
    such as an undefined KL stay in metrics.jsonl only); ``step`` is the x axis."""
    return {
        name: float(value)
        for name, value in metrics.items()
        if name != "step"
        and isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
    }


class WandbSink:
    def __init__(self, run_dir: Path, config: Mapping[str, Any]) -> None:
        import wandb

        try:
            self._run = wandb.init(
                name=run_dir.name,
                dir=str(run_dir),
                config=dict(config),
                reinit="create_new",
                settings=wandb.Settings(
                    console="off",
                    silent=True,
                    x_disable_stats=True,
                    x_disable_meta=True,
                    disable_git=True,
                    save_code=False,
                ),
            )
        except Exception as exc:  # wandb raises its own types (no key, bad entity...)
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
            raise ConfigError(
                f"--log-to wandb: cannot start a W&B run ({first_line}); set WANDB_API_KEY, "
                "or WANDB_MODE=offline to log without an account"
            ) from exc

    def log_step(self, step: int, metrics: Mapping[str, Any]) -> None:
        self._run.log(scalar_metrics(metrics), step=step)

    def close(self) -> None:
        self._run.finish()


class TensorBoardSink:
    def __init__(self, log_dir: Path) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary = Event, Summary
        log_dir.mkdir(parents=True, exist_ok=True)
        self._writer = EventFileWriter(str(log_dir))

    def log_step(self, step: int, metrics: Mapping[str, Any]) -> None:
        values = [
            self._summary.Value(tag=name, simple_value=value)
            for name, value in scalar_metrics(metrics).items()
        ]
        self._writer.add_event(
            self._event(wall_time=time.time(), step=step, summary=self._summary(value=values))
        )
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def open_trackers(
    names: Sequence[str], run_dir: Path, config: Mapping[str, Any]
) -> list[tuple[str, MetricSink]]:
    """(name, sink) per tracker name (each checked by EngineConfig); if one cannot be
    opened, those already opened are closed and the error propagates."""
    sinks: list[tuple[str, MetricSink]] = []
    with contextlib.ExitStack() as undo:
        for name in names:
            sink: MetricSink
            if name == "wandb":
                sink = WandbSink(run_dir, config)
            elif name == "tensorboard":
                sink = TensorBoardSink(run_dir / "tensorboard")
            else:
                raise ConfigError(f"unknown tracker {name!r}: use {', '.join(TRACKERS)}")
            undo.callback(sink.close)
            sinks.append((name, sink))
        undo.pop_all()
    return sinks
