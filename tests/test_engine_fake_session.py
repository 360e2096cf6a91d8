"""The Engine on a given session (``Engine(..., session=...)``): the supervisor, its
recovery and a stop/resume with an episode in flight run on the fake session
(tests/fake_session.py) in seconds. No server."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from fake_session import FakeSession
from test_envs_pipeline import CountdownTask, WaitingEnv
from test_pipeline_stages import ToyTask, config

from engine import Engine, EngineConfig
from engine.errors import Interrupted
from engine.loop.results import StepResult

pytestmark = pytest.mark.anyio


def fake_config(run_dir: Path, **changes: Any) -> EngineConfig:
    return config(**changes).replace(run_dir=run_dir, checkpoint_every=1, progress=False)


async def run(cfg: EngineConfig, task: Any, session: Any, **kwargs: Any) -> list[StepResult]:
    steps: list[StepResult] = []
    async with Engine(cfg, task=task, session=session, on_step=steps.append, **kwargs) as e:
        await e.run()
    return steps


async def test_an_engine_runs_on_a_given_session(tmp_path: Path) -> None:
    session = FakeSession()
    steps = await run(fake_config(tmp_path / "run"), ToyTask(), session)
    assert [s.step for s in steps] == [1, 2, 3, 4]
    assert (tmp_path / "run" / "metrics.jsonl").is_file()
    assert ("checkpoint", 4) in session.log


async def test_a_session_factory_is_entered_and_left_with_the_engine(tmp_path: Path) -> None:
    seen: list[str] = []

    @contextlib.asynccontextmanager
    async def factory(cfg: EngineConfig) -> AsyncIterator[FakeSession]:
        seen.append("open")
        yield FakeSession()
        seen.append("closed")

    steps = await run(fake_config(tmp_path / "run", steps=2), ToyTask(), factory)
    assert len(steps) == 2 and seen == ["open", "closed"]


async def test_the_supervisor_recovers_a_lost_step_on_the_fake_session(tmp_path: Path) -> None:
    session = FakeSession(fail_step=3)
    steps = await run(fake_config(tmp_path / "run"), CountdownTask(), session)
    assert ("failed", 3) in session.log and ("restore", 2) in session.log
    assert sorted({s.step for s in steps}) == [1, 2, 3, 4]
    final = {s.step: s for s in steps}
    assert [g.problem.id for s in sorted(final) for g in final[s].groups] == list(range(8))


async def test_a_stop_with_an_episode_in_flight_resumes_without_loss_or_duplicate(
    tmp_path: Path,
) -> None:
    blocked = anyio.Event()
    task = CountdownTask(envs={3: lambda: WaitingEnv(before=blocked)})
    session = FakeSession()
    cfg = fake_config(tmp_path / "run", steps=3)
    first: list[StepResult] = []

    async with Engine(cfg, task=task, session=session, on_step=first.append) as engine:

        async def stop_after_first(result: StepResult) -> None:
            if result.step == 1:
                engine.request_stop()

        engine.add_step_hook(stop_after_first)
        with pytest.raises(Interrupted):
            await engine.run()
    assert [s.step for s in first] == [1]
    assert task.built[3] == 1  # its episode was in flight at the stop

    blocked.set()
    resumed = cfg.replace(resume=tmp_path / "run")
    second = await run(resumed, task, session)
    trained = [g.problem.id for s in first + second for g in s.groups]
    assert trained == [0, 1, 2, 3, 4, 5]  # each once
    assert task.built[3] == 2  # restarted from its problem


async def test_a_run_dir_recorded_before_the_settings_groups_resumes(tmp_path: Path) -> None:
    """A config.json with the flat keys of before the groups (``"batch": 2``) resumes as
    the run recorded it, and a change of what is trained is still refused."""
    import json

    from engine.config import all_settings
    from engine.errors import ResumeError

    session = FakeSession()
    cfg = fake_config(tmp_path / "run", steps=2)
    await run(cfg, ToyTask(), session)
    path = tmp_path / "run" / "config.json"
    nested = json.loads(path.read_text())
    flat = {k: v for k, v in nested.items() if not isinstance(v, dict)}
    for field in all_settings():
        if field.name in nested.get(str(field.group), {}):
            flat[field.flat] = nested[str(field.group)][field.name]
    path.write_text(json.dumps(flat))
    steps = await run(cfg.replace(steps=3, resume=tmp_path / "run"), ToyTask(), session)
    assert [s.step for s in steps] == [3]
    with pytest.raises(ResumeError, match=r"pipeline.batch is 2 in the run dir but 3 now"):
        await run(cfg.replace(steps=4, batch=3, resume=tmp_path / "run"), ToyTask(), session)


async def test_a_run_started_before_the_episode_settings_resumes(tmp_path: Path) -> None:
    import json

    session = FakeSession()
    cfg = fake_config(tmp_path / "run", steps=2)
    await run(cfg, ToyTask(), session)
    path = tmp_path / "run" / "config.json"
    stored = json.loads(path.read_text())
    for key in ("env_max_turns", "env_max_tokens", "episode_timeout", "on_limit"):
        del stored["environment"][key]  # as a run dir written before these settings existed
    path.write_text(json.dumps(stored))
    steps = await run(cfg.replace(steps=3, resume=tmp_path / "run"), ToyTask(), session)
    assert [s.step for s in steps] == [3]
