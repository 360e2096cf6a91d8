"""Agent processes: ``--task agent-cmd:COMMAND`` runs ``COMMAND`` once per episode, with
``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` naming its episode on the capturing endpoint,
``ENGINE_PROBLEM_FILE`` a file holding the problem as JSON (``{"id", "question",
"answer", "data"}``) and ``ENGINE_PROBLEM`` the same JSON when it is at most
:data:`PROBLEM_ENV_LIMIT` bytes. Its environment is built from an allow-list
(:data:`PASSED_ENVIRONMENT`, ``LC_*``) and the names its ``env`` argument adds: the
engine's keys never reach it.

Its reward is its output's last line, a JSON object ``{"reward": R}`` (other numbers in
it are logged as ``env/all/<name>`` metrics), or what ``scorer(problem, output)`` says
when one is given. It runs under a supervisor (:mod:`engine.agents.process_supervisor`) that
ends every process it started -- in a session of their own too -- when it exits, times
out, the run stops or the engine dies. A non-zero exit, a missing reward line or a
timeout ends the episode as an agent error (``--on-limit``: zero or mask), with the last
lines of its output in the episode's logs.

Task arguments: ``problems`` (a ``--task`` spec, default ``arithmetic``), ``timeout``
(seconds per process, default ``--episode-timeout``; 0: no limit) and ``env`` (more
variable names to pass, comma-separated); the others go to the problems' task.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import ByteReceiveStream

from engine.agents.episodes import AgentError, AgentResult
from engine.agents.task import AgentTask
from engine.basemodels.catalogue import AGENT_MODEL_DIR
from engine.common.setting import finite_non_negative
from engine.errors import ConfigError
from engine.tasks import Problem

__all__ = [
    "AGENT_PROCESS_MODEL",
    "OUTPUT_LIMIT",
    "OUTPUT_LINES",
    "PASSED_ENVIRONMENT",
    "PROBLEM_ENV_LIMIT",
    "AgentCommand",
    "agent_command_task",
]

AGENT_PROCESS_MODEL = AGENT_MODEL_DIR
"""The model the local server loads for agent processes unless one is given: the
packaged agent model (chat messages and Hermes tool calls)."""

OUTPUT_LIMIT = 64 * 1024
"""The bytes of a process's output (stdout, stderr) kept: the tail."""
OUTPUT_LINES = 20
"""The lines of each output a failed episode keeps in its logs (each cut at 500 chars)."""
PROBLEM_ENV_LIMIT = 64 * 1024
"""The largest problem (bytes of JSON) also passed in ``ENGINE_PROBLEM``: one variable
may not exceed 128 KiB on Linux; ``ENGINE_PROBLEM_FILE`` holds every problem."""
PASSED_ENVIRONMENT = (
    *("PATH", "HOME", "USER", "LOGNAME", "SHELL", "TERM", "LANG", "LANGUAGE", "TZ", "TMPDIR"),
    *("PYTHONPATH", "PYTHONHOME", "PYTHONUTF8", "PYTHONIOENCODING", "PYTHONUNBUFFERED"),
    *("VIRTUAL_ENV", "CONDA_PREFIX", "SSL_CERT_FILE", "SSL_CERT_DIR"),
)
"""The engine's variables an agent process gets (with ``LC_*``) when they are set: what
programs need to run, never a key."""
_SET_BY_ENGINE = ("OPENAI_BASE_URL", "OPENAI_API_KEY", "ENGINE_PROBLEM", "ENGINE_PROBLEM_FILE")
_SUPERVISOR = Path(__file__).with_name("process_supervisor.py")
_KILL_WAIT_S = 5.0
_DRAIN_S = 5.0
"""How long output is read after the process ended (a pipe a stray process keeps open
does not hold the episode)."""


