"""Agent processes: ``--task agent-cmd:COMMAND`` runs ``COMMAND`` once per episode, with
``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` naming its episode on the capturing endpoint and
``ENGINE_PROBLEM`` the problem as JSON (``{"id", "question", "answer", "data"}``).

Its reward is its output's last line, a JSON object ``{"reward": R}`` (other numbers in
it are logged as ``env/all/<name>`` metrics), or what ``scorer(problem, output)`` says
when one is given. The process runs in a process group of its own, killed (children
too) when it exits, times out or the run stops. A non-zero exit, a missing reward line
or a timeout ends the episode as an agent error (``--on-limit``: zero or mask).

Task arguments: ``problems`` (a ``--task`` spec, default ``arithmetic``) and ``timeout``
(seconds per process, default ``--episode-timeout``); the others go to the problems'
task.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import ByteReceiveStream

from engine.agents.episodes import AgentError, AgentResult
from engine.agents.task import AgentTask
from engine.errors import ConfigError
from engine.local.config import AGENT_MODEL_DIR
from engine.tasks import Problem

__all__ = ["AGENT_PROCESS_MODEL", "OUTPUT_LIMIT", "AgentCommand", "agent_command_task"]

AGENT_PROCESS_MODEL = AGENT_MODEL_DIR
"""The model the local server loads for agent processes unless one is given: the
packaged agent model (chat messages and Hermes tool calls)."""

OUTPUT_LIMIT = 64 * 1024
"""The bytes of a process's output (stdout, stderr) kept: the tail."""
_KILL_WAIT_S = 5.0


class AgentCommand:
    """An agent function that runs ``argv`` as an agent process."""

    def __init__(
        self,
        argv: list[str],
        *,
        scorer: Callable[[Problem, str], float] | None = None,
        cwd: Path | None = None,
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
        self.__name__ = Path(argv[0]).name

    async def __call__(self, client: Any, problem: Problem) -> AgentResult:
        env = {
            **os.environ,
            "OPENAI_BASE_URL": str(client.base_url),
            "OPENAI_API_KEY": str(client.api_key),
            "ENGINE_PROBLEM": json.dumps(
                {
                    "id": problem.id,
                    "question": problem.question,
                    "answer": problem.answer,
                    "data": dict(problem.data),
                }
            ),
        }
        out, err = bytearray(), bytearray()
        process = await anyio.open_process(
            self.argv,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=self.cwd,
            start_new_session=True,  # its own process group: killed with its children
        )
        try:
            async with anyio.create_task_group() as tg:
                assert process.stdout is not None and process.stderr is not None
                tg.start_soon(_drain, process.stdout, out)
                tg.start_soon(_drain, process.stderr, err)
                try:
                    code = await process.wait()
                finally:
                    _kill_group(process.pid)  # what it left running goes with it
        finally:
            with anyio.move_on_after(_KILL_WAIT_S, shield=True):
                _kill_group(process.pid)
                await process.wait()
                await process.aclose()
        output = out.decode(errors="replace")
        if code != 0:
            tail = err.decode(errors="replace").strip().splitlines()[-3:]
            raise AgentError(
                f"the agent process exited with status {code}"
                + (f": {' | '.join(tail)}" if tail else "")
            )
        if self.scorer is not None:
            return AgentResult(float(self.scorer(problem, output)))
        return _reward_line(output)


def agent_command_task(command: str, args: Mapping[str, str], load_task: Any) -> AgentTask:
    """The task of ``--task agent-cmd:COMMAND`` (``args``: see the module's docstring)."""
    rest = dict(args)
    problems_spec = rest.pop("problems", "arithmetic")
    timeout: float | None = None
    if "timeout" in rest:
        try:
            timeout = float(rest.pop("timeout"))
        except ValueError:
            raise ConfigError("agent-cmd: timeout must be a number of seconds") from None
    problems = load_task(problems_spec, rest)
    try:
        argv = shlex.split(command)
    except ValueError as exc:
        raise ConfigError(f"agent-cmd: cannot split the command {command!r} ({exc})") from None
    task = AgentTask(
        AgentCommand(argv),
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
