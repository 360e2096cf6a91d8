"""The local server bounds what clients make it spend and answers bad input with a 4xx:
absurd TTLs, archive bombs, slow and oversized uploads, malformed checkpoints, and the
model / snapshot budgets, over real HTTP against an in-process server."""

from __future__ import annotations

import bz2
import contextlib
import errno
import io
import json
import math
import tarfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from safetensors.torch import load, save

from engine.local import Limits, RunningServer, serve_local
from engine.local.config import ServerConfig
from engine.local.operations.checkpoints import ACCESS_FILE, MAX_ARCHIVE_ENTRIES, unpack_archive
from tests.clock import SetTime
from tests.raw_client import RawClient

pytestmark = pytest.mark.anyio
KEY = "tml-bounds"
HEADERS = {"X-API-Key": KEY}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Client(RawClient):
    """The raw calls these tests need: checkpoint archives and uploads."""

    async def archive(self, tinker_path: str) -> bytes:
        run_id, kind, name = tinker_path.removeprefix("tinker://").split("/")
        link = await self.http.get(
            f"/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}/archive"
        )
        assert link.status_code == 302, link.text
        download = await self.http.get(link.headers["location"])
        return download.content

    async def upload(self, archive: bytes) -> httpx.Response:
        return await self.http.post(
            "/api/v1/checkpoints/upload", files={"file": ("up.tar.gz", archive, "application/gzip")}
        )


@pytest.fixture
async def clock() -> SetTime:
    return SetTime()


@pytest.fixture
async def server(clock: SetTime) -> AsyncIterator[RunningServer]:
    config = ServerConfig(
        api_key=KEY, long_poll_s=1, limits=Limits(max_models=2, max_named_samplers=2)
    )
    async with serve_local(config, now=clock) as running:
        yield running


@pytest.fixture
async def client(server: RunningServer) -> AsyncIterator[Client]:
    async with httpx.AsyncClient(base_url=server.base_url, headers=HEADERS, timeout=60) as http:
        yield Client(server, http)


async def _saved_state(client: Client) -> str:
    model_id = await client.model()
    saved = await client.op("save_weights", model_id, path="state")
    path: str = saved["path"]
    return path


def _ttl_url(tinker_path: str) -> str:
    run_id, kind, name = tinker_path.removeprefix("tinker://").split("/")
    return f"/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}/ttl"


# ---- TTLs ----------------------------------------------------------------------------


async def test_an_absurd_ttl_is_refused_at_the_boundary(client: Client) -> None:
    path = await _saved_state(client)
    for ttl in (10**12, 10**20):
        answer = await client.http.put(_ttl_url(path), json={"ttl_seconds": ttl})
        assert answer.status_code == 400, answer.text
        assert "at most" in answer.json()["error"]
    model_id = path.removeprefix("tinker://").split("/")[0]
    failed = await client.op("save_weights", model_id, path="later", ttl_seconds=10**12)
    assert "at most" in failed["error"]
    assert (await client.http.put(_ttl_url(path), json={"ttl_seconds": 3600})).status_code == 204


async def test_an_absurd_persisted_expiry_does_not_break_listings(
    client: Client, server: RunningServer
) -> None:
    path = await _saved_state(client)
    run_id, kind, name = path.removeprefix("tinker://").split("/")
    access = server.data_dir / run_id / kind / name / ACCESS_FILE
    access.write_text(json.dumps({"created": 1e20, "expires_at": 1e20}))
    for url in ("/api/v1/checkpoints", "/api/v1/training_runs", f"/api/v1/training_runs/{run_id}"):
        answer = await client.http.get(url)
        assert answer.status_code == 200, (url, answer.text)
    listed = (await client.http.get(f"/api/v1/training_runs/{run_id}/checkpoints")).json()
    assert [c["expires_at"] for c in listed["checkpoints"]] == [None]


async def test_a_ttl_expiry_spares_a_checkpoint_a_live_sampler_uses(
    client: Client, server: RunningServer, clock: SetTime
) -> None:
    session_id = await client.session()
    model_id = await client.model(session_id)
    saved = await client.op("save_weights_for_sampler", model_id, path="w", ttl_seconds=60)
    sampler = await client.http.post(
        "/api/v1/create_sampling_session",
        json={"session_id": session_id, "sampling_session_seq_id": 0, "model_path": saved["path"]},
    )
    assert sampler.status_code == 200, sampler.text
    clock.now += 120
    server.service.housekeeping()
    listed = (await client.http.get(f"/api/v1/training_runs/{model_id}/checkpoints")).json()
    assert [c["tinker_path"] for c in listed["checkpoints"]] == [saved["path"]]
    assert (server.data_dir / model_id / "sampler_weights" / "w" / "meta.json").is_file()


# ---- archives ------------------------------------------------------------------------


