"""A dead server is noticed while calls wait on it: probes on a manual clock, the retry
layer's verdict after a failed attempt, the real HTTP probe, and ``kill -9`` of a
standalone server under a running ``python -m engine.run``."""

from __future__ import annotations

import http.server
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import tinker

from engine.errors import ServerUnreachable
from engine.session.breaker import CircuitBreaker
from engine.session.liveness import ServerLiveness, http_probe
from engine.session.retry import OpKind, RetryCounter, RetryPolicy, call_with_retry
from tests.clock import ManualClock
from tests.reliability_support import (
    SMALL_RUN,
    checkpoints,
    cli_env,
    events,
    metrics,
    read_json,
    start_cli,
    wait_for_metrics,
)

pytestmark = pytest.mark.anyio

URL = "http://mint.test:8000"


class FakeServer:
    """A probe whose answer the test sets: None (answers) or why it cannot connect."""

    def __init__(self) -> None:
        self.refusal: str | None = None
        self.probes = 0

    async def probe(self) -> str | None:
        self.probes += 1
        return self.refusal


def liveness(server: FakeServer, clock: ManualClock, after: float = 30) -> ServerLiveness:
    return ServerLiveness(URL, unreachable_after=after, probe=server.probe, clock=clock)


async def tick(clock: ManualClock, seconds: float) -> None:
    """Let every task run until it waits, then move time on."""
    await anyio.wait_all_tasks_blocked()
    clock.advance(seconds)
    await anyio.wait_all_tasks_blocked()


async def test_a_quick_call_never_probes() -> None:
    server, clock = FakeServer(), ManualClock()
    alive = liveness(server, clock)
    assert alive.interval == 5

    async def quick() -> str:
        return "ok"

    assert await alive.watch(quick) == "ok"
    assert server.probes == 0 and clock.sleepers() == 0


async def test_a_call_waiting_on_a_dead_server_ends_with_one_line_naming_it() -> None:
    server, clock = FakeServer(), ManualClock()
    alive = liveness(server, clock)
    failures: list[BaseException] = []

    async def call() -> None:
        try:
            await alive.watch(anyio.sleep_forever)  # the SDK retrying a refused connection
        except ServerUnreachable as exc:
            failures.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(call)
        tg.start_soon(call)  # concurrent calls share one probe per interval
        await tick(clock, 5)
        assert server.probes == 1  # alive
        server.refusal = "connection refused"  # kill -9
        for _ in range(6):  # failed probes at 10, 15, ..., 35 s: a 25 s streak
            await tick(clock, 5)
        assert failures == [] and server.probes == 7
        await tick(clock, 5)  # 40 s: refused for 30 s
    assert [str(e) for e in failures] == [
        f"the MinT server at {URL} is unreachable: no connection for 30s (connection "
        "refused); check that it is running, then resume the run"
    ] * 2
    assert server.probes == 8
    with pytest.raises(ServerUnreachable):  # known gone: later calls fail at once
        await alive.watch(anyio.sleep_forever)


async def test_a_server_that_answers_again_resets_the_streak() -> None:
    server, clock = FakeServer(), ManualClock()
    alive = liveness(server, clock)
    done: list[str] = []
    release = anyio.Event()

    async def slow_call() -> str:
        await release.wait()
        return "ok"

    async def call() -> None:
        done.append(await alive.watch(slow_call))

    async with anyio.create_task_group() as tg:
        tg.start_soon(call)
        server.refusal = "connection refused"  # a restart: refused for 25 s
        for _ in range(6):
            await tick(clock, 5)
        server.refusal = None
        for _ in range(10):
            await tick(clock, 5)
        release.set()
    assert done == ["ok"] and not alive.failing


def connection_refused() -> tinker.APIConnectionError:
    request = httpx.Request("POST", f"{URL}/api/v1/create_model")
    error = tinker.APIConnectionError(request=request)
    error.__cause__ = ConnectionRefusedError(111, "Connection refused")
    return error


async def test_a_refused_retry_is_the_server_gone_not_a_breaker_trip() -> None:
    """The SDK gives up on a refused connection: instead of retrying (and tripping the
    breaker with 'N consecutive failures'), the call waits for the probes' verdict."""
    server, clock = FakeServer(), ManualClock()
    server.refusal = "connection refused"
    alive = liveness(server, clock, after=9)
    breaker = CircuitBreaker(2)
    calls = [0]

    async def refused() -> None:
        calls[0] += 1
        raise connection_refused()

    outcome: list[BaseException] = []

    async def call() -> None:
        policy = RetryPolicy(max_attempts=5, initial_wait=0, jitter=0, attempt_timeout=600)
        try:
            await call_with_retry(
                refused,
                kind=OpKind.SESSION,
                policy=policy,
                counter=RetryCounter(),
                breaker=breaker,
                liveness=alive,
                clock=clock,
            )
        except BaseException as exc:
            outcome.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(call)
        while not outcome:
            await tick(clock, alive.interval)
    [error] = outcome
    assert isinstance(error, ServerUnreachable), error
    assert "no connection for 9s (connection refused)" in str(error)
    assert calls[0] == 1 and breaker.failures(OpKind.SESSION) == 0


