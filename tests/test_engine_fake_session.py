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

from engine import Engine, EngineConfig, RunResult
from engine.loop.results import StepResult

pytestmark = pytest.mark.anyio


def fake_config(run_dir: Path, **changes: Any) -> EngineConfig:
    return config(**changes).replace(run_dir=run_dir, checkpoint_every=1, progress=False)


async def run(cfg: EngineConfig, task: Any, session: Any, **kwargs: Any) -> list[StepResult]:
    steps: list[StepResult] = []
    async with Engine(cfg, task=task, session=session, on_step=steps.append, **kwargs) as e:
        await e.run()
    return steps


async def run_stopped_after_first(
    cfg: EngineConfig, task: Any, session: Any
) -> tuple[list[StepResult], RunResult]:
    """Run, asking the engine to stop once its first step has trained: the steps it
    trained (those in flight at the request finish too) and the run's result."""
    steps: list[StepResult] = []
    async with Engine(cfg, task=task, session=session, on_step=steps.append) as engine:

        async def stop(result: StepResult) -> None:
            engine.request_stop()

        engine.add_step_hook(stop)
        return steps, await engine.run()


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
    cfg = fake_config(tmp_path / "run", log_rollouts=1).replace(checkpoint_every=2)
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
    first, result = await run_stopped_after_first(cfg, task, session)
    assert result.stopped and result.steps_completed == 1
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


@dataclasses.dataclass
class HeldOutCountdown(CountdownTask):
    """Held-out problems 0..2: greedy episodes of 1..3 turns (reward 1 per turn; the
    group reward is the parity of the greedy first reply "<v> 0": 0)."""

    def eval_problems(self) -> list[Any]:
        from engine.core.problems import Problem

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


def jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def checkpoint_steps(run_dir: Path) -> list[tuple[int, str]]:
    return [(c["step"], c["reason"]) for c in jsonl(run_dir / "checkpoints.jsonl")]


def trained_ids(run_dir: Path) -> list[int]:
    rows = jsonl(run_dir / "metrics.jsonl")
    return [i for row in rows if "problem_ids" in row for i in row["problem_ids"]]


async def until_logged(session: FakeSession, *entries: tuple[str, int]) -> None:
    for _ in range(100_000):
        if all(e in session.log for e in entries):
            return
        await anyio.lowlevel.checkpoint()
    raise AssertionError(f"never logged {entries}")


async def test_a_stop_with_a_checkpoint_in_flight_records_it_once_saved(tmp_path: Path) -> None:
    session = FakeSession()
    saving = session.hold_checkpoint(2)
    cfg = fake_config(tmp_path / "run").replace(checkpoint_every=2)
    async with Engine(cfg, task=ToyTask(), session=session) as engine:

        async def stop_while_saving() -> None:
            # The checkpoint after step 2 is reserved and step 3 is submitted behind it.
            await until_logged(session, ("checkpoint", 2), ("optim_step", 3))
            engine.request_stop()
            saving.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(stop_while_saving)
            result = await engine.run()
    assert result.stopped and result.steps_completed == 3
    saved = checkpoint_steps(tmp_path / "run")
    # the caller's stop is named as one (stop-step-3), not as a signal's interrupt
    assert saved == [(0, "periodic"), (2, "periodic"), (3, "stop")]
    last = jsonl(tmp_path / "run" / "checkpoints.jsonl")[-1]
    assert last["state_path"].endswith("/stop-step-3")
    await run(cfg.replace(resume=tmp_path / "run"), ToyTask(), session)
    assert trained_ids(tmp_path / "run") == list(range(8))  # each problem once


async def test_a_crash_with_a_checkpoint_in_flight_does_not_record_it(tmp_path: Path) -> None:
    session = FakeSession()
    session.hold_checkpoint(2)  # never saved: the process dies first
    cfg = fake_config(tmp_path / "run").replace(checkpoint_every=2)
    with anyio.CancelScope() as crash:
        async with (
            Engine(cfg, task=ToyTask(), session=session) as engine,
            anyio.create_task_group() as tg,
        ):

            async def die_while_saving() -> None:
                await until_logged(session, ("checkpoint", 2), ("optim_step", 3))
                crash.cancel()

            tg.start_soon(die_while_saving)
            await engine.run()
    assert checkpoint_steps(tmp_path / "run") == [(0, "periodic")]
    session = FakeSession()  # a new server process: only what was saved survives
    session._checkpoints, session._sampler_weights = {"step-0": 0}, {"fake://sampler/step-0": 0}
    await run(cfg.replace(resume=tmp_path / "run"), ToyTask(), session)
    assert trained_ids(tmp_path / "run") == list(range(8))  # steps 1 and 2 redone, once


def failed_checkpoint_events(run_dir: Path) -> list[int]:
    rows = jsonl(run_dir / "events.jsonl")
    return [row["step"] for row in rows if row.get("event") == "checkpoint.failed"]


async def test_a_checkpoint_that_fails_to_save_is_not_recorded_and_the_run_goes_on(
    tmp_path: Path,
) -> None:
    session = FakeSession(fail_checkpoint=2)
    cfg = fake_config(tmp_path / "run").replace(checkpoint_every=2)
    await run(cfg, ToyTask(), session)
    assert checkpoint_steps(tmp_path / "run") == [(0, "periodic"), (4, "final")]
    assert failed_checkpoint_events(tmp_path / "run") == [2]
    assert trained_ids(tmp_path / "run") == list(range(8))


