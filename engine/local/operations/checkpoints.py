"""Training runs and checkpoints on disk: records, TTLs, publishing, deletion, archives
and uploads.

A training run is a directory ``<data_dir>/<run_id>/`` with ``run.json`` (base model,
LoRA rank, creation time) and its checkpoints under ``weights/<name>/`` and
``sampler_weights/<name>/`` (see ``storage.py``). Next to a checkpoint's files,
``access.json`` holds what the management API changes: creation time, ``public`` and
``expires_at``. Everything is on disk, so a server restarted on the same data dir lists,
serves and expires what an earlier process saved.

Archives are ``.tar.gz`` files with the checkpoint's files at the root plus an empty
``checkpoint_complete`` marker (as the hosted service's archives have); an uploaded
archive of that form becomes a new checkpoint under a fresh ``upload-<hex>`` run. An
upload works in a ``.upload-*`` dir of the data dir; leftovers of uploads that could not
clean up are removed at start and by the housekeeping sweep.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import json
import mmap
import os
import re
import secrets
import shutil
import tarfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import formatdate
from pathlib import Path
from typing import Any

import anyio

from engine.local.compute.backend_types import BackendError
from engine.local.http.wire import WireError
from engine.local.models.storage import KINDS, BadPath, Kind, TinkerPath, check_model_id, check_name
from engine.local.operations.core import Core, HttpError
from engine.local.operations.jobs import Job

RUN_FILE = "run.json"
ACCESS_FILE = "access.json"
COMPLETE_MARKER = "checkpoint_complete"
CHECKPOINT_FILES = frozenset(
    {"meta.json", "adapter.safetensors", "optimizer.safetensors", COMPLETE_MARKER}
)
ARCHIVE_URL_TTL_S = 15 * 60
ARCHIVES_KEPT = 16
MAX_TTL_S = 10 * 365 * 24 * 3600
"""Longest checkpoint TTL accepted (10 years); longer ones are refused, not clamped."""
MAX_ARCHIVE_ENTRIES = 16
"""Entries of any kind (files, directories, ...) an uploaded archive may hold; a
checkpoint archive holds at most four files."""
MAX_ARCHIVE_HEADER_BYTES = 1 << 20
"""Decompressed bytes of an uploaded archive that are not file contents (tar headers,
pax and long-name records)."""
UPLOAD_PREFIX = ".upload-"
_LATEST = datetime(9999, 12, 31, tzinfo=UTC).timestamp()
NO_RETRY = {"x-should-retry": "false"}
"""On a 409: the SDK's HTTP layer must not retry it (its RestClient still does, for up
to 5 minutes, as against the hosted service)."""
_TYPES = {"weights": "training", "sampler_weights": "sampler"}


@dataclass(frozen=True)
class StoredCheckpoint:
    """A checkpoint the server keeps under its data dir, as its listing shows it."""

    path: TinkerPath
    created: float
    size_bytes: int
    public: bool
    expires_at: float | None
    user_metadata: dict[str, str] | None = None
    """Set by the client when saving (tinker >= 0.38); listed only when set."""

    def to_json(self) -> dict[str, Any]:
        extra = {} if self.user_metadata is None else {"user_metadata": self.user_metadata}
        return {
            **extra,
            "checkpoint_id": f"{self.path.kind}/{self.path.name}",
            "checkpoint_type": _TYPES[self.path.kind],
            "time": iso(self.created),
            "tinker_path": str(self.path),
            "size_bytes": self.size_bytes,
            "public": self.public,
            "expires_at": iso(self.expires_at) if self.expires_at is not None else None,
        }


@dataclass
class _Archive:
    file: Path
    expires: float


def iso(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, UTC).isoformat()


def valid_time(value: Any) -> float | None:
    """A timestamp read from disk, or None if it is not one ``iso`` can write (a file
    edited by hand, or written before TTLs were bounded): treated as absent."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if 0 <= value <= _LATEST else None


def check_ttl(ttl_seconds: Any) -> None:
    """Accept None (no expiry) or a whole number of seconds in 1..MAX_TTL_S."""
    if ttl_seconds is None:
        return
    if (
        isinstance(ttl_seconds, bool)
        or not isinstance(ttl_seconds, int)
        or not 1 <= ttl_seconds <= MAX_TTL_S
    ):
        raise WireError(
            f"ttl_seconds must be null or a whole number of seconds from 1 to at most "
            f"{MAX_TTL_S} (10 years), got {ttl_seconds!r}"
        )


