"""A multi-turn environment end to end: the example's two-attempt addition episodes
(examples/retry_addition.py) trained through the Engine against the real local server,
with the served chat template rendering each turn."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.core.datums import trajectory_datums
from engine.local import LocalServer
from engine.rundir.rollout_log import ROLLOUTS_FILE
from examples.retry_addition import RetryAdditionTask
from tests.engine_support import run_engine, small_config


@pytest.fixture(scope="module")
def server() -> Iterator[LocalServer]:
    with LocalServer() as s:
        yield s


def test_a_multi_turn_environment_trains_end_to_end(server: LocalServer, tmp_path: Path) -> None:
    config = small_config(server, tmp_path / "run", steps=3, stop_at_eos=True, max_tokens=8)
    steps, result = run_engine(config, task=RetryAdditionTask())

    assert result.steps_completed == 3
    assert result.final_path is not None and result.final_path.startswith("tinker://")
    episodes = [e for s in steps for g in s.groups for e in g.trajectories]
    assert len(episodes) == 3 * 4 * 4
    assert {len(e.turns) for e in episodes} <= {1, 2}
    assert any(len(e.turns) == 2 for e in episodes), "no episode took a second attempt"
    extended = []
    for e in episodes:
        # A second attempt whose context extends the first turn's (observation plus the
        # action as sampled) merges into one datum; one whose re-rendered reply differs
        # from the sampled tokens (a reply cut by --max-tokens, stripped whitespace)
        # starts a second datum. Nothing is re-rendered into a datum either way.
        datums = trajectory_datums(e, 1.0)
        if len(e.turns) == 1:
            assert len(datums) == 1
            continue
        first, second = e.turns
        prefix = (*first.observation, *first.action)
        extends = second.observation[: len(prefix)] == prefix
        assert len(datums) == (1 if extends else 2)
        extended.append(extends)
    assert any(extended), "no second attempt extended the first turn's context"
    for s in steps:
        assert 1 <= s.metrics["env/all/turns_per_episode"] <= 2
        assert s.staleness <= 1
    assert sum(s.metrics["datums"] for s in steps) > 0, "nothing was trained"
    logged = [
        json.loads(line) for line in (tmp_path / "run" / ROLLOUTS_FILE).read_text().splitlines()
    ]
    assert logged and all("episodes" in r for r in logged)
