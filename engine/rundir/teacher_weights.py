"""Where ``--teacher`` points (``--objective distill``, docs/distillation.md): a run
directory stands for its latest checkpoint's sampler weights. On the local server a
run's weights live in that run's own ``local-server/`` directory, so a teacher run's
weights are copied into the student's server directory before they are opened."""

from __future__ import annotations

from pathlib import Path

from engine.errors import ConfigError
from engine.rundir.checkpoint_copy import copy_checkpoint_files, relative_checkpoint_path
from engine.rundir.checkpoint_log import CHECKPOINTS_FILE, CheckpointLog
from engine.rundir.directory import LOCAL_SERVER_DIR

__all__ = ["teacher_weights"]


def teacher_weights(source: str, local_server: Path | None = None) -> str:
    """What ``--teacher source`` opens: a run directory's latest sampler weights (with
    ``local_server``, the student's local server directory: copied there from the
    teacher run's as :func:`copy_checkpoint_files` copies them), or ``source`` itself
    (``tinker://`` sampler weights, a base model)."""
    run_dir = Path(source)
    if not run_dir.is_dir():
        return source
    latest = CheckpointLog(run_dir).latest()
    if latest is None or latest.sampler_path is None:
        raise ConfigError(
            f"--teacher {source} is a directory without a checkpoint that has sampler "
            f"weights ({CHECKPOINTS_FILE}); give a run directory that saved one, or a "
            "tinker://.../sampler_weights/ path"
        )
    path = latest.sampler_path
    # The second stage of a --then command keeps its weights in its first stage's dir.
    relative = relative_checkpoint_path(path)
    roots = [d / LOCAL_SERVER_DIR for d in (run_dir, run_dir.parent)]
    root = next((r for r in roots if (r / relative).is_dir()), roots[0])
    saved = root / relative
    if local_server is not None and saved.is_dir():
        copy = local_server / relative
        if not copy.exists():
            copy_checkpoint_files(saved, copy, within=root)
    return path