class CheckpointStore:
    def __init__(self, core: Core) -> None:
        self.core = core
        self.data_dir = core.data_dir
        self._reading: dict[str, int] = {}
        """Checkpoint paths a load or an archive is reading right now."""
        self._archives: dict[str, _Archive] = {}
        self.uploads_in_flight = 0
        self._remove_upload_leftovers()

    # ---- training runs ----------------------------------------------------------------

    def write_run(
        self, run_id: str, base_model: str, rank: int, user_metadata: dict[str, Any] | None
    ) -> None:
        run_dir = self.data_dir / run_id
        run_dir.mkdir(parents=True, exist_ok=True)
        record = {
            "training_run_id": run_id,
            "base_model": base_model,
            "lora_rank": rank,
            "created": self.core.now(),
            "user_metadata": {str(k): str(v) for k, v in (user_metadata or {}).items()} or None,
        }
        tmp = run_dir / f".{RUN_FILE}.tmp"
        tmp.write_text(json.dumps(record, indent=2))
        os.replace(tmp, run_dir / RUN_FILE)

    def run_ids(self) -> list[str]:
        if not self.data_dir.is_dir():
            return []
        return [
            p.name
            for p in self.data_dir.iterdir()
            if p.is_dir() and _valid_name(p.name, check_model_id) and (p / RUN_FILE).is_file()
        ]

    def run_record(self, run_id: str) -> dict[str, Any] | None:
        try:
            check_model_id(run_id, "training run id")
        except BadPath as exc:
            raise HttpError(400, str(exc)) from None
        try:
            record = json.loads((self.data_dir / run_id / RUN_FILE).read_text())
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) else None

    # ---- checkpoint records -------------------------------------------------------------

    def records(self, run_id: str) -> list[StoredCheckpoint]:
        """The run's live checkpoints, oldest first (expired ones are deleted here)."""
        out: list[StoredCheckpoint] = []
        for kind in KINDS:
            kind_dir = self.data_dir / run_id / kind
            if not kind_dir.is_dir():
                continue
            for entry in kind_dir.iterdir():
                if not _valid_name(entry.name) or not (entry / "meta.json").is_file():
                    continue  # a temp dir of a save in progress, or foreign files
                record = self.record(TinkerPath(run_id, kind, entry.name))
                if record is not None:
                    out.append(record)
        return sorted(out, key=lambda r: (r.created, str(r.path)))

    def record(self, path: TinkerPath) -> StoredCheckpoint | None:
        """The checkpoint's record, or None if it does not exist (or just expired)."""
        directory = path.directory(self.data_dir)
        meta = directory / "meta.json"
        if not meta.is_file():
            return None
        access = _read_json(directory / ACCESS_FILE)
        created = valid_time(access.get("created"))
        metadata = access.get("user_metadata")
        record = StoredCheckpoint(
            path=path,
            created=meta.stat().st_mtime if created is None else created,
            size_bytes=sum(f.stat().st_size for f in directory.iterdir() if f.is_file()),
            public=bool(access.get("public", False)),
            expires_at=valid_time(access.get("expires_at")),
            user_metadata=metadata if isinstance(metadata, dict) else None,
        )
        expired = record.expires_at is not None and record.expires_at <= self.core.now()
        if expired and not self._in_use(path):
            self._remove(path)
            return None
        return record

    def find(self, path_text: str) -> tuple[TinkerPath, StoredCheckpoint]:
        """Parse a tinker path and return its live record (HTTP 400 / 404 otherwise)."""
        try:
            path = TinkerPath.parse(path_text)
        except BadPath as exc:
            raise HttpError(400, str(exc)) from None
        record = self.record(path)
        if record is None:
            where = path.directory(self.data_dir)
            raise HttpError(404, f"checkpoint {path} not found (looked in {where})")
        return path, record

    def expire_if_due(self, path_text: str) -> None:
        """Delete the checkpoint at ``path_text`` if its TTL has passed (a load after
        the expiry then fails with "not found")."""
        with contextlib.suppress(BadPath):
            self.record(TinkerPath.parse(path_text))

    def sweep(self) -> int:
        """Delete every expired checkpoint and archive URL (and, with no upload in
        progress, upload leftovers); return how many checkpoints."""
        if not self.uploads_in_flight:
            self._remove_upload_leftovers()
        now = self.core.now()
        for token in [t for t, a in self._archives.items() if a.expires <= now]:
            self._drop_archive(token)
        before = sum(len(self._listing(run)) for run in self.run_ids())
        after = sum(len(self.records(run)) for run in self.run_ids())
        return before - after

    def _listing(self, run_id: str) -> list[Path]:
        return [
            entry
            for kind in KINDS
            if (self.data_dir / run_id / kind).is_dir()
            for entry in (self.data_dir / run_id / kind).iterdir()
            if (entry / "meta.json").is_file()
        ]

    def _in_use(self, path: TinkerPath) -> bool:
        """A live sampling session samples from it, or a load or an archive reads it."""
        key = str(path)
        return bool(self._reading.get(key)) or key in self.core.registry.paths_in_use()

    def _remove(self, path: TinkerPath) -> None:
        shutil.rmtree(path.directory(self.data_dir), ignore_errors=True)

    # ---- hooks for training operations --------------------------------------------------

    def on_saved(
        self, job: Job, ttl_seconds: int | None, user_metadata: dict[str, Any] | None = None
    ) -> Job:
        """``job`` (a named save) that also records the checkpoint's creation time,
        with ``ttl_seconds`` when it expires, and the client's ``user_metadata``."""
        check_ttl(ttl_seconds)
        inner = job.finish

        def finish(result: Any) -> dict[str, Any]:
            payload = inner(result)
            path = TinkerPath.parse(payload["path"])
            now = self.core.now()
            access: dict[str, Any] = {
                "created": now,
                "expires_at": now + ttl_seconds if ttl_seconds else None,
            }
            if user_metadata:
                access["user_metadata"] = {str(k): str(v) for k, v in user_metadata.items()}
            _write_json(path.directory(self.data_dir) / ACCESS_FILE, access)
            return payload

        return dataclasses.replace(job, finish=finish)

    @contextlib.contextmanager
    def reading(self, path: TinkerPath | str) -> Iterator[None]:
        """Mark ``path`` as being read (not deleted, not expired) inside the block."""
        key = str(path)
        self._reading[key] = self._reading.get(key, 0) + 1
        try:
            yield
        finally:
            self._end_read(key)

    def _end_read(self, key: str) -> None:
        left = self._reading.get(key, 0) - 1
        if left > 0:
            self._reading[key] = left
        else:
            self._reading.pop(key, None)

    # ---- management ---------------------------------------------------------------------

    def delete(self, path: TinkerPath) -> None:
        if self.record(path) is None:
            raise HttpError(404, f"checkpoint {path} not found")
        if self._in_use(path):
            raise HttpError(
                409,
                f"checkpoint {path} is in use (a sampling client samples from it, or a load "
                "or an archive reads it); close that first",
                headers=NO_RETRY,
            )
        self._remove(path)

    def set_public(self, path: TinkerPath, public: bool) -> None:
        record = self.record(path)
        if record is None:
            raise HttpError(404, f"checkpoint {path} not found")
        if record.public == public:
            state = "public" if public else "private"
            raise HttpError(409, f"checkpoint {path} is already {state}", headers=NO_RETRY)
        self._update_access(path, public=public)

    def set_ttl(self, path: TinkerPath, ttl_seconds: Any) -> None:
        try:
            check_ttl(ttl_seconds)
        except WireError as exc:
            raise HttpError(400, str(exc)) from None
        if self.record(path) is None:
            raise HttpError(404, f"checkpoint {path} not found")
        expires = self.core.now() + ttl_seconds if ttl_seconds is not None else None
        self._update_access(path, expires_at=expires)

    def _update_access(self, path: TinkerPath, **changes: Any) -> None:
        file = path.directory(self.data_dir) / ACCESS_FILE
        access = _read_json(file)
        if "created" not in access:
            access["created"] = (path.directory(self.data_dir) / "meta.json").stat().st_mtime
        access.update(changes)
        _write_json(file, access)

    # ---- archives -----------------------------------------------------------------------

    async def archive(self, path: TinkerPath) -> tuple[str, float]:
        """Pack the checkpoint into a .tar.gz; return (download token, expiry time)."""
        if self.record(path) is None:
            raise HttpError(404, f"checkpoint {path} not found")
        while len(self._archives) >= ARCHIVES_KEPT:
            self._drop_archive(min(self._archives, key=lambda t: self._archives[t].expires))
        out_dir = self.data_dir / ".archives"
        out_dir.mkdir(exist_ok=True)
        token = secrets.token_urlsafe(24)
        file = out_dir / f"{token}.tar.gz"
        with self.reading(path):
            await anyio.to_thread.run_sync(_pack, path.directory(self.data_dir), file)
        expires = self.core.now() + ARCHIVE_URL_TTL_S
        self._archives[token] = _Archive(file, expires)
        return token, expires

    def archive_file(self, token: str) -> Path:
        archive = self._archives.get(token)
        if archive is None or archive.expires <= self.core.now():
            raise HttpError(404, "unknown or expired archive URL; ask for a new one")
        return archive.file

    def _drop_archive(self, token: str) -> None:
        archive = self._archives.pop(token, None)
        if archive is not None:
            archive.file.unlink(missing_ok=True)

    # ---- uploads ------------------------------------------------------------------------

    @contextlib.contextmanager
    def upload_dir(self) -> Iterator[Path]:
        """A fresh work dir for one upload, removed afterwards; HTTP 503 while
        ``limits.max_concurrent_uploads`` uploads are in progress."""
        limit = self.core.config.limits.max_concurrent_uploads
        if self.uploads_in_flight >= limit:
            raise HttpError(
                503,
                f"the local server receives at most {limit} uploads at a time; retry shortly",
                category="server",
                headers={"Retry-After": "5", "Connection": "close"},
            )
        self.uploads_in_flight += 1
        work = self.data_dir / f"{UPLOAD_PREFIX}{secrets.token_hex(8)}"
        try:
            work.mkdir()
            yield work
        finally:
            self.uploads_in_flight -= 1
            shutil.rmtree(work, ignore_errors=True)

    def _remove_upload_leftovers(self) -> None:
        for leftover in self.data_dir.glob(f"{UPLOAD_PREFIX}*"):
            shutil.rmtree(leftover, ignore_errors=True)

    async def upload(self, archive: Path, filename: str | None, work: Path) -> TinkerPath:
        """Unpack an uploaded archive (in ``work``, an ``upload_dir``), check it is a
        checkpoint of the served model, and file it under a new run; return its path."""
        staging = work / "checkpoint"
        staging.mkdir()
        await anyio.to_thread.run_sync(
            unpack_archive, archive, staging, self.core.config.limits.max_upload_bytes
        )
        try:
            meta = await self.core.compute.run(lambda: self.core.backend.verify_checkpoint(staging))
        except BackendError as exc:
            raise HttpError(400, f"the uploaded archive is not usable here: {exc}") from None
        kind: Kind = "weights" if meta["kind"] == "state" else "sampler_weights"
        run_id = f"upload-{secrets.token_hex(8)}"
        path = TinkerPath(run_id, kind, _upload_name(filename))
        self.write_run(run_id, meta["base_model"], meta["lora_rank"], {"uploaded": "true"})
        target = path.directory(self.data_dir)
        target.parent.mkdir(parents=True, exist_ok=True)
        (staging / COMPLETE_MARKER).unlink(missing_ok=True)
        _write_json(staging / ACCESS_FILE, {"created": self.core.now()})
        os.replace(staging, target)
        return path


