"""The sandbox's API: ``async with Sandbox(limits) as sb: await sb.run_python(code)``.

Runs never block the event loop (the processes are anyio's), at most ``max_concurrent``
run at once, and the whole process tree is killed when a run ends, hits a limit or is
cancelled. :func:`run_python_sync` is the same for synchronous code (a reward in a worker
thread or a worker process).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path, PurePosixPath
from types import TracebackType
from typing import Any

import anyio
import anyio.abc

from engine.errors import EngineError
from engine.sandbox.isolation import (
    PATH,
    Backend,
    bwrap_argv,
    code_uid,
    isolation_backend,
    isolation_problem,
    launcher_argv,
    unshare_argv,
)
from engine.sandbox.limits import DEFAULT_LIMITS, SandboxLimits
from engine.sandbox.result import SandboxResult, limit_reached, signal_name

__all__ = ["Sandbox", "SandboxUnavailable", "default_python", "run_python_sync"]

_CHUNK = 1 << 16
_HANG_GUARD_S = 60.0
"""How long a killed tree may take to be reaped before that is an error (never, in practice)."""


class SandboxUnavailable(EngineError):
    """This machine cannot isolate code, and the user did not opt out."""

    exit_code = 2


def default_python() -> str:
    """The interpreter behind this one, outside any virtual environment (the sandbox
    shows its prefix, read-only, and nothing of the venv)."""
    return os.path.realpath(sys.executable)


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _file_name(name: str) -> str:
    path = PurePosixPath(name)
    if not name or path.is_absolute() or ".." in path.parts or len(path.parts) != 1:
        raise ValueError(f"sandbox file names are plain names in its temp directory, not {name!r}")
    return name


def _read_status(fd: int) -> dict[str, Any] | None:
    os.set_blocking(fd, False)
    data = b""
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(fd, _CHUNK):
            data += chunk
    try:
        status = json.loads(data)
    except ValueError:
        return None
    return status if isinstance(status, dict) else None


class _Output:
    """stdout and stderr read together against one byte budget."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.kept = {"stdout": bytearray(), "stderr": bytearray()}
        self.seen = {"stdout": 0, "stderr": 0}
        self.over = False

    async def drain(
        self, stream: anyio.abc.ByteReceiveStream, name: str, on_over: Callable[[], None]
    ) -> None:
        async for chunk in stream:
            self.seen[name] += len(chunk)
            room = self.budget - len(self.kept["stdout"]) - len(self.kept["stderr"])
            self.kept[name] += chunk[: max(room, 0)]
            if len(chunk) > room and not self.over:
                self.over = True
                on_over()

    def text(self, name: str) -> str:
        return self.kept[name].decode(errors="replace")


