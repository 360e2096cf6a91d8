"""Starting and stopping a local server: in this event loop, in a background thread, or
as a subprocess.

- ``serve_local(...)``: ``async with`` form; the server runs in the caller's event loop.
  The SDK's ``ServiceClient()`` constructor BLOCKS its calling thread, so do not build
  SDK clients on that same loop's thread (use ``LocalServer`` or a worker thread).
- ``LocalServer(...)``: the same server on a background thread with its own event loop,
  for sync code and for tests that drive the SDK; ``start()``/``stop()`` or ``with``.
- ``spawn_local_server(...)``: ``python -m engine.local`` as a child process, for tests
  that kill -9 the server and restart it on the same data dir.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import anyio
import httpx
import uvicorn
from anyio.abc import TaskStatus
from anyio.from_thread import BlockingPortal, start_blocking_portal

from engine.common.http11 import with_header_timeout
from engine.local.compute.backend import Backend
from engine.local.compute.thread import ComputeThread
from engine.local.config import READY_PREFIX, ServerConfig, ServerConfigError
from engine.local.http.app import build_app
from engine.local.http.auth import Authenticator
from engine.local.models.tokenizer_cache import register_tokenizer
from engine.local.operations import LocalService
from engine.local.stats import StatsSnapshot

T = TypeVar("T")
log = logging.getLogger("engine.local")


@dataclass
class RunningServer:
    """A started server (as yielded by ``serve_local``)."""

    base_url: str
    """E.g. "http://127.0.0.1:40123"; pass it as the SDK's base_url / MINT_BASE_URL."""
    api_key: str | None
    data_dir: Path
    model_name: str
    """The base_model name clients pass (also listed by get_server_capabilities)."""
    model_dir: Path
    service: LocalService

    @property
    def stats(self) -> StatsSnapshot:
        """Counters: requests, applied ops, optimizer_steps per model, faults, batches..."""
        return self.service.snapshot()

    async def backend_call(self, fn: Callable[[Backend], T]) -> T:
        """Run ``fn(backend)`` on the compute thread (e.g. ``b.optimizer_steps(id)``)."""
        backend = self.service.backend
        return await self.service.compute.run(lambda: fn(backend))


async def _request_tasks_done(uv: uvicorn.Server) -> None:
    """Wait (briefly) for request tasks uvicorn cancelled at shutdown to finish, so none
    outlives ``serve_local``."""
    tasks = list(uv.server_state.tasks)
    if tasks:
        await asyncio.wait(tasks, timeout=5)


