"""A run directory's data as the run report reads it (:class:`RunData`, :func:`load_run`):
its steps, held-out evaluations, summary and one line of its settings. Needs nothing
beyond the standard library."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.common.steplog import StepLines, read_step_lines
from engine.config.records import CONFIG_FILE
from engine.errors import ConfigError
from engine.loop.evaluation import EVAL_FILE
from engine.objectives import OBJECTIVES

__all__ = ["RunData", "load_run", "run_settings"]


@dataclass(frozen=True)
class RunData:
    label: str
    run_dir: Path
    steps: list[dict[str, Any]]
    summary: dict[str, Any] | None
    evals: list[dict[str, Any]] = field(default_factory=list)
    """The held-out evaluations (``eval.jsonl``), step 0 first; empty without one."""
    warnings: list[str] = field(default_factory=list)
    """One line per file whose damaged lines were skipped."""
    settings: str = ""
    """What the run trained and how, one line of its ``config.json`` (:func:`run_settings`);
    "" without a readable one."""

    def series(self, name: str) -> tuple[list[int], list[float | None]]:
        """(step numbers, values) of one metric; None where a step lacks it."""
        return _series(self.steps, name)

    def eval_series(self, name: str) -> tuple[list[int], list[float | None]]:
        """(step numbers, values) of one ``eval/*`` metric, one point per evaluation."""
        return _series(self.evals, name)

    def has(self, name: str) -> bool:
        return any(_number(m.get(name)) is not None for m in self.steps)

    def eval_has(self, name: str) -> bool:
        return any(_number(e.get(name)) is not None for e in self.evals)

    @property
    def trained_nothing(self) -> str | None:
        """Why no step of the run trained anything (no datums in any step), else None."""
        if not self.has("datums") or any((_number(m.get("datums")) or 0) > 0 for m in self.steps):
            return None
        if all(_number(m.get("response_len/empty_frac")) == 1.0 for m in self.steps):
            return "every response was empty (the model cannot answer this prompt format)"
        return "every group's responses scored alike (no reward differences to learn from)"


def _series(records: list[dict[str, Any]], name: str) -> tuple[list[int], list[float | None]]:
    return [int(m["step"]) for m in records], [_number(m.get(name)) for m in records]


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def load_run(run_dir: Path, label: str | None = None) -> RunData:
    """The steps (and held-out evaluations, if any) of a run directory (ConfigError, one
    line, when it has no steps). Damaged lines are skipped and listed in
    :attr:`RunData.warnings`."""
    path = run_dir / "metrics.jsonl"
    try:
        read = read_step_lines(path)
    except OSError as exc:
        raise ConfigError(
            f"{run_dir} is not a run directory: cannot read {path.name} ({exc.strerror or exc})"
        ) from exc
    if not read.records:
        damage = f" ({len(read.damaged)} damaged line(s))" if read.damaged else ""
        raise ConfigError(f"{path} holds no steps yet{damage}")
    warnings = [read.warning()]
    try:
        evals = read_step_lines(run_dir / EVAL_FILE)
        warnings.append(evals.warning())
    except OSError:
        evals = StepLines(run_dir / EVAL_FILE)  # a run without --eval-every
    return RunData(
        label or run_dir.name,
        run_dir,
        read.records,
        _json_object(run_dir / "summary.json"),
        evals.records,
        [w for w in warnings if w is not None],
        run_settings(_json_object(run_dir / CONFIG_FILE) or {}),
    )


def _json_object(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``; None when it is missing, unreadable or not one."""
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    return loaded if isinstance(loaded, dict) else None


def run_settings(config: dict[str, Any]) -> str:
    """One line of what a run trained and how, from its ``config.json``: the model, the
    task, the objective (and its loss), the learning rate and, for a run that samples, K
    (``--max-steps-off-policy``), ``--batch`` and ``--group``. A value the file lacks, or
    holds as no plain value, is left out; a text is cut to 60 characters."""

    def value(group: str | None, key: str) -> str | None:
        section = config if group is None else config.get(group)
        raw = section.get(key) if isinstance(section, dict) else None
        if isinstance(raw, int) and not isinstance(raw, bool):
            return str(raw)
        if isinstance(raw, float) and math.isfinite(raw):
            return f"{raw:.3g}"
        return (" ".join(raw.split())[:60].strip() or None) if isinstance(raw, str) else None

    objective = value("training", "objective")
    known = OBJECTIVES.get(objective) if objective is not None else None
    sampled = known is not None and known.samples
    loss = value("training", "loss") if sampled else None
    fields = [
        ("model", value("model", "base_model")),
        ("task", value(None, "task_name") or value("task", "spec")),
        ("objective", f"{objective} (loss {loss})" if loss else objective),
        ("lr", value("training", "learning_rate")),
    ]
    if sampled:
        fields += [
            ("K=", value("pipeline", "max_steps_off_policy")),
            ("batch", value("pipeline", "batch")),
            ("group", value("pipeline", "group")),
        ]
    return ", ".join(
        f"{name}{text}" if name.endswith("=") else f"{name} {text}"
        for name, text in fields
        if text is not None
    )