async def test_checkpoints_that_keep_failing_stop_the_run(tmp_path: Path) -> None:
    session = FakeSession(fail_checkpoint=2)
    cfg = fake_config(tmp_path / "run").replace(checkpoint_every=2, max_consecutive_failures=1)
    with pytest.raises(RuntimeError, match="could not save step-2"):
        await run(cfg, ToyTask(), session)
    # The run stops after the steps in flight, with a stop checkpoint of what they hold.
    (first, first_reason), (stop, stop_reason) = checkpoint_steps(tmp_path / "run")
    assert (first, first_reason, stop_reason) == (0, "periodic", "error") and stop in (2, 3)
    await run(cfg.replace(resume=tmp_path / "run"), ToyTask(), session)
    assert trained_ids(tmp_path / "run") == list(range(8))


async def test_a_fresh_run_samples_step_0_while_its_step_0_checkpoint_saves(
    tmp_path: Path,
) -> None:
    session = FakeSession()
    saving = session.hold_checkpoint(0)
    cfg = fake_config(tmp_path / "run").replace(checkpoint_every=2)
    async with Engine(cfg, task=ToyTask(), session=session) as engine:

        async def release_once_sampling() -> None:
            await until_logged(session, ("checkpoint", 0), ("sample", 0))
            assert ("checkpoint_saved", 0) not in session.log
            saving.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(release_once_sampling)
            await engine.run()
    assert session.index(("base_sampler", 0)) < session.index(("sample", 0))
    # Reserved right before step 0's first training call: both start the server's clock.
    checkpoint_0 = session.index(("checkpoint", 0))
    assert session.log[checkpoint_0 + 1] == ("forward_backward", 1)
    # Recorded first, though saved while step 1 was sampled and trained.
    assert checkpoint_steps(tmp_path / "run") == [(0, "periodic"), (2, "periodic"), (4, "final")]
    assert [e for e in session.log if e[0] == "restore"] == []


async def test_a_lost_first_step_before_the_step_0_checkpoint_is_saved_starts_afresh(
    tmp_path: Path,
) -> None:
    session = FakeSession(fail_step=1)
    session.hold_checkpoint(0)  # never saved: the first step fails first
    cfg = fake_config(tmp_path / "run").replace(checkpoint_every=2)
    steps = await run(cfg, ToyTask(), session)
    assert ("restore", 0) in session.log  # a fresh LoRA client: no record to restore
    assert [s.step for s in steps][-4:] == [1, 2, 3, 4]
    assert trained_ids(tmp_path / "run") == list(range(8))
    assert checkpoint_steps(tmp_path / "run")[0] == (0, "periodic")


async def test_a_failed_step_0_save_is_not_recorded_and_the_run_goes_on(tmp_path: Path) -> None:
    session = FakeSession(fail_checkpoint=0)
    cfg = fake_config(tmp_path / "run").replace(checkpoint_every=2)
    await run(cfg, ToyTask(), session)
    assert checkpoint_steps(tmp_path / "run") == [(2, "periodic"), (4, "final")]
    assert failed_checkpoint_events(tmp_path / "run") == [0]
    assert trained_ids(tmp_path / "run") == list(range(8))


async def test_step_0_saves_that_keep_failing_fail_the_run_before_any_step_is_recorded(
    tmp_path: Path,
) -> None:
    session = FakeSession(fail_checkpoint=0)
    cfg = fake_config(tmp_path / "run").replace(checkpoint_every=2, max_consecutive_failures=1)
    with pytest.raises(RuntimeError, match="could not save step-0"):
        await run(cfg, ToyTask(), session)
    assert trained_ids(tmp_path / "run") == []
    assert not (tmp_path / "run" / "checkpoints.jsonl").exists()


async def test_a_break_out_of_steps_returns_what_was_trained_and_nothing_is_hidden(
    tmp_path: Path,
) -> None:
    """K=1 with a step submitted ahead: when the loop breaks at step 2, step 3 may already
    be training. It finishes (its calls are on the server), and the engine's result
    says so: every trained step is in it, the final sampler is the stop checkpoint's."""
    cfg = fake_config(tmp_path / "run", steps=6)
    seen: list[int] = []
    async with Engine(cfg, task=ToyTask(), session=FakeSession()) as engine:
        async for step in engine.steps():
            seen.append(step.step)
            if step.step == 2:
                break
    result = engine.result
    assert seen == [1, 2]
    assert result is not None and result.stopped
    trained = [m["step"] for m in result.metrics]
    assert trained[:2] == [1, 2] and trained == list(range(1, result.steps_completed + 1))
    assert result.steps_completed < 6
    saved = checkpoint_steps(tmp_path / "run")
    assert saved[-1] == (result.steps_completed, "stop")
    assert result.final_path is not None
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "stopped" and summary["steps_completed"] == len(trained)


async def test_request_stop_then_iterating_on_ends_normally_with_the_run_result(
    tmp_path: Path,
) -> None:
    cfg = fake_config(tmp_path / "run", steps=6)
    async with Engine(cfg, task=ToyTask(), session=FakeSession()) as engine:
        async for step in engine.steps():
            if step.step == 1:
                engine.request_stop()
    result = engine.result
    assert result is not None and result.stopped and result.steps_completed >= 1
    assert result.run_dir == tmp_path / "run"
