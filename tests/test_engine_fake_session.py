"""The Engine on a given session (``Engine(..., session=...)``): the supervisor, its
recovery and a stop/resume with an episode in flight run on the fake session
(tests/fake_session.py) in seconds. No server."""

from __future__ import annotations

import contextlib
import dataclasses
import json
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
    return dataclasses.replace(
        config(**changes), run_dir=run_dir, checkpoint_every=1, progress=False
    )


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


async def test_a_recovery_leaves_each_step_once_in_every_run_file(tmp_path: Path) -> None:
    session = FakeSession(fail_step=4)
    cfg = dataclasses.replace(fake_config(tmp_path / "run", log_rollouts=1), checkpoint_every=2)
    steps = await run(cfg, ToyTask(), session)
    assert ("failed", 4) in session.log and ("restore", 2) in session.log
    assert [s.step for s in steps] == [1, 2, 3, 3, 4]  # step 3 is redone after the restore
    run_dir = tmp_path / "run"
    for name in ("metrics.jsonl", "rollouts.jsonl"):
        lines = (run_dir / name).read_text().splitlines()
        assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4], name
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps_completed"] == 4


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
    resumed = dataclasses.replace(cfg, resume=tmp_path / "run")
    second = await run(resumed, task, session)
    trained = [g.problem.id for s in first + second for g in s.groups]
    assert trained == [0, 1, 2, 3, 4, 5]  # each once
    assert task.built[3] == 2  # restarted from its problem


async def test_a_run_started_before_the_episode_settings_resumes(tmp_path: Path) -> None:
    session = FakeSession()
    cfg = fake_config(tmp_path / "run", steps=2)
    await run(cfg, ToyTask(), session)
    path = tmp_path / "run" / "config.json"
    stored = json.loads(path.read_text())
    for key in ("env_max_turns", "env_max_tokens", "episode_timeout", "on_limit"):
        del stored[key]  # as a run dir written before these settings existed
    path.write_text(json.dumps(stored))
    steps = await run(
        dataclasses.replace(cfg, steps=3, resume=tmp_path / "run"), ToyTask(), session
    )
    assert [s.step for s in steps] == [3]


@dataclasses.dataclass
class HeldOutCountdown(CountdownTask):
    """Held-out problems 0..2: greedy episodes of 1..3 turns (reward 1 per turn; the
    group reward is the parity of the greedy first reply "<v> 0": 0)."""

    def eval_problems(self) -> list[Any]:
        from engine.tasks.base import Problem

        return [Problem(i, f"held out {i}", i) for i in range(3)]


@dataclasses.dataclass
class TemperatureSession(FakeSession):
    temperatures: list[float] = dataclasses.field(default_factory=list)

    async def sample(self, sampler: Any, prompt: Any, n: int, settings: Any) -> Any:
        self.temperatures.append(settings.temperature)
        return await super().sample(sampler, prompt, n, settings)


async def test_eval_every_plays_greedy_held_out_episodes_of_an_environment_task(
    tmp_path: Path,
) -> None:
    import json

    session = TemperatureSession()
    cfg = fake_config(tmp_path / "run", eval_every=2, eval_samples=2, temperature=0.7)
    steps = await run(cfg, HeldOutCountdown(), session)
    records = [json.loads(x) for x in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 2, 4]
    for record in records:
        assert record["eval/problems"] == 3 and record["eval/reward_errors"] == 0
        assert record["eval/reward/total"] == pytest.approx(2.0)  # 1, 2 and 3 turns
        assert record["eval/turns_per_episode"] == pytest.approx(2.0)
        assert record["eval/success_rate"] == 1.0 and record["eval/pass_rate"] == 1.0
        assert "eval/sampled/pass@2" in record
    assert {s.step: "eval/reward/total" in s.metrics for s in steps} == {
        1: False,
        2: True,
        3: False,
        4: True,
    }
    assert 0.0 in session.temperatures and 0.7 in session.temperatures


async def test_the_engine_says_once_that_episodes_stop_at_the_models_context(
    tmp_path: Path,
) -> None:
    import io

    from test_envs_pipeline import SmallContextSession

    console = io.StringIO()
    steps = await run(
        fake_config(tmp_path / "run", steps=2),
        CountdownTask(),
        SmallContextSession(),
        console=console,
    )
    assert len(steps) == 2
    said = console.getvalue()
    assert said.count("episodes stop at the model's context of 10 tokens") == 1
    assert "(--env-max-tokens 8192 is larger)" in said
