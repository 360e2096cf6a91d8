"""The red-team attacks that held (#45): each stays a test, so it keeps holding.

- Shell injection in ``agent-cmd`` (``; touch PWNED``, ``$(...)``, backticks in the
  command or the problem) does nothing: the command is split with ``shlex`` and started
  without a shell. :func:`test_shell_syntax_in_agent_cmd_or_a_problem_runs_nothing`.
- 200 MB of agent output is bounded: only its tail is kept, the episode ends cleanly,
  and a failed episode keeps a few short lines.
  :func:`test_200_mb_of_agent_output_is_bounded`.
- With a key set (``engine.serve --api-key``, the capture endpoint's per-episode keys),
  a keyless connection declaring a large body is refused with a 401 before its body is
  read. :func:`test_a_keyless_call_is_refused_before_its_body_is_read`.
- The endpoint answers malformed requests with OpenAI-format 400s and bounds
  concurrency: ``tests/test_agents_endpoint.py``,
  ``test_each_error_has_its_status_in_openais_format``,
  ``test_calls_over_the_concurrency_bound_get_a_429``,
  ``test_slow_bodies_hold_no_slot_a_valid_call_is_answered`` and
  ``test_a_late_body_gets_a_408_and_late_headers_close_the_connection``.
- kill -9 then resume: ``tests/test_reliability_cli.py``,
  ``test_kill_9_then_resume_trains_the_requested_steps_on_the_same_problems``.
"""

from __future__ import annotations

import json
import shlex
import sys
import tracemalloc
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import pytest
from agent_support import AltSampler, agent_context

from engine.agents import EndpointLimits, Episode, serve_endpoint
from engine.agents.chat import ChatFormat
from engine.agents.process import OUTPUT_LIMIT, OUTPUT_LINES, AgentCommand
from engine.agents.task import AgentTask, _GroupBackend
from engine.catalog import load_task
from engine.envs.rollout import EpisodeRunner
from engine.tasks import ArithmeticTask, Problem

pytestmark = pytest.mark.anyio

CALL_AND_REWARD = (
    "import openai\n"
    "openai.OpenAI().completions.create(model='m', prompt='x')\n"
    "print(json.dumps({'reward': 1.0}))\n"
)
PROBLEM = Problem(0, "What is 6 * 7?", 42)


async def run_group(task: AgentTask, problem: Problem) -> Any:
    context = agent_context()
    runner = EpisodeRunner(AltSampler(["41"]), context.limits)
    return await runner.run_group(task.group_builder(problem, 2, context), problem)


async def test_shell_syntax_in_agent_cmd_or_a_problem_runs_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    pwned = tmp_path / "PWNED"
    seen = tmp_path / "seen"
    script = tmp_path / "agent.py"
    script.write_text(
        "import json, os, sys\n"
        "record = [sys.argv[1:], os.environ['ENGINE_PROBLEM']]\n"
        f"open({str(seen)!r}, 'a').write(json.dumps(record) + '\\n')\n" + CALL_AND_REWARD
    )
    touch = f"touch {shlex.quote(str(pwned))}"
    command = f"{shlex.quote(sys.executable)} agent.py ; {touch} && $({touch}) `{touch}` | {touch}"
    task = load_task(f"agent-cmd:{command}", {})
    assert isinstance(task, AgentTask)
    question = f"What is 6 * 7? $({touch}) `{touch}`; {touch}"
    rollout = await run_group(task, Problem(0, question, 42))
    assert rollout.error is None
    assert [e.outcome for e in rollout.trajectories] == ["done", "done"]
    assert not pwned.exists()
    for line in seen.read_text().splitlines():  # the words reached it as plain arguments
        argv, problem = json.loads(line)
        assert argv == shlex.split(command)[2:] and ";" in argv and "&&" in argv
        assert json.loads(problem)["question"] == question