class AgentCommand:
    """An agent function that runs ``argv`` as an agent process (``env``: more variable
    names to pass from the engine's environment)."""

    def __init__(
        self,
        argv: list[str],
        *,
        scorer: Callable[[Problem, str], float] | None = None,
        cwd: Path | None = None,
        env: Iterable[str] = (),
    ) -> None:
        if not argv:
            raise ConfigError("agent-cmd: give the command to run, e.g. agent-cmd:python agent.py")
        program = Path(cwd or ".") / argv[0] if os.sep in argv[0] else shutil.which(argv[0])
        if program is None or not os.access(program, os.X_OK) or Path(program).is_dir():
            where = "not an executable file" if os.sep in argv[0] else "not found on PATH"
            raise ConfigError(f"agent-cmd: cannot run {argv[0]!r}: {where}")
        self.argv = argv
        self.scorer = scorer
        self.cwd = cwd
        self.env = tuple(env)
        for name in self.env:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) or name in _SET_BY_ENGINE:
                why = "the engine sets it" if name in _SET_BY_ENGINE else "not a variable name"
                raise ConfigError(f"agent-cmd: env cannot pass {name!r}: {why}")
        self.__name__ = Path(argv[0]).name

    async def __call__(self, client: Any, problem: Problem) -> AgentResult:
        data = json.dumps(
            {
                "id": problem.id,
                "question": problem.question,
                "answer": problem.answer,
                "data": dict(problem.data),
            }
        )
        with tempfile.TemporaryDirectory(prefix="engine-agent-") as private:  # (mode 0700)
            problem_file = Path(private) / "problem.json"
            await anyio.Path(problem_file).write_text(data)
            env = {name: os.environ[name] for name in os.environ if self._passes(name)}
            env |= {
                "OPENAI_BASE_URL": str(client.base_url),
                "OPENAI_API_KEY": str(client.api_key),
                "ENGINE_PROBLEM_FILE": str(problem_file),
            }
            if len(data.encode()) <= PROBLEM_ENV_LIMIT:
                env["ENGINE_PROBLEM"] = data
            code, out, err = await self._run(env)
        output = out.decode(errors="replace")
        try:
            if code != 0:
                tail = err.decode(errors="replace").strip().splitlines()[-3:]
                raise AgentError(
                    f"the agent process exited with status {code}"
                    + (f": {' | '.join(tail)}" if tail else "")
                )
            if self.scorer is not None:
                return AgentResult(float(self.scorer(problem, output)))
            return _reward_line(output)
        except AgentError as exc:  # its output's last lines go with its episode
            stderr = err.decode(errors="replace")
            logs = {"agent_stdout": _tail(output), "agent_stderr": _tail(stderr)}
            raise AgentError(str(exc), logs) from None

    def _passes(self, name: str) -> bool:
        return name in PASSED_ENVIRONMENT or name.startswith("LC_") or name in self.env

    async def _run(self, env: dict[str, str]) -> tuple[int, bytearray, bytearray]:
        """Run the process under its supervisor: its exit status and output's tails."""
        out, err = bytearray(), bytearray()
        process = await anyio.open_process(
            [sys.executable, "-I", "-S", str(_SUPERVISOR), *self.argv],
            stdin=subprocess.PIPE,  # the lifeline: never written, closed when the engine dies
            env=env,
            cwd=self.cwd,
            start_new_session=True,  # its own process group, the fallback's reach
        )
        try:
            async with anyio.create_task_group() as tg:
                assert process.stdout is not None and process.stderr is not None
                tg.start_soon(_drain, process.stdout, out)
                tg.start_soon(_drain, process.stderr, err)
                code = await process.wait()
                _kill_group(process.pid)  # (the fallback's: what stayed in its group)
                tg.cancel_scope.deadline = anyio.current_time() + _DRAIN_S
        finally:
            with anyio.move_on_after(2 * _KILL_WAIT_S, shield=True):
                if process.returncode is None:  # the supervisor ends the tree, then itself
                    with contextlib.suppress(ProcessLookupError):
                        process.terminate()
                    with anyio.move_on_after(_KILL_WAIT_S):
                        await process.wait()
                _kill_group(process.pid)
                await process.wait()
                await process.aclose()
        return code, out, err


def agent_command_task(command: str, args: Mapping[str, str], load_task: Any) -> AgentTask:
    """The task of ``--task agent-cmd:COMMAND`` (``args``: see the module's docstring)."""
    rest = dict(args)
    problems_spec = rest.pop("problems", "arithmetic")
    timeout: float | None = None
    if "timeout" in rest:
        text = rest.pop("timeout")
        try:
            timeout = float(text)
        except ValueError:
            timeout = math.nan
        if finite_non_negative(timeout) is not None:
            raise ConfigError(
                f"agent-cmd: timeout must be a number of seconds >= 0 (0: no limit), got {text!r}"
            )
        timeout = timeout or math.inf
    env = [name.strip() for name in rest.pop("env", "").split(",") if name.strip()]
    problems = load_task(problems_spec, rest)
    try:
        argv = shlex.split(command)
    except ValueError as exc:
        raise ConfigError(f"agent-cmd: cannot split the command {command!r} ({exc})") from None
    task = AgentTask(
        AgentCommand(argv, env=env),
        problems,
        name="agent-cmd",
        timeout=timeout,
        local_model=AGENT_PROCESS_MODEL,
    )
    task.spec = (f"agent-cmd:{command}", dict(args))  # type: ignore[attr-defined]
    return task


async def _drain(stream: ByteReceiveStream, into: bytearray) -> None:
    """Read ``stream`` to its end, keeping its last :data:`OUTPUT_LIMIT` bytes."""
    with contextlib.suppress(anyio.EndOfStream, anyio.ClosedResourceError):
        while True:
            into += await stream.receive()
            del into[:-OUTPUT_LIMIT]


def _tail(output: str) -> list[str]:
    lines = [line[:500] for line in output.splitlines() if line.strip()]
    return lines[-OUTPUT_LINES:]


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _reward_line(output: str) -> AgentResult:
    lines = [line for line in output.strip().splitlines() if line.strip()]
    try:
        record = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        record = None
    reward = record.get("reward") if isinstance(record, dict) else None
    if isinstance(reward, bool) or not isinstance(reward, int | float):
        raise AgentError('the agent process did not end its output with {"reward": <number>}')
    assert isinstance(record, dict)
    metrics = {
        k: float(v)
        for k, v in record.items()
        if k != "reward" and isinstance(v, int | float) and not isinstance(v, bool)
    }
    return AgentResult(float(reward), metrics)