async def test_a_failure_of_a_live_server_is_retried_as_usual() -> None:
    server, clock = FakeServer(), ManualClock()
    alive = liveness(server, clock)
    attempts: list[int] = []

    async def flaky() -> str:
        attempts.append(1)
        if len(attempts) == 1:
            raise connection_refused()  # a dropped connection; the server is up
        return "ok"

    policy = RetryPolicy(max_attempts=3, initial_wait=0, jitter=0, attempt_timeout=600)
    result = await call_with_retry(
        flaky,
        kind=OpKind.SAMPLE,
        policy=policy,
        counter=RetryCounter(),
        liveness=alive,
        clock=clock,
    )
    assert result == "ok" and len(attempts) == 2 and server.probes == 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_the_http_probe_tells_a_dead_port_from_a_server() -> None:
    assert await http_probe(f"http://127.0.0.1:{free_port()}", 5) == "connection refused"
    # any HTTP answer, even a 404 of something that is not a MinT server, is a server
    with http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), http.server.BaseHTTPRequestHandler
    ) as httpd:
        thread = threading.Thread(target=httpd.serve_forever)
        thread.start()
        try:
            assert await http_probe(f"http://127.0.0.1:{httpd.server_port}", 5) is None
        finally:
            httpd.shutdown()
            thread.join()


# ------------------------------------------------------------------ the real scenario


def start_server(tmp_path: Path) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine.local", "--port", "0", "--data-dir", str(tmp_path / "s")],
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # printed once it accepts requests
    match = re.search(r"serving (\S+) at (http://\S+)", line)
    assert match, (line, proc.poll())
    return proc, match.group(2)


def kill(proc: subprocess.Popen[Any]) -> None:
    proc.kill()
    proc.communicate()


@pytest.mark.slow
def test_kill_9_of_a_standalone_server_mid_run_exits_1_naming_it(tmp_path: Path) -> None:
    """Defaults everywhere (600 s per request attempt, 1800 s watchdog) but
    --unreachable-timeout 3: the run ends with one line naming the server instead of
    waiting out the deadlines; the communicate() limit only keeps a regression from
    hanging the suite."""
    server, url = start_server(tmp_path)
    run_dir = tmp_path / "run"
    try:
        args = [
            *SMALL_RUN,
            *("--steps", "50", "--unreachable-timeout", "3"),
            *("--run-dir", str(run_dir)),
        ]
        engine = start_cli(args, cwd=tmp_path, MINT_BASE_URL=url, MINT_API_KEY="sk-test")
        try:
            assert wait_for_metrics(run_dir, 2, engine) >= 2, engine.communicate()
            kill(server)
            _, err = engine.communicate(timeout=240)
        finally:
            if engine.poll() is None:
                kill(engine)
    finally:
        if server.poll() is None:
            kill(server)
    assert server.returncode == -signal.SIGKILL
    assert engine.returncode == 1, err
    last = err.strip().splitlines()[-1]
    assert re.fullmatch(
        rf"Error: the MinT server at {re.escape(url)} is unreachable: no connection for "
        r"\d+s \(connection refused\); check that it is running, then resume the run",
        last,
    ), err
    assert "Traceback" not in err
    assert read_json(run_dir / "summary.json")["status"] == "stopped"
    [stopped] = events(run_dir, "run.stopped")
    assert stopped["reason"] == "breaker"
    done = len(metrics(run_dir))
    assert 2 <= done < 50
    assert checkpoints(run_dir)[0]["step"] == 0  # resumable from its latest checkpoint


def test_the_cli_exits_while_an_abandoned_sdk_call_still_blocks() -> None:
    """A snapshot abandoned in a worker thread against a dead server kept the process
    alive for minutes after its error line; the CLI exits without joining it."""
    script = (
        "import threading\n"
        "from engine.run import exit_process\n"
        "threading.Thread(target=threading.Event().wait).start()  # never returns\n"
        "print('Error: ...', flush=True)\n"
        "exit_process(1)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert (proc.returncode, proc.stdout) == (1, "Error: ...\n"), proc.stderr