class _EmbeddedUvicorn(uvicorn.Server):
    """uvicorn without its signal handlers: the embedding program owns SIGINT/SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not the default 0: asyncio turns Nagle's algorithm off (TCP_NODELAY)
    # only on sockets whose proto says TCP, and accepted sockets inherit the listener's.
    # With Nagle on, a response written in two parts (headers, body) on a kept-alive
    # connection waited for the client's delayed ACK: ~40 ms per request.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ServerConfigError(f"cannot bind {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(2048)
    return sock


@asynccontextmanager
async def serve_local(
    config: ServerConfig | None = None, *, now: Callable[[], float] = time.time
) -> AsyncIterator[RunningServer]:
    """Serve the MinT-compatible API as ``config`` says (None: ``ServerConfig()``, the
    packaged model, no API key, a fresh temporary data dir removed on exit, loopback on
    a free port) from this event loop until the block exits. Build a config naming a
    pretrained model off the event loop: it converts the model on first use. ``now`` is
    the wall clock of TTLs and heartbeats (tests inject a fake one).
    The server is reachable as soon as this yields; leaving the block stops it without
    waiting for held long-polls.
    """
    config = config or ServerConfig()
    temp_dir = config.data_dir is None
    data_path = Path(tempfile.mkdtemp(prefix="engine-local-")) if temp_dir else config.data_dir
    assert data_path is not None
    data_path.mkdir(parents=True, exist_ok=True)
    compute = ComputeThread()
    try:
        backend = await compute.run(
            lambda: Backend(
                config.model_dir, model_name=config.model_name, num_threads=config.num_threads
            )
        )
        tokenizer_dir = await anyio.to_thread.run_sync(
            register_tokenizer, backend.model_name, backend.model_dir
        )
        for alias in config.model_aliases:  # loadable by any name the server accepts
            await anyio.to_thread.run_sync(register_tokenizer, alias, backend.model_dir)
        sock = _bind(config.host, config.port)
        try:
            async with anyio.create_task_group() as tg:
                service = LocalService(
                    config, backend, compute, data_path, now=now, tokenizer_dir=tokenizer_dir
                )
                # Shielded like the HTTP server below: a caller cancelled mid-run (an
                # embedding host) still talks to this server while it winds down (its
                # stop checkpoint, its session's close), so the server's operations run
                # on until the block exits, stopped after the HTTP server.
                operations = anyio.CancelScope(shield=True)

                async def operate(*, task_status: TaskStatus[None]) -> None:
                    with operations:
                        await service.run(task_status=task_status)

                await tg.start(operate)
                auth = Authenticator(config.api_key, jwt_ttl_s=config.jwt_ttl_s)
                uv = _EmbeddedUvicorn(
                    uvicorn.Config(
                        build_app(service, auth),
                        http=with_header_timeout(config.header_timeout_s),
                        lifespan="off",
                        log_config=None,
                        access_log=False,
                        timeout_graceful_shutdown=3,
                        timeout_keep_alive=75,
                    )
                )
                stopped = anyio.Event()

                async def serve() -> None:
                    # Shielded: uvicorn runs each request as a bare asyncio task, so it
                    # must always get to its own graceful shutdown (triggered below via
                    # should_exit), even when the caller's scope is cancelled.
                    try:
                        with anyio.CancelScope(shield=True):
                            await uv.serve(sockets=[sock])
                            await _request_tasks_done(uv)
                    finally:
                        stopped.set()

                tg.start_soon(serve)
                bound_host, bound_port = sock.getsockname()[:2]
                url_host = f"[{bound_host}]" if ":" in bound_host else bound_host
                try:
                    yield RunningServer(
                        base_url=f"http://{url_host}:{bound_port}",
                        api_key=config.api_key,
                        data_dir=data_path,
                        model_name=service.card.name,
                        model_dir=service.card.directory,
                        service=service,
                    )
                finally:
                    service.close()
                    uv.should_exit = True
                    with anyio.move_on_after(10, shield=True):
                        await stopped.wait()
                    operations.cancel()
                    tg.cancel_scope.cancel()
        finally:
            sock.close()
    finally:
        with anyio.CancelScope(shield=True):
            await compute.aclose()
        if temp_dir:
            shutil.rmtree(data_path, ignore_errors=True)


class LocalServer(AbstractContextManager["LocalServer"]):
    """``serve_local`` on a background thread, for sync code::

        with LocalServer(api_key="tml-test") as server:
            client = mint.ServiceClient(base_url=server.base_url, api_key=server.api_key)

    Serves ``config``, else ``ServerConfig(model_dir=model_dir, **settings)``.
    """

    def __init__(
        self,
        model_dir: str | Path | None = None,
        *,
        config: ServerConfig | None = None,
        now: Callable[[], float] = time.time,
        **settings: Any,
    ) -> None:
        self._now = now
        self._config = config or ServerConfig(model_dir=model_dir, **settings)
        self._portal_cm: AbstractContextManager[BlockingPortal] | None = None
        self._portal: BlockingPortal | None = None
        self._server_cm: AbstractContextManager[RunningServer] | None = None
        self._server: RunningServer | None = None

    def start(self) -> LocalServer:
        if self._server is not None:
            raise RuntimeError("this LocalServer is already started")
        self._portal_cm = start_blocking_portal()
        self._portal = self._portal_cm.__enter__()
        try:
            self._server_cm = self._portal.wrap_async_context_manager(
                serve_local(self._config, now=self._now)
            )
            self._server = self._server_cm.__enter__()
        except BaseException:
            self._portal_cm.__exit__(*sys.exc_info())
            self._portal_cm = self._portal = self._server_cm = None
            raise
        return self

    def stop(self) -> None:
        """Stop the server and its thread (idempotent)."""
        server_cm, portal_cm = self._server_cm, self._portal_cm
        self._server_cm = self._portal_cm = self._portal = None
        self._server = None
        try:
            if server_cm is not None:
                server_cm.__exit__(None, None, None)
        finally:
            if portal_cm is not None:
                portal_cm.__exit__(None, None, None)

    def __enter__(self) -> LocalServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def running(self) -> RunningServer:
        if self._server is None:
            raise RuntimeError("the LocalServer is not started")
        return self._server

    @property
    def base_url(self) -> str:
        return self.running.base_url

    @property
    def api_key(self) -> str | None:
        return self.running.api_key

    @property
    def data_dir(self) -> Path:
        return self.running.data_dir

    @property
    def model_name(self) -> str:
        return self.running.model_name

    @property
    def stats(self) -> StatsSnapshot:
        assert self._portal is not None
        return self._portal.call(self.running.service.snapshot)

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn()`` on the server's event loop (atomically with its requests)."""
        assert self._portal is not None
        return self._portal.call(fn)

    def backend_call(self, fn: Callable[[Backend], T]) -> T:
        """Run ``fn(backend)`` on the server's compute thread and return its result."""
        assert self._portal is not None
        return self._portal.call(self.running.backend_call, fn)


