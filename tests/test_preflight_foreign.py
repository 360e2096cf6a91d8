"""A base URL that is not a MinT server (a plain web server, another service's API) is one
line that says so, at the first answer: not retried, never the server's HTML page."""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
from structlog.testing import capture_logs

from engine.config import EngineConfig
from engine.session.preflight import PreflightError, read_server_profile
from engine.session.retry import service_guard

REPO = Path(__file__).resolve().parents[1]
NOT_MINT = "does not speak the MinT/Tinker API"
# What a long page would bring along: tags, newlines and far more than one line.
FILLER = "<p>" + "lorem ipsum dolor sit amet " * 200 + "</p>\n"


@contextmanager
def http_server(
    handler: type[http.server.BaseHTTPRequestHandler],
) -> Iterator[tuple[str, list[str]]]:
    """A real loopback HTTP server in a thread; yields its URL and the requests it got."""
    seen: list[str] = []

    class Counting(handler):  # type: ignore[valid-type,misc]
        def log_request(self, code: int | str = "-", size: int | str | None = "-") -> None:
            seen.append(f"{self.command} {self.path}")

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Counting)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def static_files(directory: Path) -> type[http.server.BaseHTTPRequestHandler]:
    """``python -m http.server``: POST is 501 with an HTML page, GET of a missing file 404."""

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, directory=str(directory), **kwargs)

    return Handler


def answering(
    status: int, content_type: str, body: str
) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = _answer

    return Handler


HTML_PAGE = (
    "<!DOCTYPE html><html><head><title>Welcome</title><style>p {}</style></head>"
    f"<body><h1>Service Unavailable</h1>{FILLER}</body></html>"
)


def preflight(url: str, **settings: float) -> PreflightError:
    guard = service_guard(EngineConfig(**settings))  # type: ignore[arg-type]
    with pytest.raises(PreflightError) as info:
        anyio.run(read_server_profile, url, "sk-not-sent-anywhere-real", guard)
    return info.value


def assert_one_bounded_line(message: str) -> None:
    assert "\n" not in message
    assert "<" not in message and ">" not in message
    assert "lorem ipsum dolor sit amet " * 10 not in message
    assert len(message) < 400


@pytest.mark.parametrize(
    "handler",
    [
        pytest.param("static", id="plain-http-server-501"),
        pytest.param(answering(404, "text/html", HTML_PAGE), id="404-html"),
        pytest.param(answering(404, "application/json", '{"detail":"Not Found"}'), id="404-json"),
        pytest.param(answering(405, "text/html", HTML_PAGE), id="405"),
        pytest.param(answering(200, "text/html", HTML_PAGE), id="200-html"),
    ],
)
def test_a_server_that_is_not_mint_is_one_line_at_its_first_answer(
    handler: object, tmp_path: Path
) -> None:
    cls = static_files(tmp_path) if handler == "static" else handler
    with capture_logs() as logs, http_server(cls) as (url, seen):  # type: ignore[arg-type]
        error = preflight(url)
    message = str(error)
    assert message.startswith(f"{url} {NOT_MINT}"), message
    assert_one_bounded_line(message)
    assert seen == ["POST /api/v1/client/config"]  # asked once, never retried
    assert not [e for e in logs if e.get("event") == "retry"]


def test_a_busy_proxy_page_is_still_retried_but_shown_as_a_short_excerpt() -> None:
    """A 503 page of a proxy in front of a MinT server is transient: retried, each
    warning and the final error with a tag-free excerpt of at most ~200 characters."""
    with capture_logs() as logs, http_server(answering(503, "text/html", HTML_PAGE)) as (url, seen):
        error = preflight(url, retry_attempts=3, retry_backoff=0)
    assert len(seen) == 3
    assert "is not ready" in str(error)
    assert_one_bounded_line(str(error))
    warnings = [str(e["error"]) for e in logs if e.get("event") == "retry"]
    assert len(warnings) == 2
    for text in warnings:
        assert_one_bounded_line(text)
        assert "Service Unavailable lorem ipsum" in text


def test_the_cli_says_the_url_is_not_mint_in_one_line_and_exits_1(tmp_path: Path) -> None:
    env = {**os.environ, "MINT_API_KEY": "sk-not-a-real-key", "HF_HUB_OFFLINE": "1"}
    with http_server(static_files(tmp_path)) as (url, seen):
        env["MINT_BASE_URL"] = url
        proc = subprocess.run(
            [sys.executable, "-m", "engine.run", "--steps", "1", "--run-dir", str(tmp_path / "r")],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert proc.returncode == 1, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert errors[-1].startswith(f"Error: {url} {NOT_MINT}"), proc.stderr
    assert "<" not in proc.stderr and "Retrying" not in proc.stderr
    assert "retrying" not in proc.stderr, proc.stderr
    assert seen == ["POST /api/v1/client/config"]
