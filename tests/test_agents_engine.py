"""The shipped agent, written only against the ``openai`` SDK
(examples/openai_calculator_agent.py), trains through the Engine on the real local server
(the packaged agent model): every call is a captured turn with its own sampler version,
datums come from the sampled tokens, and the K bound holds per call."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine import rollouts
from engine.basemodels.catalogue import AGENT_MODEL_DIR
from engine.core.datums import trajectory_datums
from engine.local import LocalServer
from engine.rundir.rollout_log import ROLLOUTS_FILE
from examples.openai_calculator_agent import task
from tests.engine_support import run_engine, small_config


@pytest.fixture(scope="module")
def server() -> Iterator[LocalServer]:
    with LocalServer(AGENT_MODEL_DIR) as s:
        yield s


def test_an_openai_sdk_agent_trains_end_to_end_with_each_call_a_turn(
    server: LocalServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = small_config(
        server,
        tmp_path / "run",
        steps=2,
        batch=2,
        group=4,
        max_tokens=96,
        max_steps_off_policy=0,
        episode_timeout=120.0,
    )
    steps, result = run_engine(config, task=task())
    assert result.steps_completed == 2
    episodes = [(s.step, e) for s in steps for g in s.groups for e in g.trajectories]
    assert len(episodes) == 2 * 2 * 4
    tool_turns = 0
    for step, e in episodes:
        assert e.outcome in ("done", "parse_error"), e.error  # (a malformed tool call)
        assert {t.version for t in e.turns} == {step - 1}  # K = 0, for every call
        for before, after in zip(e.turns, e.turns[1:], strict=False):
            prefix = (*before.observation, *before.action)
            assert after.observation[: len(prefix)] == prefix
            assert before.metrics["agent/history_rewrites"] == 0.0
        assert len(trajectory_datums(e, 1.0)) == 1
        tool_turns += sum(1 for t in e.turns if t.logs.get("tool_calls"))
    assert tool_turns > 0, "the agent model called no tool"
    assert sum(s.metrics.get("env/all/tool_calls", 0.0) for s in steps) > 0  # (report panel)
    assert all(s.metrics.get("env/all/agent/history_rewrites", 0.0) == 0.0 for s in steps)
    logged = [
        json.loads(line) for line in (tmp_path / "run" / ROLLOUTS_FILE).read_text().splitlines()
    ]
    turns = [t for r in logged for e in r["episodes"] for t in e["turns"]]
    assert any(t.get("logs", {}).get("tool_calls") for t in turns)
    # engine.rollouts prints each call turn by turn: its version, the tool calls and the
    # results the agent answered them with in its next call.
    capsys.readouterr()
    assert rollouts.main([str(tmp_path / "run")]) == 0
    printed = capsys.readouterr().out
    assert "turn 0 (v1) new context" in printed
    assert re.search(r"turn 1 \(v[01]\) appended", printed)
    assert re.search(r"tool multiply\(\{.*\}\) -> \['[^']*'\]", printed), printed[-3000:]


@pytest.mark.slow
def test_the_example_agent_process_trains_end_to_end(server: LocalServer, tmp_path: Path) -> None:
    """``--task agent-cmd:python examples/agent_process.py`` (docs/agents.md): a process per
    episode, the real ``openai`` client over loopback HTTP, on the real local server."""
    script = Path(__file__).resolve().parents[1] / "examples" / "agent_process.py"
    config = small_config(
        server,
        tmp_path / "run",
        task=f"agent-cmd:{sys.executable} {script}",
        task_args={"op": "*", "min_operand": "10", "max_operand": "99"},
        steps=2,
        batch=2,
        group=2,
        max_tokens=96,
        max_steps_off_policy=0,
        episode_timeout=600.0,
    )
    steps, result = run_engine(config)
    assert result.steps_completed == 2
    episodes = [(s.step, e) for s in steps for g in s.groups for e in g.trajectories]
    assert len(episodes) == 2 * 2 * 2
    # (a malformed tool call: a parse error, or the script's own json error: env_error)
    assert sum(e.outcome == "done" for _, e in episodes) >= len(episodes) // 2
    for step, e in episodes:
        assert {t.version for t in e.turns} == {step - 1}
        for before, after in zip(e.turns, e.turns[1:], strict=False):
            prefix = (*before.observation, *before.action)
            assert after.observation[: len(prefix)] == prefix