def _valid_name(name: str, check: Callable[[str], str] = check_name) -> bool:
    try:
        check(name)
    except BadPath:
        return False
    return True


def _upload_name(filename: str | None) -> str:
    stem = Path(filename or "").name
    for suffix in (".tar.gz", ".tgz", ".tar"):
        if stem.endswith(suffix):
            stem = stem[: -len(suffix)]
    return stem if _valid_name(stem) else "uploaded"


def _read_json(file: Path) -> dict[str, Any]:
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_json(file: Path, data: dict[str, Any]) -> None:
    tmp = file.with_name(f".{file.name}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, file)


def _pack(directory: Path, file: Path) -> None:
    tmp = file.with_name(f".{file.name}.tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        for member in sorted(directory.iterdir()):
            if member.is_file() and member.name in CHECKPOINT_FILES:
                tar.add(member, arcname=member.name)
        marker = tarfile.TarInfo(COMPLETE_MARKER)
        tar.addfile(marker)
    os.replace(tmp, file)


class _TooLarge(Exception):
    pass


class _BoundedReader:
    """The decompressed bytes of an upload, counted as tarfile reads them: file contents
    (read inside ``contents()``) up to ``max_bytes``, everything else up to
    MAX_ARCHIVE_HEADER_BYTES, so no header can make tarfile buffer or skip much."""

    def __init__(self, source: gzip.GzipFile, max_bytes: int) -> None:
        self._source = source
        self._left = {True: max_bytes, False: MAX_ARCHIVE_HEADER_BYTES}
        self._in_contents = False

    def read(self, size: int = -1) -> bytes:
        left = self._left[self._in_contents]
        data = self._source.read(left + 1 if size < 0 else min(size, left + 1))
        if len(data) > left:
            raise _TooLarge
        self._left[self._in_contents] = left - len(data)
        return data

    @contextlib.contextmanager
    def contents(self) -> Iterator[None]:
        self._in_contents = True
        try:
            yield
        finally:
            self._in_contents = False


def unpack_archive(archive: Path, dest: Path, max_bytes: int) -> None:
    """Extract a gzip-compressed tar of checkpoint files into ``dest``: only regular
    checkpoint files, at the root or under one top directory; anything else (links,
    devices, absolute or '..' paths, unknown or repeated files) is refused. Members are
    read one at a time, at most MAX_ARCHIVE_ENTRIES of them, and at most ``max_bytes``
    of file contents."""
    names: set[str] = set()
    try:
        with gzip.open(archive, "rb") as unzipped:
            assert isinstance(unzipped, gzip.GzipFile)
            reader = _BoundedReader(unzipped, max_bytes)
            with tarfile.open(fileobj=reader, mode="r|") as tar:  # type: ignore[call-overload]
                for count, member in enumerate(tar, start=1):
                    if count > MAX_ARCHIVE_ENTRIES:
                        raise HttpError(
                            400,
                            f"the uploaded archive holds more than {MAX_ARCHIVE_ENTRIES} "
                            "entries; a checkpoint archive holds only the checkpoint's files",
                        )
                    if member.isdir():
                        continue
                    name = _checkpoint_file(member, names)
                    source = tar.extractfile(member)
                    assert source is not None
                    with reader.contents(), source, open(dest / name, "wb") as out:
                        shutil.copyfileobj(source, out)
    except _TooLarge:
        raise HttpError(
            413, f"the uploaded archive unpacks to more than {max_bytes} bytes"
        ) from None
    except (tarfile.TarError, gzip.BadGzipFile, zlib.error, EOFError, RecursionError) as exc:
        raise HttpError(
            400, f"the upload is not a readable gzip-compressed tar archive (.tar.gz): {exc}"
        ) from None
    if "meta.json" not in names:
        raise HttpError(400, "the uploaded archive holds no meta.json: not a checkpoint")


def _checkpoint_file(member: tarfile.TarInfo, seen: set[str]) -> str:
    """The file name ``member`` is extracted as (noted in ``seen``); HTTP 400 unless it
    is a regular checkpoint file not seen before."""
    parts = Path(member.name).parts
    name = parts[-1] if parts else ""
    if (
        not member.isfile()
        or member.name.startswith("/")
        or ".." in parts
        or len(parts) > 2
        or name not in CHECKPOINT_FILES
        or name in seen
    ):
        raise HttpError(
            400,
            f"the uploaded archive holds {member.name!r}; an archive may only hold the "
            f"checkpoint files {sorted(CHECKPOINT_FILES)}",
        )
    seen.add(name)
    return name


_BOUNDARY = re.compile(r'boundary="?([^";]+)"?', re.IGNORECASE)
_FILENAME = re.compile(rb'filename="([^"]*)"', re.IGNORECASE)


def file_part(body: Path, content_type: str, dest: Path) -> str | None:
    """Copy the ``file`` part of a multipart/form-data body into ``dest`` (or the whole
    body, if it is not multipart); return the part's filename."""
    if not content_type.lower().startswith("multipart/form-data"):
        shutil.copyfile(body, dest)
        return None
    found = _BOUNDARY.search(content_type)
    if found is None:
        raise HttpError(400, "multipart upload without a boundary")
    delimiter = b"--" + found.group(1).encode("latin-1")
    with open(body, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
        start = data.find(delimiter)
        while start != -1:
            header_end = data.find(b"\r\n\r\n", start)
            if header_end == -1:
                break
            headers = data[start + len(delimiter) : header_end]
            end = data.find(b"\r\n" + delimiter, header_end + 4)
            if end == -1:
                break
            if b'name="file"' in headers:
                with open(dest, "wb") as out:
                    for offset in range(header_end + 4, end, 1 << 20):
                        out.write(data[offset : min(offset + (1 << 20), end)])
                name = _FILENAME.search(headers)
                return name.group(1).decode("utf-8", "replace") if name else None
            start = end + 2
    raise HttpError(400, "the multipart upload has no part named 'file'")


def http_date(timestamp: float) -> str:
    return formatdate(timestamp, usegmt=True)
