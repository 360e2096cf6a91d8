"""Environment tasks through the pipeline on the fake session (tests/fake_session.py):
per-turn sampler versions and staleness, episode metrics, a group hook that fails, and
an episode in flight at a stop and at the resume that follows (neither lost nor
trained twice). No server, no sleeps."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio
import pytest
from env_support import CountdownEnv, RankedGroup
from fake_session import FakeSession
from test_pipeline_stages import config, rl_steps, run_pipeline, until

from engine.config.values import parse_score_workers
from engine.core.problems import Problem, SeededSource
from engine.core.state import LoopState
from engine.envs import Action, EnvContext, EnvStepResult, Observation
from engine.envs.scoring import check_score_workers
from engine.errors import Interrupted
from engine.loop.pipeline import Pipeline
from engine.loop.recipe import StageContext
from engine.loop.results import StepResult
from engine.loop.stopping import StopGate
from engine.session.api import SamplerHandle

pytestmark = pytest.mark.anyio


@dataclass
class WaitingEnv:
    """Two turns; before answering its first action it waits for ``before`` (if any)
    and then sets ``after`` (if any)."""

    before: anyio.Event | None = None
    after: anyio.Event | None = None
    taken: int = 0

    async def initial_observation(self) -> Observation:
        return Observation(tuple(b"go:"))

    async def step(self, action: Action) -> EnvStepResult:
        self.taken += 1
        if self.taken == 1:
            if self.after is not None:
                self.after.set()
            if self.before is not None:
                await self.before.wait()
            return EnvStepResult(
                reward=1.0, next_observation=Observation((*b"go:", *action.tokens))
            )
        return EnvStepResult(reward=float(action.tokens[-1] % 2), done=True)


class ParityGroup(RankedGroup):
    """Group reward: the parity of the last token of the episode's first action (the
    fake sampler answers ``"<version> <i>"``: the group is mixed)."""

    async def compute_group_rewards(self, trajectories: Any, envs: Any) -> Any:
        return [float(t.turns[0].action[-1] % 2) for t in trajectories]


@dataclass
class CountdownTask:
    """Problem ``i``: ``group`` countdown episodes of ``1 + i % 3`` turns, rewarded by
    :class:`ParityGroup`. ``envs`` overrides the environments of a problem id; ``built`` counts the
    builders made per problem id."""

    name: str = "countdown"
    envs: dict[int, Any] = field(default_factory=dict)
    built: Counter[int] = field(default_factory=Counter)

    def source(self, seed: int, state: Mapping[str, Any] | None = None) -> SeededSource:
        return SeededSource(lambda rng, i: Problem(i, f"count {i}", i), seed, state)

    def group_builder(self, problem: Problem, group_size: int, context: EnvContext) -> Any:
        self.built[problem.id] += 1
        make = self.envs.get(problem.id)
        if make is not None:
            return RankedGroup([make() for _ in range(group_size)])
        return ParityGroup([CountdownEnv(turns=1 + problem.id % 3) for _ in range(group_size)])


async def test_an_environment_task_trains_whole_episodes_with_episode_metrics() -> None:
    session = FakeSession()
    _, results = await run_pipeline(session, config(steps=3), task=CountdownTask())
    assert [r.step for r in results] == [1, 2, 3]
    for r in results:
        for g in r.groups:
            turns = 1 + g.problem.id % 3
            assert [len(e.turns) for e in g.trajectories] == [turns, turns]
            assert list(g.totals) == [e.total_reward for e in g.trajectories]
    m = results[2].metrics  # problems 4 and 5: 2 and 3 turns
    assert m["env/all/turns_per_episode"] == 2.5
    assert m["env/all/outcome/done"] == 1.0
    assert m["env/all/steps"] == 1.0  # the environment's own metric, summed per episode
    assert m["skipped/masked_episodes"] == 0
    assert "time/episode_p95" in m
    assert m["datums"] == 4  # one per episode: each turn extends the previous context


async def test_each_turn_samples_the_newest_weights_and_staleness_is_the_oldest_turn() -> None:
    # Step 2's episode takes its first turn under version 0 (K=1), then waits until
    # step 1 is trained: its second turn samples version 1.
    step1_trained, step2_started = anyio.Event(), anyio.Event()
    task = CountdownTask(
        envs={
            0: lambda: WaitingEnv(before=step2_started),
            1: lambda: WaitingEnv(before=step1_trained, after=step2_started),
        }
    )

    async def on_step(result: StepResult) -> None:
        if result.step == 1:
            step1_trained.set()

    session = FakeSession()
    cfg = config(steps=2, batch=1, group=2, max_steps_off_policy=1)
    _, results = await run_pipeline(session, cfg, task=task, on_step=on_step)
    (first,), (second,) = (r.groups for r in results)
    assert [t.version for t in first.trajectories[0].turns] == [0, 0]
    assert [t.version for t in second.trajectories[0].turns] == [0, 1]
    assert second.version == 0  # the oldest turn
    assert results[1].staleness == 1


async def test_staleness_is_bounded_with_k0_for_every_turn() -> None:
    session = FakeSession()
    cfg = config(steps=3, max_steps_off_policy=0)
    _, results = await run_pipeline(session, cfg, task=CountdownTask())
    for r in results:
        versions = {t.version for g in r.groups for e in g.trajectories for t in e.turns}
        assert versions == {r.step - 1}


async def test_a_failing_group_hook_is_skipped_with_on_reward_error_skip() -> None:
    class Failing(RankedGroup):
        async def compute_group_rewards(self, trajectories: Any, envs: Any) -> Any:
            raise RuntimeError("judge down")

    class FailingTask(CountdownTask):
        def group_builder(self, problem: Problem, group_size: int, context: EnvContext) -> Any:
            if problem.id == 1:
                return Failing([CountdownEnv(turns=1) for _ in range(group_size)])
            return super().group_builder(problem, group_size, context)

    session = FakeSession()
    cfg = config(steps=1, on_reward_error="skip")
    _, (result,) = await run_pipeline(session, cfg, task=FailingTask())
    assert result.metrics["groups/reward_errors"] == 1
    failed = result.groups[1]
    assert "judge down" in (failed.reward_error or "")


async def test_an_episode_in_flight_at_a_stop_is_restarted_on_resume_exactly_once() -> None:
    # Step 2 has two groups: problem 2's finishes before step 1 is recorded (so the
    # checkpoint after step 1 keeps it, episodes and all); problem 3's is in flight at
    # the stop (the checkpoint does not have it: it is restarted from its problem).
    blocked = anyio.Event()
    task = CountdownTask(envs={3: lambda: WaitingEnv(before=blocked)})
    session = FakeSession()
    release = session.hold(1)
    cfg = config(steps=3, batch=2, group=2, max_steps_off_policy=1)
    source = task.source(cfg.task.seed)
    gate = StopGate()
    seen: list[str] = []
    first_run: list[StepResult] = []
    pipeline = Pipeline(
        StageContext.start(
            cfg.pipeline,
            session,
            source,
            LoopState(0, source.state(), 0),
            SamplerHandle(0, 0),
            gate,
            progress=seen.append,
        ),
        rl_steps(cfg, task, session),
        _record(first_run),
        learning_rate=cfg.training.learning_rate,
        checkpoint_due=cfg.checkpoint_due,
    )
    async with anyio.create_task_group() as tg:

        async def go() -> None:
            with anyio.CancelScope() as scope:
                gate.attach(scope)
                await pipeline.run()

        tg.start_soon(go)
        await until(lambda: "step 2 group 0 rolled out" in seen)
        release.set()
        await until(lambda: len(first_run) == 1)
        gate.request(Interrupted())
    assert [r.step for r in first_run] == [1]
    state = LoopState.from_dict(first_run[0].state.to_dict())  # as a checkpoint stores it
    assert [(g.step, g.index) for g in state.pending_groups] == [(1, 0)]
    assert [len(e.turns) for e in state.pending_groups[0].trajectories] == [3, 3]

    blocked.set()  # the restarted episode runs through
    second_run: list[StepResult] = []
    resumed = Pipeline(
        StageContext.start(
            cfg.pipeline,
            session,
            task.source(cfg.task.seed, state.source_state),
            state,
            SamplerHandle(1, 1),
            StopGate(),
        ),
        rl_steps(cfg, task, session),
        _record(second_run),
        learning_rate=cfg.training.learning_rate,
        checkpoint_due=cfg.checkpoint_due,
    )
    await resumed.run()
    assert [r.step for r in second_run] == [2, 3]
    trained = [g.problem.id for r in first_run + second_run for g in r.groups]
    assert trained == [0, 1, 2, 3, 4, 5]  # each once, in order
    assert task.built[2] == 1  # kept in the checkpoint: not rolled out again
    assert task.built[3] == 2  # in flight at the stop: restarted from its problem
    assert second_run[0].groups[0].trajectories == state.pending_groups[0].trajectories


def _record(out: list[StepResult]) -> Any:
    async def record(result: StepResult) -> None:
        out.append(result)

    return record


async def test_rollouts_show_each_episode_turn_by_turn() -> None:
    from fake_session import ByteTokenizer

    from engine.rollouts import format_group
    from engine.rundir.rollout_log import group_record
    from engine.tasks.render import PromptRenderer

    task = CountdownTask()
    _, results = await run_pipeline(FakeSession(), config(steps=2), task=task)
    three = results[1].groups[0]  # problem 2: three turns
    record = group_record(2, three, results[1].advantages[0], PromptRenderer(task, ByteTokenizer()))
    assert [len(e["turns"]) for e in record["episodes"]] == [3, 3]
    turn = record["episodes"][0]["turns"][1]
    assert turn["observation"] == "|" and turn["new_context"] is False
    text = format_group(record)
    assert "episode 1: done" in text and "turn 2 (v0) appended: '|'" in text


class PicklableTask(CountdownTask):
    """Module-level (so a worker process can unpickle it) with module-level envs."""


async def test_environment_steps_and_group_rewards_run_in_worker_processes() -> None:
    session = FakeSession()
    cfg = config(steps=1, score_workers="processes:2")
    _, (result,) = await run_pipeline(session, cfg, task=PicklableTask())
    assert [len(e.turns) for g in result.groups for e in g.trajectories] == [1, 1, 2, 2]
    assert result.metrics["groups/reward_errors"] == 0


def test_an_unpicklable_environment_task_is_one_line_before_the_run() -> None:
    from engine.errors import ConfigError

    task = CountdownTask(envs={0: lambda: CountdownEnv()})  # a lambda: not picklable
    with pytest.raises(ConfigError, match="needs a picklable task"):
        check_score_workers(task, parse_score_workers("processes:2"))


@dataclass
class SmallContextSession(FakeSession):
    """A fake server whose model has a context of ``context`` tokens; it records each
    request's prompt length and max_tokens."""

    context: int = 10
    requests: list[tuple[int, int]] = field(default_factory=list)

    @property
    def info(self) -> Any:
        return dataclasses.replace(super().info, max_context=self.context)

    async def sample(self, sampler: Any, prompt_tokens: Any, n: int, settings: Any) -> Any:
        self.requests.append((len(prompt_tokens), settings.max_tokens))
        return await super().sample(sampler, prompt_tokens, n, settings)


async def test_episodes_stop_at_the_served_models_context() -> None:
    # --env-max-tokens stays at its default (8192); the model's context is 10 tokens.
    session = SmallContextSession()
    _, results = await run_pipeline(session, config(steps=2), task=CountdownTask())
    assert all(p + m <= 10 for p, m in session.requests), session.requests
    by_problem = {g.problem.id: g.trajectories for r in results for g in r.groups}
    # Problem 2 runs 3 turns: its third observation (11 tokens) does not fit.
    assert [(len(e.turns), e.outcome) for e in by_problem[2]] == [(2, "max_tokens")] * 2
    assert [e.outcome for e in by_problem[1]] == ["done", "done"]
    assert results[1].metrics["env/all/outcome/max_tokens"] == 0.5
