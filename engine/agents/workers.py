"""Agent functions in worker processes (``--score-workers processes:N`` on an agent task).

An agent waits on its HTTP calls most of the time, so one worker process runs any number
of them at once on its own event loop; what moves off the engine's event loop (and its
GIL) is the agent's own CPU -- its SDK building requests and parsing replies, its tools
-- while the engine serves the calls on loopback. :class:`AgentWorkers` is ``N`` such
processes, started on first use, each call sent to
the least busy one. It answers the :class:`~engine.envs.executors.Workers` protocol:
``call(target, method, *args)`` runs ``target.method(*args)`` in a worker (pickled
there by reference, so an agent function must be importable) and returns the target and
the value; what the call raises is raised here. A cancelled call is cancelled in its
worker; a worker that dies fails its calls (one line: its exit code and the tail of its
stderr) and the next call starts a fresh one; leaving the pool ends the workers (their
process groups: an agent's children too).

The agents' clients call their endpoints through the same pipe
(:func:`worker_dispatch`): a request goes to the engine, which answers it with the
endpoint's :attr:`~engine.agents.endpoint.Endpoint.dispatch` (registered with
:meth:`AgentWorkers.route`): no socket and no HTTP parsing on the engine's event loop.

The wire: each frame is an 8-byte big-endian length and a pickle. To a worker:
``("run", job, payload)`` with ``payload`` the pickled ``(target, method, args)``
(unpickled in the worker, so that a target that cannot be imported there fails its
call only), ``("cancel", job)``, ``("reply", request, (status, media_type, body))``.
From a worker: ``("done", job, (target, value, error))``, ``("request", request,
route, method, path, api_key, body)``. A worker's frames go to the file descriptor its
stdout had; its fd 1 is its stderr, so an agent's prints do not corrupt them.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import pickle
import signal
import subprocess
import sys
from collections import deque
from collections.abc import Iterator
from types import TracebackType
from typing import IO, Any

import anyio
import anyio.abc
from anyio.streams.buffered import BufferedByteReceiveStream

from engine.agents.endpoint import Dispatch, Reply
from engine.envs.worker_calls import outcome_of
from engine.errors import EngineError

__all__ = ["AgentWorkers", "worker_dispatch"]

_LENGTH = 8
_STDERR_TAIL = 20
_EXIT_WAIT_S = 5.0
Outcome = tuple[Any, Any, BaseException | None]


class AgentWorkers:
    """At most ``processes`` agent worker processes, each running many calls at once."""

    def __init__(self, processes: int) -> None:
        if processes < 1:
            raise ValueError("processes must be >= 1")
        self._size = processes
        self._workers: list[_AgentWorker] = []
        self._starting = anyio.Lock()
        self._stack = contextlib.AsyncExitStack()
        self._tg: anyio.abc.TaskGroup | None = None
        self.routes: dict[str, Dispatch] = {}

    async def __aenter__(self) -> AgentWorkers:
        self._tg = await self._stack.enter_async_context(anyio.create_task_group())
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            with anyio.CancelScope(shield=True):
                for worker in self._workers:
                    await worker.end()
        finally:
            self._workers.clear()
            if self._tg is not None:
                self._tg.cancel_scope.cancel()
            await self._stack.aclose()

    @property
    def pids(self) -> list[int]:
        """The live workers' process ids."""
        return [w.process.pid for w in self._workers if w.alive]

    @contextlib.contextmanager
    def route(self, route: str, dispatch: Dispatch) -> Iterator[None]:
        """While the block runs, the workers' requests for ``route`` (what
        :func:`worker_dispatch` was given) are answered by ``dispatch``."""
        self.routes[route] = dispatch
        try:
            yield
        finally:
            self.routes.pop(route, None)

    async def call(self, target: Any, method: str, *args: Any) -> tuple[Any, Any]:
        payload = pickle.dumps((target, method, args))
        worker = await self._worker()
        return await worker.call(payload)

    async def _worker(self) -> _AgentWorker:
        if self._tg is None:
            raise RuntimeError("AgentWorkers must be entered ('async with') before a call")
        async with self._starting:
            self._workers = [w for w in self._workers if w.alive]
            least = min(self._workers, key=lambda w: len(w.pending), default=None)
            if least is not None and (not least.pending or len(self._workers) >= self._size):
                return least
            worker = await _AgentWorker.start(self.routes)
            self._tg.start_soon(worker.read_frames)
            self._workers.append(worker)
            return worker


