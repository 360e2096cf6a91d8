"""Environment tasks on a Ray cluster (``--score-workers ray:N``): a local cluster the
engine starts (and shuts down) itself, a cluster the caller started (left running), a
shipped environment trained end to end through one against the local server, and the
error paths (an environment that raises or hangs on a Ray worker, an unpicklable task,
a single-turn task, Ray missing). Skipped where Ray is not installed."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from env_support import RemoteTask
from fake_session import FakeSession
from test_pipeline_stages import ToyTask, config, run_pipeline

from engine.common import extras
from engine.config.values import parse_score_workers
from engine.envs.scoring import check_score_workers
from engine.errors import ConfigError

needs_ray = pytest.mark.skipif(
    bool(extras.missing("ray")), reason="ray is not installed (pip install 'engine[ray]')"
)
TESTS = Path(__file__).resolve().parent
WORKER_PATH = os.pathsep.join([str(TESTS), str(TESTS.parent)])
"""What Ray workers need on their path to unpickle the tests' environments."""


def pids(results: Any) -> set[int]:
    return {
        t.logs["pid"] for r in results for g in r.groups for e in g.trajectories for t in e.turns
    }


@needs_ray
@pytest.mark.slow
@pytest.mark.anyio
async def test_the_engine_starts_a_local_cluster_and_shuts_down_only_that(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import ray

    assert not ray.is_initialized()
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("PYTHONPATH", WORKER_PATH)  # the local cluster's workers inherit it
    _, results = await run_pipeline(
        FakeSession(), config(steps=2, score_workers="ray:2"), task=RemoteTask()
    )
    assert [len(e.turns) for r in results for g in r.groups for e in g.trajectories] == [
        1,
        1,
        2,
        2,
    ] * 2
    assert os.getpid() not in pids(results) and pids(results)
    assert all(r.metrics["groups/reward_errors"] == 0 for r in results)
    assert not ray.is_initialized(), "the engine left the cluster it started running"


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    """The caller's own small cluster (one CPU), started before the engine runs."""
    import ray

    ray.init(
        num_cpus=1,
        include_dashboard=False,
        runtime_env={"env_vars": {"PYTHONPATH": WORKER_PATH}},
    )
    try:
        yield
    finally:
        ray.shutdown()


@needs_ray
@pytest.mark.slow
@pytest.mark.anyio
async def test_environment_errors_and_hangs_on_ray_workers_end_their_episodes(
    cluster: None,
) -> None:
    import ray

    raising = RemoteTask(env={"raise_at": 1})
    _, (result,) = await run_pipeline(
        FakeSession(), config(steps=1, score_workers="ray:2"), task=raising
    )
    episodes = [e for g in result.groups for e in g.trajectories]
    assert {e.outcome for e in episodes} == {"env_error"}
    assert all("the environment broke" in (e.error or "") for e in episodes)

    hanging = RemoteTask(env={"hang_at": 1})
    cfg = config(steps=1, score_workers="ray:2", episode_timeout=2.0)
    _, (result,) = await run_pipeline(FakeSession(), cfg, task=hanging)
    assert {e.outcome for g in result.groups for e in g.trajectories} == {"timeout"}
    assert ray.is_initialized(), "the engine shut down the caller's cluster"


@needs_ray
@pytest.mark.slow
def test_a_shipped_environment_trains_through_a_ray_cluster(cluster: None, tmp_path: Path) -> None:
    import ray
    from engine_support import run_engine, small_config

    from engine.basemodels.catalogue import AGENT_MODEL_DIR
    from engine.local import LocalServer

    with LocalServer(AGENT_MODEL_DIR) as server:
        cfg = small_config(
            server,
            tmp_path / "run",
            task="guess-sum",
            steps=2,
            batch=2,
            group=2,
            score_workers="ray:2",  # --env-max-tokens: its default, above the model's context
        )
        steps, result = run_engine(cfg)
    assert result.steps_completed == 2
    episodes = [e for s in steps for g in s.groups for e in g.trajectories]
    assert len(episodes) == 2 * 2 * 2 and all(e.turns for e in episodes)
    assert all(s.metrics["groups/reward_errors"] == 0 for s in steps)
    assert {e.outcome for e in episodes} <= {"done", "max_tokens", "max_turns"}
    context = json.loads((AGENT_MODEL_DIR / "config.json").read_text())["max_position_embeddings"]
    assert all(len(e.turns[-1].observation) + len(e.turns[-1].action) <= context for e in episodes)
    assert ray.is_initialized()


@needs_ray
@pytest.mark.anyio
async def test_an_unpicklable_task_is_one_line_before_the_run(tmp_path: Path) -> None:
    from engine import Engine

    session = FakeSession()
    cfg = config(score_workers="ray:2").replace(run_dir=tmp_path / "run")
    task = RemoteTask(held=threading.Lock())  # cloudpickle cannot send a lock
    with pytest.raises(ConfigError, match="--score-workers ray:2 needs a picklable task") as e:
        async with Engine(cfg, task=task, session=session):  # type: ignore[arg-type]
            pass
    assert "\n" not in str(e.value) and session.log == []


def test_ray_runs_environment_tasks_only_and_needs_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"ray runs environment tasks.*single-turn"):
        check_score_workers(ToyTask(), parse_score_workers("ray:2"))
    monkeypatch.setattr(extras, "_installed", lambda module: module != "ray")
    with pytest.raises(ConfigError, match=r"ray:N needs the 'ray' extra .*'engine\[ray\]'"):
        check_score_workers(RemoteTask(), parse_score_workers("ray:2"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ray:N"):
        parse_score_workers("ray:0")
