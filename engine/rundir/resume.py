"""Resuming a run directory: its stored config, read strictly (one reader: a missing or
unreadable ``config.json`` is a one-line :class:`~engine.errors.ResumeError`) and merged
into the config given now in one place (:func:`resumed_config`), compared
with the config given now (settings that change what is trained must not change), and
its latest checkpoint."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from engine.config import EngineConfig, nest_record, resume_rule, with_stored_settings
from engine.config.models import setting_at
from engine.config.records import CONFIG_FILE
from engine.config.sources import BEFORE_RECORDED
from engine.errors import NoCheckpointYet, ResumeError
from engine.redact import REDACTED, redact_config
from engine.rundir.checkpoint_log import CHECKPOINTS_FILE, CheckpointLog, CheckpointRecord

__all__ = [
    "CONFIG_FILE",
    "DATA_DIGEST",
    "METRICS_FILE",
    "ResumeState",
    "has_trained_steps",
    "load_resume_state",
    "read_run_config",
    "resumed_config",
]

METRICS_FILE: Final = "metrics.jsonl"
DATA_DIGEST: Final = "task_data_digest"


def has_trained_steps(directory: Path) -> bool:
    """Whether the run dir's metrics.jsonl holds a step."""
    try:
        return bool((directory / METRICS_FILE).read_bytes().strip())
    except FileNotFoundError:
        return False


@dataclass(frozen=True)
class ResumeState:
    """What the engine needs to continue a run: its stored config and the checkpoint."""

    run_dir: Path
    config: dict[str, Any]
    checkpoint: CheckpointRecord

    @property
    def step(self) -> int:
        return self.checkpoint.step

    @property
    def loop_state(self) -> dict[str, Any]:
        return self.checkpoint.loop_state


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, Mapping) and value:
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: value}


_UNTRAINED_RECORD: Final = ("task_repr",)
"""Keys config.json holds beside the settings that may differ on a resume (the task's
repr may name a memory address)."""


def _may_change(key: str) -> bool:
    return key in _UNTRAINED_RECORD or resume_rule(key) != "fixed"


def _default_of(key: str) -> Any:
    """The JSON form of setting ``key``'s default (None when it has none), or what it was
    before run dirs recorded it (:data:`~engine.config.sources.BEFORE_RECORDED`)."""
    if key in BEFORE_RECORDED:
        return BEFORE_RECORDED[key]
    setting = setting_at(key)
    return None if setting is None else json.loads(json.dumps(setting.default, default=str))


