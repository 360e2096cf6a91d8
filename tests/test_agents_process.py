"""Agent processes (``--task agent-cmd:...``) on a scripted sampler: the shipped example
process trains as an agent function does; one that exits non-zero or hangs ends its
episode as configured, and no process it started is left running."""

from __future__ import annotations

import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import pytest
from agent_support import AltSampler, agent_context, calculator_reply

from engine.agents.episodes import AgentError
from engine.agents.process import OUTPUT_LINES, PASSED_ENVIRONMENT, AgentCommand
from engine.agents.task import AgentTask
from engine.catalog import load_task
from engine.envs.rollout import EpisodeRunner
from engine.envs.scoring import RewardError
from engine.errors import ConfigError, format_error
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
    """A script's first lines: start a child that outlives it, in a session of its own
    (out of the process's group) and holding its output pipes, and record both pids
    (before importing openai, so that even a loaded machine records them well within a
    timeout)."""
    return (
        "import os, subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'],\n"
        "                         start_new_session=True)\n"
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


def _alive(pid: int, within: float = 10) -> bool:
    """True while ``pid`` runs for ``within`` seconds (a zombie awaiting its parent's wait
    counts as gone)."""
    deadline = time.monotonic() + within
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


CLIENT = SimpleNamespace(base_url="http://127.0.0.1:9/e/x/v1", api_key="sk-engine-episode")
"""What an agent process is given of its client (no call is made: it scores itself)."""


async def call(agent: AgentCommand, problem: Problem = PROBLEM) -> Any:
    with anyio.fail_after(120):  # a hang guard: each run here takes a second or so
        return await agent(CLIENT, problem)


def script(tmp_path: Path, body: str) -> list[str]:
    path = tmp_path / "agent.py"
    path.write_text("import json, os, subprocess, sys, time\n" + body)
    return [sys.executable, str(path)]


async def test_an_agent_process_gets_an_allow_listed_environment_never_a_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secrets = (
        "MINT_API_KEY",
        "TINKER_API_KEY",
        "WANDB_API_KEY",
        "HF_TOKEN",
        "ENGINE_SERVE_API_KEY",
    )
    for name in (*secrets, "UNRELATED_SETTING", "MY_TOOL_KEY"):
        monkeypatch.setenv(name, f"secret-{name}")
    monkeypatch.setenv("LC_ALL", "C.UTF-8")
    dump = tmp_path / "env.json"
    argv = script(
        tmp_path,
        f"open({str(dump)!r}, 'w').write(json.dumps(dict(os.environ)))\n"
        "print(json.dumps({'reward': 1}))\n",
    )
    assert (await call(AgentCommand(argv, env=["MY_TOOL_KEY"]))).reward == 1.0
    env = json.loads(dump.read_text())
    assert not set(env) & {*secrets, "UNRELATED_SETTING"}
    assert not any(
        value.startswith("secret-") for name, value in env.items() if name != "MY_TOOL_KEY"
    )
    assert env["MY_TOOL_KEY"] == "secret-MY_TOOL_KEY"  # passed because the task named it
    assert env["LC_ALL"] == "C.UTF-8" and env["PATH"] == os.environ["PATH"]
    assert env["OPENAI_BASE_URL"] == CLIENT.base_url and env["OPENAI_API_KEY"] == CLIENT.api_key
    engine_set = {"OPENAI_BASE_URL", "OPENAI_API_KEY", "ENGINE_PROBLEM", "ENGINE_PROBLEM_FILE"}
    allowed = {*PASSED_ENVIRONMENT, *engine_set, "MY_TOOL_KEY"}
    assert all(name in allowed or name.startswith("LC_") for name in env), sorted(env)


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("OPENAI_API_KEY", "'OPENAI_API_KEY': the engine sets it"),
        ("A B", "'A B': not a variable name"),
    ],
)
def test_env_names_only_variables_the_engine_does_not_set(value: str, reason: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_task(f"agent-cmd:{shlex.quote(sys.executable)} agent.py", {"env": value})
    assert str(error.value) == f"agent-cmd: env cannot pass {reason}"


@pytest.mark.parametrize("size", [100, 300_000])
async def test_the_problem_is_in_a_private_file_and_in_the_environment_when_small(
    tmp_path: Path, size: int
) -> None:
    """A problem over Linux's 128 KiB per variable could not start a process (E2BIG)."""
    seen = tmp_path / "seen.json"
    argv = script(
        tmp_path,
        "path = os.environ['ENGINE_PROBLEM_FILE']\n"
        "seen = {'file': open(path).read(), 'env': os.environ.get('ENGINE_PROBLEM'),\n"
        "        'path': path, 'mode': os.stat(os.path.dirname(path)).st_mode & 0o777}\n"
        f"open({str(seen)!r}, 'w').write(json.dumps(seen))\n"
        "print(json.dumps({'reward': 1}))\n",
    )
    problem = Problem(3, "x" * size, 7, {"k": "v"})
    assert (await call(AgentCommand(argv), problem)).reward == 1.0
    record = json.loads(seen.read_text())
    expected = {"id": 3, "question": "x" * size, "answer": 7, "data": {"k": "v"}}
    assert json.loads(record["file"]) == expected
    assert record["env"] == (record["file"] if size < 1000 else None)
    assert record["mode"] == 0o700  # a directory of the episode's own
    assert not Path(record["path"]).parent.exists()  # removed with the episode


def test_a_huge_problems_error_line_keeps_its_cause() -> None:
    problem = Problem(0, "y" * 300_000, 1)
    cause = AgentError("the agent ended before its first call (the real cause)")
    line = format_error(RewardError(problem, cause))
    assert line.endswith("(the real cause)") and len(line) < 600


@pytest.mark.parametrize("keeps_pipe", [True, False])
async def test_a_detached_descendant_neither_holds_nor_outlives_the_episode(
    tmp_path: Path, keeps_pipe: bool
) -> None:
    """A helper in a session of its own (setsid), with or without the output pipe: the
    episode ends (no timeout is set) and the helper with it."""
    pids = tmp_path / "pids"
    out = "None" if keeps_pipe else "subprocess.DEVNULL"
    argv = script(
        tmp_path,
        "helper = subprocess.Popen(['sleep', '600'], start_new_session=True,\n"
        f"                          stdout={out}, stderr={out})\n"
        f"open({str(pids)!r}, 'w').write(str(helper.pid))\n"
        "print(json.dumps({'reward': 1}))\n",
    )
    assert (await call(AgentCommand(argv))).reward == 1.0
    assert not _alive(int(pids.read_text())), "the detached helper was left running"


def test_an_engine_killed_with_sigkill_leaves_no_agent_process(tmp_path: Path) -> None:
    """The agent and a helper it started in a session of its own end when the engine
    running them is SIGKILLed (no cleanup of the engine's can run)."""
    pids = tmp_path / "pids"
    agent = script(
        tmp_path,
        "helper = subprocess.Popen(['sleep', '600'], start_new_session=True)\n"
        f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{helper.pid}}')\n"
        "time.sleep(600)\n",
    )
    engine = tmp_path / "host.py"  # (not engine.py: that would shadow the package)
    engine.write_text(
        "import sys, types, anyio\n"
        "from engine.agents.process import AgentCommand\n"
        "from engine.tasks import Problem\n"
        f"client = types.SimpleNamespace(base_url='http://127.0.0.1:9/v1', api_key='k')\n"
        f"anyio.run(AgentCommand({agent!r}), client, Problem(0, 'q', 1))\n"
    )
    parent = subprocess.Popen(
        [sys.executable, str(engine)], env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    try:
        deadline = time.monotonic() + 120  # a hang guard: the agent starts in seconds
        while not (pids.exists() and len(pids.read_text().split()) == 2):
            assert parent.poll() is None and time.monotonic() < deadline, "the agent never started"
            time.sleep(0.1)
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    for pid in map(int, pids.read_text().split()):
        assert not _alive(pid, within=60), f"process {pid} outlived the engine"


async def test_a_failed_process_keeps_its_last_output_lines_with_its_episode(
    tmp_path: Path,
) -> None:
    script_path = tmp_path / "chatty.py"
    script_path.write_text(
        "import sys, openai\n"
        "openai.OpenAI().completions.create(model='m', prompt='x')\n"
        "for i in range(100):\n"
        "    print(f'out {i}'); print(f'err {i}', file=sys.stderr)\n"
    )
    rollout = await run([sys.executable, str(script_path)], ["41"])
    for episode in rollout.trajectories:
        assert episode.outcome == "env_error"
        logs = episode.turns[-1].logs
        assert logs["agent_stdout"] == [f"out {i}" for i in range(100 - OUTPUT_LINES, 100)]
        assert logs["agent_stderr"][-1] == "err 99" and len(logs["agent_stderr"]) == OUTPUT_LINES
        assert logs["assistant"] == "41" and "reward" in logs["error"]


@pytest.mark.parametrize("value", ["nan", "-1", "inf", "-inf", "soon"])
def test_a_timeout_that_is_not_seconds_is_one_line(value: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_task(f"agent-cmd:{shlex.quote(sys.executable)} a.py", {"timeout": value})
    assert str(error.value) == (
        f"agent-cmd: timeout must be a number of seconds >= 0 (0: no limit), got {value!r}"
    )


def test_a_timeout_of_0_is_no_limit_as_for_the_episode_timeout() -> None:
    task = load_task(f"agent-cmd:{shlex.quote(sys.executable)} a.py", {"timeout": "0"})
    assert isinstance(task, AgentTask) and task.timeout == math.inf
