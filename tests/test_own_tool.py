"""A user's own tool is learned on the packaged agent model: ``subtract``
(examples/subtract_tool.py), which no shipped example uses and the model's synthetic
tool conversations never name, is read from the schema the chat template lists, called
now and then by the base model, and called more after a short seeded RL run on the local
server (calls per episode, the first steps against the last)."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from engine.local import LocalServer
from engine.local.config import AGENT_MODEL_DIR
from examples.subtract_tool import SubtractTask, subtract
from scripts import make_model, tool_data
from tests.engine_support import run_engine, small_config

STEPS = 12
WINDOW = 3


def test_the_unseen_tool_is_never_in_the_models_training_conversations() -> None:
    assert make_model.UNSEEN_TOOL.name == subtract.name in tool_data.HELD_OUT
    assert make_model.UNSEEN_TOOL.parameters == subtract.parameters
    assert make_model.UNSEEN_TOOL.description == subtract.description


@pytest.mark.slow
def test_a_users_own_tool_gets_called_more_as_it_trains(tmp_path: Path) -> None:
    with LocalServer(AGENT_MODEL_DIR) as server:
        config = small_config(
            server,
            tmp_path / "run",
            steps=STEPS,
            batch=8,
            group=6,
            max_tokens=96,
            temperature=0.8,
            learning_rate=2e-3,
            lora_rank=8,
            seed=0,
        )
        steps, result = run_engine(config, task=SubtractTask())
    assert result.steps_completed == STEPS
    calls = [s.metrics["env/all/tool_calls"] for s in steps]
    first = statistics.mean(calls[:WINDOW])
    last = statistics.mean(calls[-WINDOW:])
    assert first > 0, "the base model never called the tool"
    assert last >= first + 0.3, calls
    episodes = [e for s in steps[-WINDOW:] for g in s.groups for e in g.trajectories]
    called = [t.logs["tool_calls"] for e in episodes for t in e.turns if t.logs.get("tool_calls")]
    assert called and all(c[0]["name"] == "subtract" for c in called)