def _tar(
    files: dict[str, bytes],
    *,
    mode: str = "w:gz",
    extra: Callable[[tarfile.TarFile], None] | None = None,
) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode=mode) as tar:  # type: ignore[call-overload]
        if extra is not None:
            extra(tar)
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def _unpack(archive: bytes, tmp_path: Path, max_bytes: int = 1 << 20) -> None:
    source = tmp_path / "archive"
    source.write_bytes(archive)
    dest = tmp_path / "out"
    dest.mkdir(exist_ok=True)
    unpack_archive(source, dest, max_bytes)


def _error(call: Callable[[], None]) -> tuple[int, str]:
    from engine.local.operations import HttpError

    with pytest.raises(HttpError) as caught:
        call()
    return caught.value.status, caught.value.message


def test_an_archive_of_many_directory_entries_is_refused_after_a_bounded_count(
    tmp_path: Path,
) -> None:
    def directories(tar: tarfile.TarFile) -> None:
        for i in range(MAX_ARCHIVE_ENTRIES + 1):
            info = tarfile.TarInfo(f"d{i}")
            info.type = tarfile.DIRTYPE
            tar.addfile(info)

    archive = _tar({"meta.json": b"{}"}, extra=directories)
    status, message = _error(lambda: _unpack(archive, tmp_path))
    assert status == 400 and f"more than {MAX_ARCHIVE_ENTRIES} entries" in message


def test_only_gzip_archives_are_unpacked(tmp_path: Path) -> None:
    plain = _tar({"meta.json": b"{}"}, mode="w")
    _unpack(_tar({"meta.json": b"{}"}), tmp_path)
    for other in (bz2.compress(plain), _tar({"meta.json": b"{}"}, mode="w:xz"), plain):
        status, message = _error(lambda: _unpack(other, tmp_path))  # noqa: B023
        assert status == 400 and "gzip" in message


def test_unpacking_stops_at_the_byte_bound_headers_included(tmp_path: Path) -> None:
    def huge_pax_header(tar: tarfile.TarFile) -> None:
        info = tarfile.TarInfo("adapter.safetensors")
        info.pax_headers = {"comment": "x" * (4 << 20)}
        tar.addfile(info, io.BytesIO(b""))

    archive = _tar({"meta.json": b"{}"}, mode="w:gz", extra=huge_pax_header)
    assert len(archive) < 64 * 1024
    status, message = _error(lambda: _unpack(archive, tmp_path, max_bytes=1 << 20))
    assert status == 413 and "more than 1048576 bytes" in message


# ---- uploads ---------------------------------------------------------------------------


def _rewrite(archive: bytes, changes: dict[str, bytes]) -> bytes:
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
        files = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}  # type: ignore[union-attr]
    return _tar({**files, **changes})


async def test_malformed_checkpoint_uploads_get_400_with_a_reason(client: Client) -> None:
    archive = await client.archive(await _saved_state(client))
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
        meta = json.loads(tar.extractfile("meta.json").read())  # type: ignore[union-attr]
        adapter = load(tar.extractfile("adapter.safetensors").read())  # type: ignore[union-attr]
    assert (await client.upload(archive)).status_code == 200

    def with_meta(**changes: Any) -> bytes:
        return json.dumps({**meta, **changes}).encode()

    nan = {k: v.clone() for k, v in adapter.items()}
    next(iter(nan.values())).view(-1)[0] = math.nan
    cases = {
        "target_modules": with_meta(target_modules=5),
        "unknown module": with_meta(target_modules=["no.such.module"]),
        "lora_rank": with_meta(lora_rank="abc"),
        "float rank": with_meta(lora_rank=4.7),
        "deep": b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        "utf-8": b'{"format": "\xff\xfe"}',
        "NaN": save(nan),
    }
    for what, content in cases.items():
        name = "adapter.safetensors" if what == "NaN" else "meta.json"
        answer = await client.upload(_rewrite(archive, {name: content}))
        assert answer.status_code == 400, (what, answer.status_code, answer.text)
        assert answer.json()["error"], what


async def test_uploads_are_capped_by_their_own_limit() -> None:
    config = ServerConfig(limits=Limits(max_body_bytes=1000, max_upload_bytes=200_000))
    async with (
        serve_local(config) as running,
        httpx.AsyncClient(base_url=running.base_url, timeout=60) as http,
    ):
        client = Client(running, http)
        archive = await client.archive(await _saved_state(client))
        assert len(archive) > 1000
        assert (await client.upload(archive)).status_code == 200  # not --max-body-bytes
        host, port = _address(running)
        head = b"POST /api/v1/checkpoints/upload HTTP/1.1\r\nHost: x\r\n"
        async with await anyio.connect_tcp(host, port) as declared:
            await declared.send(head + b"Content-Length: 300000\r\n\r\n")
            status, error = _answer(await _read_until_closed(declared))
        assert status == 413 and "limit of 200000 bytes" in error
        async with await anyio.connect_tcp(host, port) as streamed:
            await streamed.send(head + b"Transfer-Encoding: chunked\r\n\r\n")
            with contextlib.suppress(anyio.BrokenResourceError):
                for _ in range(30):
                    await streamed.send(b"2710\r\n" + b"x" * 10_000 + b"\r\n")
            status, error = _answer(await _read_until_closed(streamed))
        assert status == 413 and "limit of 200000 bytes" in error
    assert not list(running.data_dir.glob(".upload-*"))


