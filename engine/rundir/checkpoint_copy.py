"""What reading a checkpoint directory of a run trusts (docs/reliability.md, "What reading
a run directory trusts"): its files are read and copied as regular files only, never
through a symbolic link and never from a device, FIFO or socket, and together they hold
at most :data:`MAX_CHECKPOINT_BYTES`. Anything else is refused with one line naming the
path, before a byte is copied. ``engine.eval``, ``engine.serve``, ``engine.export`` and a
distillation ``--teacher`` given as a run directory all read checkpoints through here;
``checkpoints.jsonl`` is read as a regular file by the same rule
(:func:`read_regular_file`)."""

from __future__ import annotations

import errno
import os
import shutil
import stat
from pathlib import Path
from typing import BinaryIO

from engine.errors import ConfigError

__all__ = [
    "MAX_CHECKPOINT_BYTES",
    "check_checkpoint_files",
    "copy_checkpoint_files",
    "read_regular_file",
    "relative_checkpoint_path",
]

MAX_CHECKPOINT_BYTES = 4 << 30
"""The most a checkpoint's files may hold together, copied from a directory or downloaded
as an archive. A saved state is the LoRA adapter plus Adam's two moments (about three
times the adapter): a rank-64 LoRA on every linear module of an 8B model is ~0.7 GB, its
state ~2 GB, so 4 GiB holds any checkpoint the engine writes for such models."""
_CHUNK = 1 << 20
_KINDS = (
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISCHR, "a device"),
    (stat.S_ISBLK, "a device"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
)


def relative_checkpoint_path(tinker_path: str) -> Path:
    """Where a local server keeps ``tinker_path`` under its data dir (``<run>/<kind>/<name>``);
    a ConfigError unless it has that form (no empty, '.' or '..' part)."""
    parts = tinker_path.removeprefix("tinker://").split("/")
    if (
        not tinker_path.startswith("tinker://")
        or len(parts) != 3
        or any(p in ("", ".", "..") for p in parts)
    ):
        raise ConfigError(
            f"checkpoint path {tinker_path!r} must look like tinker://<run>/weights/<name>"
        )
    return Path(*parts)


def _refuse(path: Path, mode: int) -> ConfigError:
    kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
    return ConfigError(
        f"{path} is {kind}: a checkpoint's files are read as regular files only "
        "(docs/reliability.md)"
    )


def check_checkpoint_files(directory: Path, *, within: Path | None = None) -> dict[str, int]:
    """The files of the checkpoint ``directory`` and their sizes, opening none of them: a
    ConfigError names the first entry that is not a regular file (links are not followed),
    the file that takes the total over MAX_CHECKPOINT_BYTES, or the directory when it does not
    lie inside ``within`` (the run's local-server dir, a server's data dir)."""
    if within is not None and not directory.resolve().is_relative_to(within.resolve()):
        raise ConfigError(
            f"{directory} leads outside {within}: a run's checkpoints are read from its "
            "own directory only"
        )
    sizes: dict[str, int] = {}
    total = 0
    try:
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
    except OSError as exc:
        raise ConfigError(f"cannot read the checkpoint directory {directory}: {exc}") from exc
    for entry in entries:
        path = Path(entry.path)
        mode = entry.stat(follow_symlinks=False).st_mode
        if not stat.S_ISREG(mode):
            raise _refuse(path, mode)
        size = entry.stat(follow_symlinks=False).st_size
        total += size
        if total > MAX_CHECKPOINT_BYTES:
            raise ConfigError(
                f"{path} takes the checkpoint's files over {MAX_CHECKPOINT_BYTES} bytes "
                "(MAX_CHECKPOINT_BYTES, docs/reliability.md)"
            )
        sizes[entry.name] = size
    return sizes


def copy_checkpoint_files(directory: Path, dest: Path, *, within: Path | None = None) -> None:
    """Copy the checkpoint ``directory`` to the new directory ``dest``, checked first as
    :func:`check_checkpoint_files` says (nothing is copied when it refuses). Each file is
    opened without following links and copied only while it is the regular file of the
    size that was checked; a copy that fails is removed."""
    sizes = check_checkpoint_files(directory, within=within)
    dest.mkdir(parents=True)
    try:
        for name, size in sizes.items():
            _copy_file(directory / name, dest / name, size)
    except BaseException:
        shutil.rmtree(dest, ignore_errors=True)
        raise


def read_regular_file(path: Path) -> bytes:
    """The bytes of ``path``, read as a regular file of the run directory: opened without
    following a link, and refused (ConfigError naming it) when it is not a regular file,
    so a ``checkpoints.jsonl`` that is a FIFO or a link to ``/dev/zero`` cannot hang or
    fill memory. FileNotFoundError when it does not exist."""
    with _open_regular(path) as file:
        return file.read()


def _open_regular(path: Path) -> BinaryIO:
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a link
            raise _refuse(path, path.lstat().st_mode) from None
        if isinstance(exc, FileNotFoundError):
            raise
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    file = os.fdopen(fd, "rb")
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        file.close()
        raise _refuse(path, mode)
    return file


def _copy_file(source: Path, dest: Path, size: int) -> None:
    try:
        opened = _open_regular(source)
    except FileNotFoundError:
        raise ConfigError(f"{source} was removed while the checkpoint was copied") from None
    with opened as src, dest.open("xb") as out:
        left = size
        while left > 0:
            chunk = src.read(min(_CHUNK, left))
            if not chunk:
                break
            out.write(chunk)
            left -= len(chunk)
        if left != 0 or src.read(1):
            raise ConfigError(f"{source} changed while it was copied ({size} bytes were checked)")
