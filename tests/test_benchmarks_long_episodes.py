"""The heavy-tailed agent workload benchmark: its draws, its episodes (native and
``openai`` agent) and the figures it derives from a run's steps, and one tiny end-to-end
run against a real local server (no assertion on speed)."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import pytest

from benchmarks import episode_runs, long_episodes
from engine.core.problems import Problem, RewardBreakdown
from engine.core.state import ScoredGroup
from engine.core.trajectory import Trajectory, Turn

PROBLEM = Problem(7, "What is 12 + 34?", 46)


def test_turns_and_tool_waits_are_heavy_tailed_and_seeded() -> None:
    draws = [long_episodes.draw_episode(p, i, 1.0) for p in range(1000) for i in range(4)]
    turns = sorted(t for t, _ in draws)
    waits = sorted(w for _, ws in draws for w in ws.values())
    assert statistics.median(turns) == 3
    assert turns[int(0.99 * len(turns))] >= 30
    assert waits[int(0.99 * len(waits))] >= 10 * statistics.median(waits)
    assert long_episodes.draw_episode(5, 1, 0.5) == long_episodes.draw_episode(5, 1, 0.5)
    assert all(set(ws) == set(range(1, t)) for t, ws in draws)  # a tool after all but the last


def test_a_scripted_episode_ends_its_record_where_the_turn_limit_cuts_it() -> None:
    log: list[episode_runs.EpisodeLog] = []
    env = episode_runs.ScriptedEnv(PROBLEM, 5, {}, log, cap=3, key="7:0")

    async def play() -> list[bool]:
        await env.initial_messages()
        done = []
        for turn in range(1, 6):
            step = await env.respond([{"role": "assistant", "content": "46"}])
            done.append(step.done)
            assert (log[0].end is not None) == (turn >= 3)
        return done

    assert anyio.run(play) == [False, False, False, False, True]
    assert log[0].key == "7:0" and len(log[0].sampling) == 5


class _Completions:
    def __init__(self) -> None:
        self.calls: list[list[dict[str, str]]] = []

    async def create(self, *, model: str, messages: Any, max_tokens: int) -> Any:
        self.calls.append(list(messages))
        message = SimpleNamespace(content="46")
        return SimpleNamespace(choices=[SimpleNamespace(message=message)])


class _Client:
    """An ``openai.AsyncOpenAI`` as far as the agent uses one."""

    def __init__(self) -> None:
        self.chat = SimpleNamespace(completions=_Completions())
        self.options: dict[str, Any] = {}

    def with_options(self, **options: Any) -> _Client:
        self.options = options
        return self


def test_the_openai_agent_plays_its_drawn_episodes_in_start_order() -> None:
    agent = long_episodes.LongAgent(cycle_s=1e-9)  # the tool's waits: nanoseconds
    clients = [_Client(), _Client()]

    async def play() -> list[float]:
        return [await agent(client, PROBLEM) for client in clients]

    assert anyio.run(play) == [1.0, 1.0]  # the first reply is the sum
    for index, client in enumerate(clients):
        turns, _ = long_episodes.draw_episode(PROBLEM.id, index, 1e-9)
        calls = client.chat.completions.calls
        assert len(calls) == turns and client.options == {"max_retries": 0}
        assert calls[-1][-1]["role"] == "user" and len(calls[-1]) == 2 * turns - 1
    assert [e.key for e in agent.log] == ["7:0", "7:1"]
    assert all(e.end is not None for e in agent.log)


def _trajectory(reward: float, versions: tuple[int, ...], outcome: Any = "done") -> Trajectory:
    turns = tuple(Turn((1, 2), (3, 4, 5), None, v, "stop") for v in versions)
    return Trajectory(turns, outcome=outcome, group_reward=RewardBreakdown(reward))


def test_staleness_and_volumes_count_turns_trajectories_and_tied_groups() -> None:
    signal = ScoredGroup(
        2, 0, PROBLEM, 1, (_trajectory(1.0, (1, 2)), _trajectory(0.0, (2,), "max_turns"))
    )
    # Drawn for step 1, trained in step 3 (0-based 2: completion order): 0 steps behind.
    tied = ScoredGroup(1, 1, PROBLEM, 2, (_trajectory(0.5, (2,)), _trajectory(0.5, (2,))))
    results: Any = [SimpleNamespace(step=3, groups=(signal, tied))]
    assert episode_runs.staleness(results) == {
        "per_turn": {"0": 4, "1": 1},
        "per_trajectory": {"0": 3, "1": 1},
    }
    got = episode_runs.volumes(results, started=5)
    assert (got["episodes_scored"], got["episodes_trained"]) == (4, 2)
    assert (got["discarded"], got["unscored"]) == (3, 1)
    assert got["outcomes"] == {"done": 3, "max_turns": 1}
    assert (got["tokens_sampled"], got["tokens_trained"]) == (15, 9)
    assert got["sampled_per_trained_token"] == pytest.approx(15 / 9)


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--steps", "2"], ["--latency", "off"], ["--configs", "k9"]):
        with pytest.raises(SystemExit) as stopped:
            long_episodes.main(argv)
        assert stopped.value.code == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 3 and all("error:" in line for line in errors)


@pytest.mark.slow
def test_long_episodes_quick_run_writes_results(tmp_path: Path) -> None:
    argv = ["--quick", "--batch", "2", "--configs", "sync", "default", "--out", str(tmp_path)]
    long_episodes.main(argv)
    data = json.loads((tmp_path / "long_episodes.json").read_text())
    rows = data["rows"]
    assert [(r["agent"], r["config"]) for r in rows] == [
        (agent, config) for agent in long_episodes.AGENTS for config in ("sync", "default")
    ]
    for row in rows:
        assert math.isfinite(row["steps_per_s"]) and row["steps_per_s"] > 0
        assert 0 <= row["busy_share"] <= 1 and 0 <= row["straggler_share"] <= 1
        assert row["episodes_started"] == 3 * 2 * 2 and row["unscored"] == 0
        assert 0 <= row["discarded"] <= row["episodes_started"]
        stale = row["staleness"]["per_turn"]
        assert sum(stale.values()) == row["turns"]
        assert max(int(k) for k in stale) <= (0 if row["config"] == "sync" else 1)
    assert [r["x_sync"] for r in rows if r["config"] == "sync"] == [1.0, 1.0]
    assert "batch-synchronous" in (tmp_path / "long_episodes.md").read_text()
    assert (tmp_path / "long_episodes.png").stat().st_size > 0