class _AgentWorker:
    """One worker process: the calls it runs and the requests it sends."""

    def __init__(self, process: anyio.abc.Process, routes: dict[str, Dispatch]) -> None:
        self.process = process
        assert process.stdin is not None and process.stdout is not None
        self._stdin = process.stdin
        self._stdout = BufferedByteReceiveStream(process.stdout)
        self._stderr: deque[str] = deque(maxlen=_STDERR_TAIL)
        self._routes = routes
        self.pending: dict[int, _PendingCall] = {}
        self._jobs = 0
        self._writing = anyio.Lock()
        self.alive = True

    @classmethod
    async def start(cls, routes: dict[str, Dispatch]) -> _AgentWorker:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # the caller's modules
        process = await anyio.open_process(
            [sys.executable, "-c", "from engine.agents.workers import main; main()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
        return cls(process, routes)

    async def call(self, payload: bytes) -> tuple[Any, Any]:
        self._jobs += 1
        job = self._jobs
        pending = _PendingCall()
        self.pending[job] = pending
        try:
            await self._send(("run", job, payload))
            await pending.done.wait()
        except anyio.get_cancelled_exc_class():
            with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                await self._send(("cancel", job))
            raise
        finally:
            self.pending.pop(job, None)
        if pending.outcome is None:
            raise EngineError(pending.failure or "the agent worker process ended")
        return outcome_of(pending.outcome)

    async def _send(self, frame: tuple[Any, ...]) -> None:
        data = pickle.dumps(frame)
        async with self._writing:
            await self._stdin.send(len(data).to_bytes(_LENGTH, "big") + data)

    async def read_frames(self) -> None:
        """Hand each outcome to its call and answer each request, until the worker's
        stdout ends; then fail the calls left (the worker died) with its exit code and
        stderr's tail."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._read_stderr)
            try:
                while True:
                    size = int.from_bytes(await self._stdout.receive_exactly(_LENGTH), "big")
                    frame = pickle.loads(await self._stdout.receive_exactly(size))
                    if frame[0] == "request":
                        tg.start_soon(self._answer, *frame[1:])
                        continue
                    pending = self.pending.get(frame[1])
                    if pending is not None:
                        pending.outcome = frame[2]
                        pending.done.set()
            except (anyio.EndOfStream, anyio.IncompleteRead, anyio.ClosedResourceError):
                pass
            finally:
                self.alive = False
            with anyio.move_on_after(_EXIT_WAIT_S):
                await self.process.wait()
            tg.cancel_scope.cancel()
        tail = " | ".join(self._stderr)
        failure = f"the agent worker process exited with code {self.process.returncode}" + (
            f": {tail}" if tail else ""
        )
        for pending in self.pending.values():
            pending.failure = failure
            pending.done.set()

    async def _answer(
        self, request: int, route: str, method: str, path: str, key: str | None, body: bytes
    ) -> None:
        dispatch = self._routes.get(route)
        if dispatch is None:
            reply = _gone(route)
        else:
            reply = await dispatch(method, path, key, body)
        with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
            await self._send(("reply", request, (reply.status, reply.media_type, reply.content)))

    async def _read_stderr(self) -> None:
        assert self.process.stderr is not None
        with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
            async for chunk in self.process.stderr:
                text = chunk.decode(errors="replace")
                sys.stderr.write(text)  # an agent's prints and logs, as in process
                self._stderr.extend(line for line in text.splitlines() if line.strip())

    async def end(self) -> None:
        """Close its input (it exits), then end its process group if it lingers."""
        self.alive = False
        with contextlib.suppress(Exception):
            await self._stdin.aclose()
        with anyio.move_on_after(_EXIT_WAIT_S):
            await self.process.wait()
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)
            await self.process.wait()


class _PendingCall:
    def __init__(self) -> None:
        self.done = anyio.Event()
        self.outcome: Outcome | None = None
        self.failure: str | None = None


def _gone(route: str) -> Reply:
    from engine.agents.openai_wire import error_body

    body = error_body(f"the endpoint {route} has closed", "conflict_error")
    return Reply(409, "application/json", json.dumps(body).encode())


# -- the worker process ------------------------------------------------------------------


class _Channel:
    """The worker's side of the pipe: frames out, requests awaiting their replies."""

    def __init__(self, frames_out: IO[bytes]) -> None:
        self._out = frames_out
        self._writing = anyio.Lock()
        self._requests = 0
        self.replies: dict[int, tuple[anyio.Event, list[Reply]]] = {}

    async def send(self, frame: tuple[Any, ...]) -> None:
        data = pickle.dumps(frame)
        async with self._writing:
            self._out.write(len(data).to_bytes(_LENGTH, "big") + data)
            self._out.flush()

    async def dispatch(
        self, route: str, method: str, path: str, api_key: str | None, body: bytes
    ) -> Reply:
        self._requests += 1
        request = self._requests
        done, box = anyio.Event(), list[Reply]()
        self.replies[request] = (done, box)
        try:
            await self.send(("request", request, route, method, path, api_key, body))
            await done.wait()
        finally:
            self.replies.pop(request, None)
        return box[0]


_CHANNEL: _Channel | None = None


def worker_dispatch(route: str) -> Dispatch | None:
    """In an agent worker process, the dispatch of the engine's endpoint ``route`` (the
    group registered it with :meth:`AgentWorkers.route`); None elsewhere."""
    channel = _CHANNEL
    if channel is None:
        return None
    return functools.partial(channel.dispatch, route)


def _serve(channel: _Channel) -> None:
    """Run calls as they come in, each in a task of this process's event loop, and hand
    replies to their requests, until the input ends."""

    async def run(job: int, payload: bytes, scopes: dict[int, anyio.CancelScope]) -> None:
        with scopes[job]:
            try:
                target, method, args = pickle.loads(payload)
                value = await getattr(target, method)(*args)
                outcome: Outcome = (target, value, None)
            except Exception as exc:
                outcome = (None, None, exc)
            try:
                await channel.send(("done", job, outcome))
            except Exception as exc:  # an unpicklable value or error: its text instead
                failed = EngineError(f"its result could not be sent back: {exc}")
                await channel.send(("done", job, (None, None, failed)))
        scopes.pop(job, None)

    async def main() -> None:
        source = anyio.wrap_file(os.fdopen(0, "rb", buffering=0))
        scopes: dict[int, anyio.CancelScope] = {}
        async with anyio.create_task_group() as tg:
            while True:
                header = await _read_exactly(source, _LENGTH)
                data = header and await _read_exactly(source, int.from_bytes(header, "big"))
                if not data:
                    break
                frame = pickle.loads(data)
                if frame[0] == "reply":
                    waiting = channel.replies.get(frame[1])
                    if waiting is not None:
                        waiting[1].append(Reply(*frame[2]))
                        waiting[0].set()
                elif frame[0] == "cancel":
                    scope = scopes.pop(frame[1], None)
                    if scope is not None:
                        scope.cancel()
                else:
                    scopes[frame[1]] = anyio.CancelScope()
                    tg.start_soon(run, frame[1], frame[2], scopes)
            tg.cancel_scope.cancel()

    anyio.run(main)


async def _read_exactly(source: anyio.AsyncFile[bytes], size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = await source.read(size - len(data))
        if not chunk:
            return b""
        data += chunk
    return data


def main() -> None:
    """The worker process."""
    global _CHANNEL
    sys.stdout.flush()
    frames = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    _CHANNEL = _Channel(frames)
    _serve(_CHANNEL)
