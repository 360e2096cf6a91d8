"""Agent processes (``--task agent-cmd:...``) on a scripted sampler: the shipped example
process trains as an agent function does; one that exits non-zero or hangs ends its
episode as configured, and no process it started is left running."""

from __future__ import annotations

import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
from agent_support import AltSampler, agent_context, calculator_reply

from engine.agents.process import AgentCommand
from engine.agents.task import AgentTask
from engine.catalog import load_task
from engine.envs.rollout import EpisodeRunner
from engine.errors import ConfigError
from engine.tasks import ArithmeticTask, Problem

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parents[1]
PROBLEM = Problem(0, "What is 6 * 7?", 42)


async def run(argv: list[str], replies: Any, **limits: Any) -> Any:
    context = agent_context(**limits)
    task = AgentTask(AgentCommand(argv), ArithmeticTask())
    runner = EpisodeRunner(AltSampler(replies), context.limits)
    return await runner.run_group(task.group_builder(PROBLEM, 2, context), PROBLEM)


async def test_the_example_process_is_an_agent_trained_like_any_other() -> None:
    script = str(ROOT / "examples" / "agent_process.py")
    rollout = await run([sys.executable, script], calculator_reply)
    assert rollout.error is None
    for episode in rollout.trajectories:
        assert episode.outcome == "done" and episode.total_reward == 1.0
        assert [bool(t.logs.get("tool_calls")) for t in episode.turns] == [True, False]


def spawns_a_child(pids: Path) -> str:
    """A script's first lines: start a child that outlives it and record both pids (before
    importing openai, so that even a loaded machine records them well within a timeout)."""
    return (
        "import os, subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        f"open({str(pids)!r}, 'a').write(f'{{os.getpid()}} {{child.pid}}\\n')\n"
        "import openai\n"
    )


def started(pids: Path) -> list[int]:
    return [int(p) for line in pids.read_text().split("\n") if line for p in line.split()]


async def test_a_process_that_exits_non_zero_ends_its_episode_as_an_agent_error(
    tmp_path: Path,
) -> None:
    pids = tmp_path / "pids"
    script = tmp_path / "fails.py"
    script.write_text(
        spawns_a_child(pids) + "openai.OpenAI().completions.create(model='m', prompt='x')\n"
        "print('broken', file=sys.stderr); sys.exit(3)\n"
    )
    rollout = await run([sys.executable, str(script)], ["41"], on_limit="mask")
    for episode in rollout.trajectories:
        assert episode.outcome == "env_error" and episode.masked
        assert "status 3: broken" in (episode.error or "")
    assert len(started(pids)) == 4  # two processes, each with a child it left behind
    for pid in started(pids):
        assert not _alive(pid), f"process {pid} was left running"


async def test_a_process_without_a_reward_line_ends_its_episode_as_an_agent_error(
    tmp_path: Path,
) -> None:
    script = tmp_path / "silent.py"
    script.write_text(
        "import openai\n"
        "openai.OpenAI().completions.create(model='m', prompt='x')\n"
        "print('done, no reward')\n"
    )
    rollout = await run([sys.executable, str(script)], ["41"])
    for episode in rollout.trajectories:
        assert episode.outcome == "env_error" and episode.zeroed
        assert '{"reward": <number>}' in (episode.error or "")


@pytest.mark.parametrize("reward", ["NaN", "Infinity", "-Infinity"])
async def test_a_non_finite_reward_line_ends_its_episode_as_an_agent_error(
    tmp_path: Path, reward: str
) -> None:
    script = tmp_path / "poisoned.py"
    script.write_text(
        "import openai\n"
        "openai.OpenAI().completions.create(model='m', prompt='x')\n"
        f"print('{{\"reward\": {reward}}}')\n"
    )
    rollout = await run([sys.executable, str(script)], ["41"])
    for episode in rollout.trajectories:
        assert episode.outcome == "env_error" and episode.zeroed
        assert "non-finite" in (episode.error or "")


async def test_a_hanging_process_is_killed_with_its_children_at_the_timeout(
    tmp_path: Path,
) -> None:
    pids = tmp_path / "pids"
    script = tmp_path / "hangs.py"
    script.write_text(
        spawns_a_child(pids) + "openai.OpenAI().completions.create(model='m', prompt='x')\n"
        "time.sleep(600)\n"
    )
    rollout = await run([sys.executable, str(script)], ["41"], episode_timeout=20.0)
    for episode in rollout.trajectories:
        assert episode.outcome in ("timeout", "env_error") and episode.zeroed
    assert len(started(pids)) == 4  # two processes, each with a child
    for pid in started(pids):
        assert not _alive(pid), f"process {pid} was left running"


async def test_a_stop_mid_call_kills_the_processes_and_their_children(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    script = tmp_path / "waits.py"
    script.write_text(
        spawns_a_child(pids) + "openai.OpenAI().completions.create(model='m', prompt='x')\n"
    )
    in_call = anyio.Event()

    class Stalled(AltSampler):
        async def __call__(self, observation: Any, n: int, room: Any, **where: int) -> Any:
            if len(started(pids)) == 4:  # (each process records its pids before its call)
                in_call.set()
            await anyio.sleep_forever()

    context = agent_context()
    task = AgentTask(AgentCommand([sys.executable, str(script)]), ArithmeticTask())
    runner = EpisodeRunner(Stalled(["41"]), context.limits)
    async with anyio.create_task_group() as tg:
        tg.start_soon(runner.run_group, task.group_builder(PROBLEM, 2, context), PROBLEM)
        with anyio.fail_after(120):
            await in_call.wait()
        tg.cancel_scope.cancel()  # a stop while both processes wait for their replies
    for pid in started(pids):
        assert not _alive(pid), f"process {pid} was left running"


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie awaiting its parent's wait counts as gone)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        status = Path(f"/proc/{pid}/stat")
        if status.exists() and status.read_text().split(")")[-1].split()[0] == "Z":
            return False
        time.sleep(0.05)
    return True


def test_agent_cmd_is_a_task_spec_with_its_own_arguments() -> None:
    python = shlex.quote(sys.executable)
    task = load_task(f"agent-cmd:{python} agent.py --fast", {"op": "*", "timeout": "30"})
    assert isinstance(task, AgentTask) and task.timeout == 30.0
    assert task.agent.argv == [sys.executable, "agent.py", "--fast"]  # type: ignore[attr-defined]
    assert task.source(0).next() is not None


@pytest.mark.parametrize(
    ("command", "reason"),
    [
        ("/no/such/agent --fast", "'/no/such/agent': not an executable file"),
        ("engine-no-such-program", "'engine-no-such-program': not found on PATH"),
    ],
)
def test_a_command_that_cannot_run_is_one_line_before_the_run(command: str, reason: str) -> None:
    """Refused when the task is loaded, not as every episode's failure once the run began."""
    with pytest.raises(ConfigError) as error:
        load_task(f"agent-cmd:{command}")
    assert str(error.value) == f"agent-cmd: cannot run {reason}"
