"""The local server against hostile or broken clients, over real HTTP: slowloris
connections, half-sent bodies, deeply nested JSON, and error messages that must not
reveal where the server keeps its files. The deadlines are the server's own (uvicorn's
event loop timers), so these tests wait for the server to act, with small settings."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import pytest

from engine.local import RunningServer, serve_local
from engine.local.config import ServerConfig

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def server() -> AsyncIterator[RunningServer]:
    config = ServerConfig(long_poll_s=1, header_timeout_s=0.3, body_timeout_s=0.3)
    async with serve_local(config) as running:
        yield running


def _address(server: RunningServer) -> tuple[str, int]:
    host, port = server.base_url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


async def _read_until_closed(stream: anyio.abc.ByteStream, limit_s: float = 30) -> bytes:
    """Everything the server sends until it closes the connection."""
    received = b""
    with anyio.fail_after(limit_s):
        while True:
            try:
                received += await stream.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                return received


async def test_connections_without_complete_headers_are_closed(server: RunningServer) -> None:
    host, port = _address(server)
    async with await anyio.connect_tcp(host, port) as silent:
        assert await _read_until_closed(silent) == b""
    async with await anyio.connect_tcp(host, port) as trickle:
        await trickle.send(b"POST /api/v1/create_session HTTP/1.1\r\nHost: x\r\n")
        assert await _read_until_closed(trickle) == b""
    async with httpx.AsyncClient(base_url=server.base_url) as http:  # still serving
        assert (await http.get("/api/v1/healthz")).status_code == 200


async def test_a_half_sent_body_gets_408_and_the_connection_closes(
    server: RunningServer,
) -> None:
    host, port = _address(server)
    async with await anyio.connect_tcp(host, port) as half:
        await half.send(
            b"POST /api/v1/create_session HTTP/1.1\r\nHost: x\r\n"
            b'Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"tags": ['
        )
        answer = await _read_until_closed(half)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and b"connection: close" in head.lower()
    assert "did not arrive within 0.3 s" in json.loads(body)["error"]


async def test_deeply_nested_json_is_a_clear_400_without_a_traceback(
    server: RunningServer, caplog: pytest.LogCaptureFixture
) -> None:
    depth = 100_000
    nested = "[" * depth + "]" * depth
    body = '{"session_id": "s", "model_seq_id": 0, "base_model": "x", "user_metadata": {"a": '
    async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
        with caplog.at_level(logging.WARNING):
            answer = await http.post(
                "/api/v1/create_model",
                content=body + nested + "}}",
                headers={"Content-Type": "application/json"},
            )
    assert answer.status_code == 400
    assert answer.json() == {
        "error": "request body is nested too deeply (JSON objects and arrays)",
        "category": "user",
    }
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_errors_do_not_reveal_the_data_dir(server: RunningServer) -> None:
    async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
        info = await http.post(
            "/api/v1/weights_info", json={"tinker_path": "tinker://model-x/weights/nope"}
        )
        session = (await http.post("/api/v1/create_session", json={})).json()["session_id"]
        created = await _result(
            http,
            await _post(
                http,
                "create_model",
                {
                    "session_id": session,
                    "model_seq_id": 0,
                    "base_model": server.model_name,
                    "lora_config": {"rank": 2},
                },
            ),
        )
        load = await _post(
            http,
            "load_weights",
            {
                "model_id": created["model_id"],
                "path": f"tinker://{created['model_id']}/weights/missing",
                "seq_id": 1,
            },
        )
        failed = await _result(http, load)
    assert info.status_code == 404
    for message in (info.json()["error"], failed["error"]):
        assert "<data dir>/" in message, message
        assert str(server.data_dir) not in message and str(server.data_dir.resolve()) not in message


async def _post(http: httpx.AsyncClient, path: str, body: dict[str, Any]) -> str:
    answer = await http.post(f"/api/v1/{path}", json=body)
    assert answer.status_code == 200, answer.text
    request_id: str = answer.json()["request_id"]
    return request_id


async def _result(http: httpx.AsyncClient, request_id: str) -> dict[str, Any]:
    while True:
        answer = (
            await http.post("/api/v1/retrieve_future", json={"request_id": request_id})
        ).json()
        if answer.get("type") != "try_again":
            return answer  # type: ignore[no-any-return]


async def test_the_key_is_checked_before_a_body_is_read() -> None:
    async with serve_local(ServerConfig(api_key="tml-hardening")) as server:
        host, port = _address(server)
        async with await anyio.connect_tcp(host, port) as stranger:
            await stranger.send(
                b"POST /api/v1/forward_backward HTTP/1.1\r\nHost: x\r\nX-API-Key: tml-wrong\r\n"
                b"Content-Type: application/json\r\nContent-Length: 30000000\r\n\r\n{"
            )
            answer = await _read_until_closed(stranger, limit_s=10)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 401") and b"connection: close" in head.lower()
    assert json.loads(body)["error"] == "unauthorized: invalid API key"