async def test_200_mb_of_agent_output_is_bounded(tmp_path: Path) -> None:
    """Two runs of two episodes each write 25 MB to stdout and to stderr (200 MB): the
    engine keeps the last :data:`OUTPUT_LIMIT` bytes of each (its memory stays far under
    what was written), reads the reward line after the flood, and a failed episode keeps
    a few short lines."""
    megabytes = 25
    flood = (
        "import json, sys\n"
        "line = b'x' * ((1 << 20) - 1) + b'\\n'\n"
        f"for _ in range({megabytes}):\n"
        "    sys.stdout.buffer.write(line); sys.stderr.buffer.write(line)\n"
        "sys.stdout.flush()\n"
    )
    good, bad = tmp_path / "good.py", tmp_path / "bad.py"
    good.write_text(flood + CALL_AND_REWARD)
    bad.write_text(flood + CALL_AND_REWARD.replace("print", "sys.exit(1)  #"))
    tracemalloc.start()
    try:
        ok, failed = [
            await run_group(
                AgentTask(AgentCommand([sys.executable, str(script)]), ArithmeticTask()), PROBLEM
            )
            for script in (good, bad)
        ]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    written = 2 * 2 * 2 * megabytes << 20  # two runs, two episodes, two streams
    assert peak < 256 * OUTPUT_LIMIT < written // 8, (peak, written)
    assert [(e.outcome, e.total_reward) for e in ok.trajectories] == [("done", 1.0)] * 2
    for episode in failed.trajectories:
        assert episode.outcome == "env_error" and "status 1" in (episode.error or "")
        logs = episode.turns[-1].logs
        for kept in (logs["agent_stdout"], logs["agent_stderr"]):
            assert 0 < len(kept) <= OUTPUT_LINES and all(len(line) <= 500 for line in kept)


def _head(path: str, key: str | None, body_size: int) -> bytes:
    """A completion request's head announcing ``body_size`` bytes of body."""
    auth = f"authorization: Bearer {key}\r\n" if key else ""
    return (
        f"POST {path} HTTP/1.1\r\nhost: x\r\n{auth}content-type: application/json\r\n"
        f"content-length: {body_size}\r\n\r\n"
    ).encode()


def _serve_backend() -> Any:
    """``engine.serve``'s backend with ``--api-key`` (no sampler: nothing is
    sampled here)."""
    from transformers import AutoTokenizer

    from engine.basemodels.catalogue import DEFAULT_MODEL_DIR
    from engine.serve import SessionBackend

    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    session = SimpleNamespace(tokenizer=tokenizer, info=SimpleNamespace(max_context=256))
    return SessionBackend(session, None, model="m", max_tokens=8, api_key=RIGHT)  # type: ignore[arg-type]


RIGHT = "sk-right"


@pytest.mark.parametrize("surface", ["engine.serve", "capture endpoint"])
@pytest.mark.parametrize(
    ("key", "body_size", "status"),
    [
        (None, 100_000_000, 401),
        (None, 1_000_000, 401),
        ("sk-wrong", 1_000_000, 401),
        (RIGHT, 100_000_000, 413),  # the control: the key passes, the size is refused
    ],
)
async def test_a_keyless_call_is_refused_before_its_body_is_read(
    surface: str, key: str | None, body_size: int, status: int
) -> None:
    """No body is ever sent: a 401 means the key was checked before the body was read
    (reading it would wait out a body deadline of an hour, past the hang guard), and
    before the body's size (100 MB is over the 8 MiB bound: a 413 with the right key)."""
    if surface == "engine.serve":
        backend, path = _serve_backend(), "/v1/completions"
    else:
        context = agent_context()
        episode = Episode("ep-0", ChatFormat(context.task), context)
        backend, path = (
            _GroupBackend({"ep-0": episode}, {"ep-0": RIGHT}),
            "/e/ep-0/v1/completions",
        )
    limits = EndpointLimits(body_timeout_s=3600)
    async with serve_endpoint(backend, limits=limits) as endpoint:
        host, port = endpoint.base_url.removeprefix("http://").removesuffix("/v1").split(":")
        with anyio.fail_after(60):  # a hang guard
            async with await anyio.connect_tcp(host, int(port)) as stream:
                await stream.send(_head(path, key, body_size))
                reply = b""
                while b"}}" not in reply:  # the whole JSON error
                    reply += await stream.receive()
        assert endpoint.in_flight == 0
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/1.1 {status} ".encode()), reply
    kind = "authentication_error" if status == 401 else "invalid_request_error"
    assert json.loads(body)["error"]["type"] == kind, body
