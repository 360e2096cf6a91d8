"""Find a checkpoint's files on this machine, whatever names it: ``engine.export`` and
``engine.eval`` accept the same CHECKPOINT argument.

A CHECKPOINT is one of:

- a checkpoint directory (``meta.json`` + ``adapter.safetensors``, as the local server
  writes them under its data dir);
- a run directory (``checkpoints.jsonl``): its last checkpoint, or the one of ``step``;
  the files are in the run's ``local-server/`` data dir when the local server trained it;
- a ``tinker://`` path: under ``data_dir`` when given (a local server's ``--data-dir``),
  else downloaded through the SDK's checkpoint archive URL (hosted MinT, or a running
  local server at ``base_url``).
"""

from __future__ import annotations

import json
import shutil
import tarfile
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from engine.errors import ConfigError
from engine.rundir.checkpoint_copy import (
    MAX_CHECKPOINT_BYTES,
    check_checkpoint_files,
    relative_checkpoint_path,
)
from engine.rundir.checkpoint_log import CHECKPOINTS_FILE
from engine.rundir.directory import LOCAL_SERVER_DIR

__all__ = ["CheckpointRef", "checkpoint_directory", "resolve_checkpoint"]

SCHEME = "tinker://"
META_FILE = "meta.json"


@dataclass(frozen=True)
class CheckpointRef:
    """What a CHECKPOINT argument names: a local directory (when its files are here), the
    ``tinker://`` path (when known) and the step it holds (when known)."""

    directory: Path | None
    tinker_path: str | None
    step: int | None = None
    run_dir: Path | None = None
    root: Path | None = None
    """The directory ``directory`` must lie in (a run's local-server dir, a --data-dir)."""


def resolve_checkpoint(
    checkpoint: str, *, step: int | None = None, data_dir: Path | None = None
) -> CheckpointRef:
    """Resolve CHECKPOINT (see the module doc) without downloading anything; a
    ConfigError says what is wrong with it."""
    if checkpoint.startswith(SCHEME):
        local = _under(data_dir, checkpoint) if data_dir is not None else None
        return CheckpointRef(local, checkpoint, root=data_dir)
    path = Path(checkpoint).expanduser()
    if (path / META_FILE).is_file():
        return CheckpointRef(path, None)
    if (path / CHECKPOINTS_FILE).is_file():
        record = _record(path, step)
        state = str(record["state_path"])
        local = _under(path / LOCAL_SERVER_DIR, state)
        return CheckpointRef(local, state, int(record["step"]), path, path / LOCAL_SERVER_DIR)
    if path.exists():
        raise ConfigError(
            f"{checkpoint} is neither a checkpoint directory (no {META_FILE}) nor a run "
            f"directory (no {CHECKPOINTS_FILE})"
        )
    raise ConfigError(
        f"checkpoint {checkpoint!r} does not exist (give a run directory, a checkpoint "
        "directory or a tinker:// path)"
    )


def _record(run_dir: Path, step: int | None) -> dict[str, Any]:
    records: list[dict[str, Any]] = []
    for line in (run_dir / CHECKPOINTS_FILE).read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line torn by a crash (CheckpointLog says so when it reads it)
        if isinstance(record, dict) and "state_path" in record and "step" in record:
            records.append(record)
    if not records:
        raise ConfigError(f"{run_dir} has no checkpoint yet ({CHECKPOINTS_FILE} is empty)")
    if step is None:
        return records[-1]
    for record in reversed(records):
        if int(record["step"]) == step:
            return record
    steps = ", ".join(str(r["step"]) for r in records)
    raise ConfigError(f"{run_dir} has no checkpoint of step {step} (it has steps {steps})")


def _under(data_dir: Path, tinker_path: str) -> Path | None:
    """The directory a local server with ``data_dir`` keeps ``tinker_path`` in, if there."""
    directory = data_dir / relative_checkpoint_path(tinker_path)
    return directory if (directory / META_FILE).is_file() else None


@contextmanager
def checkpoint_directory(
    ref: CheckpointRef, *, base_url: str | None = None, api_key: str | None = None
) -> Iterator[Path]:
    """The checkpoint's files in a directory: its own (checked as
    :func:`~engine.rundir.checkpoint_copy.check_checkpoint_files` says), or a temporary one
    holding the archive downloaded through the SDK (removed on exit)."""
    if ref.directory is not None:
        check_checkpoint_files(ref.directory, within=ref.root)
        yield ref.directory
        return
    if ref.tinker_path is None:  # resolve_checkpoint never builds this
        raise ConfigError("the checkpoint names neither a directory nor a tinker:// path")
    with tempfile.TemporaryDirectory(prefix="engine-checkpoint-") as tmp:
        archive = Path(tmp) / "checkpoint.tar.gz"
        _download(_archive_url(ref.tinker_path, base_url, api_key), archive)
        dest = Path(tmp) / "checkpoint"
        dest.mkdir()
        _extract(archive, dest)
        yield dest


def _archive_url(tinker_path: str, base_url: str | None, api_key: str | None) -> str:
    import mint

    client = mint.ServiceClient(api_key=api_key, base_url=base_url).create_rest_client()
    try:
        response = client.get_checkpoint_archive_url_from_tinker_path(tinker_path).result()
    except Exception as exc:  # the SDK raises its own types for 4xx/5xx and transport
        raise ConfigError(
            f"cannot get the archive of {tinker_path}: {str(exc).splitlines()[0]}"
        ) from exc
    return str(response.url)


def _download(url: str, dest: Path) -> None:
    try:
        with httpx.stream("GET", url, follow_redirects=True, timeout=60.0) as response:
            response.raise_for_status()
            written = 0
            with dest.open("wb") as out:
                for chunk in response.iter_bytes():
                    written += len(chunk)
                    if written > MAX_CHECKPOINT_BYTES:
                        raise ConfigError(
                            f"the checkpoint archive is larger than {MAX_CHECKPOINT_BYTES} bytes"
                        )
                    out.write(chunk)
    except httpx.HTTPError as exc:
        raise ConfigError(f"cannot download the checkpoint archive: {exc}") from exc


def _extract(archive: Path, dest: Path) -> None:
    """Regular files only, flattened into ``dest`` (links and '..' paths refused), at
    most MAX_CHECKPOINT_BYTES of them."""
    try:
        with tarfile.open(archive, "r:*") as tar:
            members = tar.getmembers()
            if sum(m.size for m in members if m.isfile()) > MAX_CHECKPOINT_BYTES:
                raise ConfigError(
                    f"the checkpoint archive unpacks to more than {MAX_CHECKPOINT_BYTES} bytes"
                )
            for member in members:
                if member.isdir():
                    continue
                name = Path(member.name).name
                if not member.isfile() or ".." in Path(member.name).parts or not name:
                    raise ConfigError(
                        f"the checkpoint archive holds an unsafe entry {member.name!r}"
                    )
                source = tar.extractfile(member)
                assert source is not None
                with source, (dest / name).open("wb") as out:
                    shutil.copyfileobj(source, out)
    except (tarfile.TarError, OSError) as exc:
        raise ConfigError(f"the checkpoint archive is unreadable: {exc}") from exc