def _address(server: RunningServer) -> tuple[str, int]:
    host, port = server.base_url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


async def _half_sent_upload(server: RunningServer) -> anyio.abc.SocketStream:
    host, port = _address(server)
    stream = await anyio.connect_tcp(host, port)
    await stream.send(
        b"POST /api/v1/checkpoints/upload HTTP/1.1\r\nHost: x\r\n"
        b"Content-Type: application/gzip\r\nContent-Length: 100000\r\n\r\n" + b"x" * 1000
    )
    return stream


def _answer(raw: bytes) -> tuple[int, str]:
    head, _, body = raw.partition(b"\r\n\r\n")
    assert b"connection: close" in head.lower()
    return int(head.split()[1]), json.loads(body)["error"]


async def _read_until_closed(stream: anyio.abc.ByteStream, limit_s: float = 30) -> bytes:
    received = b""
    with anyio.fail_after(limit_s):
        while True:
            try:
                received += await stream.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                return received


async def test_a_half_sent_upload_gets_408_and_leaves_no_temp_dir() -> None:
    async with serve_local(ServerConfig(body_timeout_s=1)) as running:
        async with await _half_sent_upload(running) as half:
            status, error = _answer(await _read_until_closed(half))
        assert status == 408 and "did not arrive within 1 s" in error
        assert not list(running.data_dir.glob(".upload-*"))


async def test_concurrent_uploads_are_bounded_with_a_retry_after() -> None:
    config = ServerConfig(body_timeout_s=60, limits=Limits(max_concurrent_uploads=1))
    async with (
        serve_local(config) as running,
        httpx.AsyncClient(base_url=running.base_url, timeout=60) as http,
    ):
        async with await _half_sent_upload(running):
            with anyio.fail_after(30):
                while running.service.checkpoints.uploads_in_flight == 0:  # noqa: ASYNC110
                    await anyio.sleep(0.01)
            second = await http.post(
                "/api/v1/checkpoints/upload",
                content=b"x" * 10,
                headers={"Content-Type": "application/gzip"},
            )
        assert second.status_code == 503, second.text
        assert int(second.headers["retry-after"]) >= 1
        assert "uploads at a time" in second.json()["error"]


# ---- budgets and credentials ---------------------------------------------------------------


async def test_max_models_refuses_a_new_client_instead_of_evicting_a_live_one(
    client: Client, server: RunningServer
) -> None:
    first, second = await client.model(), await client.model()
    refused = await client.http.post(
        "/api/v1/create_model",
        json={
            "session_id": await client.session(),
            "model_seq_id": 0,
            "base_model": server.model_name,
            "lora_config": {"rank": 2},
        },
    )
    assert refused.status_code == 429, refused.text
    assert "--max-models" in refused.json()["error"]
    assert sorted(server.stats.held["models"]) == sorted([first, second])


async def test_max_samplers_bounds_the_snapshots_training_clients_save(
    client: Client, server: RunningServer
) -> None:
    model_id = await client.model()
    for i in range(4):
        saved = await client.op("save_weights_for_sampler", model_id, path=f"w{i}")
        assert "path" in saved, saved
    await anyio.wait_all_tasks_blocked()
    assert server.stats.held["checkpoint_snapshots"] <= 2


async def test_a_jwt_cannot_mint_another_jwt(client: Client) -> None:
    token = (await client.http.post("/api/v1/auth/token", json={})).json()["jwt"]
    with_jwt = {"X-API-Key": token}
    assert (await client.http.get("/api/v1/checkpoints", headers=with_jwt)).status_code == 200
    refused = await client.http.post("/api/v1/auth/token", json={}, headers=with_jwt)
    assert refused.status_code == 403, refused.text
    assert "API key" in refused.json()["error"]


async def test_an_upload_without_file_descriptors_gets_503_and_leaves_no_temp_dir(
    client: Client, server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def no_descriptors(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(anyio, "open_file", no_descriptors)
    answer = await client.upload(b"x" * 10)
    assert answer.status_code == 503, answer.text
    assert answer.headers["retry-after"] == "5"
    assert not list(server.data_dir.glob(".upload-*"))


async def test_housekeeping_removes_upload_leftovers(server: RunningServer) -> None:
    leftover = server.data_dir / ".upload-left-by-a-crash"
    (leftover / "checkpoint").mkdir(parents=True)
    server.service.housekeeping()
    assert not leftover.exists()