def _config_mismatches(stored: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    # Compare the redacted current config: that is the form config.json holds; a
    # config.json from before the settings groups is compared in the groups' layout.
    old = _flatten(json.loads(json.dumps(nest_record(stored), default=str)))
    new = _flatten(json.loads(json.dumps(nest_record(redact_config(current)), default=str)))
    problems = []
    for key in sorted(set(old) | set(new)):
        if _may_change(key) or REDACTED in (str(old.get(key)), str(new.get(key))):
            continue
        if key == DATA_DIGEST:  # checked on its own (a run dir from before has none)
            continue
        if key not in old:
            if _default_of(key) == new[key]:
                continue  # a setting newer than the run, at its default: nothing changes
            problems.append(f"{key} is new ({new[key]!r})")
        elif key not in new:
            if old[key] is None:
                continue  # an unset setting of a run from before: nothing was trained by it
            problems.append(f"{key} is missing (run dir has {old[key]!r})")
        elif old[key] != new[key]:
            problems.append(f"{key} is {old[key]!r} in the run dir but {new[key]!r} now")
    return problems


def read_run_config(directory: Path) -> dict[str, Any]:
    """The stored config of the run dir ``directory``; ResumeError (one line, exit 2)
    when it is missing, not a directory, or holds no readable config.json."""
    if not directory.exists():
        raise ResumeError(f"cannot resume: {directory} does not exist")
    if not directory.is_dir():
        raise ResumeError(f"cannot resume: {directory} is not a directory")
    config_path = directory / CONFIG_FILE
    if not config_path.is_file():
        raise ResumeError(f"cannot resume: {directory} is not a run directory (no {CONFIG_FILE})")
    try:
        stored = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ResumeError(f"cannot resume: {config_path} is not valid JSON ({exc})") from None
    if not isinstance(stored, dict):
        raise ResumeError(f"cannot resume: {config_path} does not hold a JSON object")
    return _packaged_model_by_name(stored)


def resumed_config(config: EngineConfig, run_dir: Path | None = None) -> EngineConfig:
    """``config`` resuming ``run_dir`` (default: its ``checkpoints.resume``; none: ``config``
    as it is): it keeps the settings stored in the run dir's config.json unless ``config``
    sets them anew (:func:`~engine.config.with_stored_settings`, the one rule). The command
    line, :class:`~engine.stages.Stages` and :class:`~engine.Engine` all merge through
    here; ResumeError (exit 2) when the run dir cannot be read."""
    run_dir = run_dir if run_dir is not None else config.checkpoints.resume
    if run_dir is None:
        return config
    return with_stored_settings(config, read_run_config(run_dir), str(run_dir / CONFIG_FILE))


def _packaged_model_by_name(stored: dict[str, Any]) -> dict[str, Any]:
    """A run dir written before packaged models were recorded by name names one by its
    directory (maybe of another checkout): read it as the name the engine records now."""
    from engine.basemodels.catalogue import recorded_packaged_name  # the standard library only

    session = stored.get("session")
    model = session.get("local_model") if isinstance(session, dict) else None
    if isinstance(session, dict) and isinstance(model, str):
        name = recorded_packaged_name(model)
        if name is not None:
            return {**stored, "session": {**session, "local_model": name}}
    return stored


def load_resume_state(
    run_dir: str | os.PathLike[str],
    *,
    current_config: Mapping[str, Any] | None = None,
    log: Any = None,
) -> ResumeState:
    """Validate ``run_dir`` and return its config and latest checkpoint.

    Raises :class:`~engine.errors.ResumeError` (exit code 2, one line) when the
    directory is missing, is not a run dir (no config.json), has no checkpoint yet, or
    when ``current_config`` differs from the stored config in a key that may not change
    (:func:`engine.config.resume_rule`);
    :class:`~engine.errors.NoCheckpointYet` (a ResumeError) when it holds only an
    unfinished start-up, which a caller may start over in (:func:`prepare_run_dir`).
    """
    directory = Path(run_dir)
    stored = read_run_config(directory)
    latest = CheckpointLog(directory, log=log).latest()
    if latest is None:
        error = ResumeError if has_trained_steps(directory) else NoCheckpointYet
        raise error(
            f"cannot resume: {directory} has no checkpoint yet ({CHECKPOINTS_FILE} is missing "
            "or empty); start a new run instead"
        )
    if current_config is not None:
        _check_same_data(directory, stored, current_config)
        problems = _config_mismatches(stored, current_config)
        if problems:
            shown = "; ".join(problems[:5]) + ("; ..." if len(problems) > 5 else "")
            raise ResumeError(
                f"cannot resume {directory}: the config differs from its {CONFIG_FILE}: {shown} "
                "(use the same settings, or a new run dir)"
            )
    return ResumeState(run_dir=directory, config=stored, checkpoint=latest)


def _check_same_data(
    directory: Path, stored: Mapping[str, Any], current: Mapping[str, Any]
) -> None:
    old, new = stored.get(DATA_DIGEST), current.get(DATA_DIGEST)
    if old is not None and new is not None and old != new:
        raise ResumeError(
            f"cannot resume {directory}: the task's data changed since the run started "
            f"({str(old)[:19]}... in its {CONFIG_FILE}, {str(new)[:19]}... now); resume "
            "with the same dataset, or start a new run"
        )