@dataclass
class SpawnedServer(AbstractContextManager["SpawnedServer"]):
    """A ``python -m engine.local`` child process (from ``spawn_local_server``)."""

    base_url: str
    api_key: str | None
    data_dir: Path
    process: subprocess.Popen[str]

    def stats(self) -> dict[str, Any]:
        """The server's counters (GET /api/v1/local/stats)."""
        headers = {"X-API-Key": self.api_key} if self.api_key else {}
        response = httpx.get(f"{self.base_url}/api/v1/local/stats", headers=headers, timeout=10)
        response.raise_for_status()
        data: dict[str, Any] = response.json()
        return data

    def kill(self) -> None:
        """SIGKILL (no cleanup), as a crash would."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL if it has not exited after ``timeout`` seconds."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        if self.process.stdout is not None:
            self.process.stdout.close()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def spawn_local_server(
    model_dir: str | Path | None = None,
    *,
    data_dir: str | Path,
    api_key: str | None = None,
    port: int = 0,
    faults: str | None = None,
    latency: str | None = None,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    stderr: int | None = None,
    ready_timeout_s: float = 120.0,
) -> SpawnedServer:
    """Start ``python -m engine.local`` and wait for its ready line. ``data_dir`` is
    required: a server you can kill and restart must keep its checkpoints somewhere.
    ``stderr`` (e.g. ``subprocess.DEVNULL``) defaults to inheriting this process's."""
    args = [sys.executable, "-m", "engine.local", "--port", str(port), "--data-dir", str(data_dir)]
    if model_dir is not None:
        args += ["--model", str(model_dir)]
    if faults:
        args += ["--faults", faults]
    if latency:
        args += ["--latency", latency]
    args += list(extra_args)
    child_env = dict(os.environ if env is None else env)
    child_env.setdefault("HF_HUB_OFFLINE", "1")
    child_env.pop("ENGINE_LOCAL_API_KEY", None)
    if api_key is not None:
        child_env["ENGINE_LOCAL_API_KEY"] = api_key  # not on the command line (ps shows it)
    process = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=stderr, text=True, env=child_env, bufsize=1
    )
    deadline = time.monotonic() + ready_timeout_s
    assert process.stdout is not None
    line = ""
    with _line_reader(process) as next_line:
        while time.monotonic() < deadline:
            line = next_line(deadline - time.monotonic())
            if line.startswith(READY_PREFIX):
                url = line.rsplit(" at ", 1)[1].strip()
                return SpawnedServer(url, api_key, Path(data_dir), process)
            if process.poll() is not None:
                break
    process.kill()
    process.wait()
    raise RuntimeError(
        f"engine.local did not become ready (exit code {process.returncode}); last output: "
        f"{line.strip()!r}"
    )


@contextlib.contextmanager
def _line_reader(process: subprocess.Popen[str]) -> Iterator[Callable[[float], str]]:
    """Read stdout lines with a timeout (a selector on the pipe; POSIX only)."""
    import selectors

    assert process.stdout is not None
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ)

    def next_line(timeout: float) -> str:
        if selector.select(max(0.0, timeout)):
            return process.stdout.readline() if process.stdout else ""
        return ""

    try:
        yield next_line
    finally:
        selector.close()