class Sandbox:
    """Runs untrusted commands isolated (bubblewrap, else ``unshare``) and bounded
    (``limits``).

    ``python``: the interpreter of :meth:`run_python` (default :func:`default_python`);
    its prefix is shown read-only. ``ro_paths``: more host paths to show read-only (e.g. a
    site-packages). ``max_concurrent``: runs at once (default: the CPU count).
    ``allow_unisolated``: where neither bubblewrap nor ``unshare`` can isolate, run with
    the limits alone instead of refusing (the code then sees the machine's files and
    network). ``backend``: isolate with this one (:data:`~engine.sandbox.isolation.BACKENDS`)
    instead of the first that works here (it must work here too).
    """

    def __init__(
        self,
        limits: SandboxLimits = DEFAULT_LIMITS,
        *,
        max_concurrent: int | None = None,
        python: str | None = None,
        ro_paths: Sequence[str | Path] = (),
        allow_unisolated: bool = False,
        backend: Backend | None = None,
    ) -> None:
        self.limits = limits
        self.backend = backend
        self.max_concurrent = max_concurrent or os.cpu_count() or 1
        if self.max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {max_concurrent}")
        self.python = python or default_python()
        prefix = [Path(sys.base_prefix)] if python is None else []
        paths = [Path(p) for p in ro_paths]
        for path in paths:
            if not path.is_absolute() or not path.exists():
                raise ValueError(
                    f"sandbox ro_paths must be existing absolute paths, not {str(path)!r}"
                )
        self.ro_paths = tuple(prefix + paths)
        self.allow_unisolated = allow_unisolated
        self._limiter = anyio.CapacityLimiter(self.max_concurrent)

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_limiter"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._limiter = anyio.CapacityLimiter(self.max_concurrent)

    async def __aenter__(self) -> Sandbox:
        await self._isolated()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        return None

    async def _isolated(self) -> Backend | None:
        """The backend that isolates here (bubblewrap, else ``unshare``); None where
        neither can and the user opted out; :class:`SandboxUnavailable` (one line)
        otherwise."""
        problem = await isolation_problem(self.backend)
        if problem is None:
            return self.backend or isolation_backend()
        if self.allow_unisolated:
            return None
        raise SandboxUnavailable(
            f"sandbox: cannot isolate code on this machine: {problem}; "
            "refusing to run it unisolated unless asked to "
            "(allow_unisolated=True, --unsafe-no-isolation)"
        )

    async def run_python(
        self,
        code: str,
        *,
        stdin: str | bytes | None = None,
        files: Mapping[str, str | bytes] | None = None,
        args: Sequence[str] = (),
    ) -> SandboxResult:
        """Run ``code`` as ``main.py`` in the sandbox's temp directory (``python -I``)."""
        argv = [self.python, "-I", "main.py", *args]
        return await self.run(argv, stdin=stdin, files={**(files or {}), "main.py": code})

    async def run(
        self,
        argv: Sequence[str],
        *,
        stdin: str | bytes | None = None,
        files: Mapping[str, str | bytes] | None = None,
    ) -> SandboxResult:
        """Run ``argv`` in the sandbox's temp directory, which holds ``files`` (plain
        name -> content); ``stdin`` is its standard input (else empty)."""
        if not argv:
            raise ValueError("sandbox: an empty command")
        named = {
            _file_name(k): v.encode() if isinstance(v, str) else v for k, v in (files or {}).items()
        }
        data = stdin.encode() if isinstance(stdin, str) else stdin or b""
        backend = await self._isolated()
        async with self._limiter:
            with contextlib.ExitStack() as scratch:
                return await self._run(list(argv), named, data, backend, scratch)

    async def _run(
        self,
        argv: list[str],
        files: dict[str, bytes],
        stdin: bytes,
        backend: Backend | None,
        scratch: contextlib.ExitStack,
    ) -> SandboxResult:
        status_r, status_w = os.pipe()
        child_fds = [status_w]  # the child's copies: closed here once it has started
        try:
            stdin_fd = _memfd("stdin", stdin)
            child_fds.append(stdin_fd)
            uid = code_uid() if backend is not None else -1
            inner = launcher_argv(self.python, status_w, uid, self.limits.rlimits(), argv)
            cwd: str | None = None
            if backend is not None:
                file_fds: dict[str, int] = {}
                for name, data in files.items():
                    file_fds[name] = _memfd(name, data)
                    child_fds.append(file_fds[name])
                tmp_bytes = self.limits.tmp_bytes
                if backend == "bwrap":
                    bwrap = shutil.which("bwrap") or "bwrap"
                    sandbox = bwrap_argv(
                        bwrap, ro_paths=self.ro_paths, files=file_fds, tmp_bytes=tmp_bytes
                    )
                    command = [*sandbox, "--", *inner]
                else:
                    root = tempfile.TemporaryDirectory(prefix="sandbox-root-")
                    sandbox = unshare_argv(
                        shutil.which("unshare") or "unshare",
                        root=Path(scratch.enter_context(root)),
                        ro_paths=self.ro_paths,
                        files=file_fds,
                        tmp_bytes=tmp_bytes,
                    )
                    command = [*sandbox, *inner]
                passed = [status_w, *file_fds.values()]
                env: dict[str, str] = {}
            else:
                scratch_dir = tempfile.TemporaryDirectory(
                    prefix="sandbox-", ignore_cleanup_errors=True
                )
                cwd = scratch.enter_context(scratch_dir)
                for name, data in files.items():
                    await anyio.Path(cwd, name).write_bytes(data)
                command, passed = inner, [status_w]
                env = {"PATH": PATH, "HOME": cwd, "TMPDIR": cwd, "LANG": "C.UTF-8"}
            start = time.monotonic()
            process = await anyio.open_process(
                command,
                stdin=stdin_fd,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=cwd,
                env=env,
                pass_fds=passed,
                start_new_session=True,
            )
        except BaseException:
            os.close(status_r)
            raise
        finally:
            for fd in child_fds:
                os.close(fd)
        scratch.callback(os.close, status_r)
        killed: list[str] = []

        def kill(why: str) -> None:
            if process.returncode is not None:
                return  # reaped: its pid (and group id) may already be another's
            if not killed:
                killed.append(why)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)

        output = _Output(self.limits.output_bytes)
        try:
            with anyio.move_on_after(self.limits.wall_s) as wall:
                async with anyio.create_task_group() as tg:
                    assert process.stdout is not None and process.stderr is not None
                    tg.start_soon(output.drain, process.stdout, "stdout", lambda: kill("output"))
                    tg.start_soon(output.drain, process.stderr, "stderr", lambda: kill("output"))
                await process.wait()
            if wall.cancelled_caught:
                kill("wall")
        finally:
            kill("cancelled")  # the tree goes whatever happened; a no-op once it is gone
            with anyio.CancelScope(shield=True), anyio.fail_after(_HANG_GUARD_S):
                await process.aclose()
        wall_s = time.monotonic() - start
        status = _read_status(status_r)
        stderr = output.text("stderr")
        limit: str | None = killed[0] if killed and killed[0] != "cancelled" else None
        exit_code: int | None = None
        sig: str | None = None
        cpu_s: float | None = None
        if limit is not None:
            sig = "SIGKILL"
        elif status is not None:
            code = int(status["exit"])
            cpu_s = round(float(status["cpu_s"]), 3)
            exit_code, sig = (code, None) if code >= 0 else (None, signal_name(-code))
            limit = limit_reached(self.limits, signal=sig, cpu_s=cpu_s, stderr=stderr)
        else:  # the launcher never reported: bubblewrap could not set up, or it was killed
            code = process.returncode if process.returncode is not None else -signal.SIGKILL
            exit_code, sig = (code, None) if code >= 0 else (None, signal_name(-code))
        return SandboxResult(
            exit_code=exit_code,
            signal=sig,
            limit=limit,
            stdout=output.text("stdout"),
            stderr=stderr,
            stdout_bytes=output.seen["stdout"],
            stderr_bytes=output.seen["stderr"],
            truncated=output.over,
            wall_s=round(wall_s, 3),
            cpu_s=cpu_s,
            isolated=backend is not None,
        )


def run_python_sync(
    code: str,
    *,
    limits: SandboxLimits = DEFAULT_LIMITS,
    stdin: str | bytes | None = None,
    files: Mapping[str, str | bytes] | None = None,
    allow_unisolated: bool = False,
) -> SandboxResult:
    """:meth:`Sandbox.run_python` for synchronous code (a reward in a worker thread or
    process): one run on its own event loop. Bound concurrency with the pool's size."""

    async def go() -> SandboxResult:
        async with Sandbox(limits, max_concurrent=1, allow_unisolated=allow_unisolated) as sandbox:
            return await sandbox.run_python(code, stdin=stdin, files=files)

    return anyio.run(go)
