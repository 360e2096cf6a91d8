"""``--step-order completion`` on the fake session (tests/fake_session.py): a slow group
trains in a later step instead of holding this one, never beyond the staleness bound
(checked on every turn), every problem trains once across a stop and a resume (an
environment's episode or an agent in flight restarts from its problem), and K=0
trains what problem order trains, datum for datum. Slow groups wait on events, so no
clock is involved."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import openai
import pytest
from fake_session import FakeSession
from test_agents_pipeline import ChatSession, Problems, two_calls
from test_engine_fake_session import fake_config, run, run_stopped_after_first
from test_envs_pipeline import CountdownTask, ParityGroup, WaitingEnv
from test_pipeline_stages import config, run_pipeline

from engine import Engine
from engine.agents import AgentTask
from engine.core.problems import Problem
from engine.core.state import LoopState, ScoredGroup
from engine.envs import EnvContext
from engine.errors import ConfigError
from engine.loop.messages import GroupsStarted, StepOpened
from engine.loop.results import StepResult
from engine.loop.step_order import CompletionOrder
from engine.objectives import checked_objective
from tests.datums import datum_to_dict

pytestmark = pytest.mark.anyio


@dataclass
class SlowTask(CountdownTask):
    """:class:`CountdownTask` whose problems in ``slow`` play two-turn episodes that wait
    for that event after their first turn (rewarded by the first turn: mixed groups)."""

    slow: dict[int, anyio.Event] = field(default_factory=dict)

    def group_builder(self, problem: Problem, group_size: int, context: EnvContext) -> Any:
        event = self.slow.get(problem.id)
        if event is None:
            return super().group_builder(problem, group_size, context)
        self.built[problem.id] += 1
        return ParityGroup([WaitingEnv(before=event) for _ in range(group_size)])


def problems(results: list[StepResult]) -> list[list[int]]:
    return [[g.problem.id for g in r.groups] for r in results]


def each_trained(results: list[StepResult]) -> list[int]:
    """Every trained problem id, sorted (a problem trained twice shows twice)."""
    return sorted(g.problem.id for r in results for g in r.groups)


def assert_every_turn_within(results: list[StepResult], k: int) -> None:
    for r in results:
        trained = r.step - 1  # the 0-based step: its data must be at most k versions old
        for g in r.groups:
            for e in g.trajectories:
                for t in e.turns:
                    assert 0 <= trained - t.version <= k, (r.step, g.problem.id, t.version)


@pytest.mark.parametrize("k", [1, 2])
async def test_a_slow_group_trains_at_its_last_step_instead_of_holding_the_first(k: int) -> None:
    # Problem 0's episodes wait after their first turn (version 0) until step k is
    # trained: it may train up to 0-based step k, and the steps before it do not wait.
    release = anyio.Event()
    task = SlowTask(slow={0: release})

    async def on_step(result: StepResult) -> None:
        if result.step == k:
            release.set()

    cfg = config(steps=k + 2, batch=2, max_steps_off_policy=k, step_order="completion")
    _, results = await run_pipeline(FakeSession(), cfg, task=task, on_step=on_step)
    trained = problems(results)
    assert all(0 not in step for step in trained[:k])
    assert 0 in trained[k]
    assert each_trained(results) == list(range(2 * (k + 2)))  # each problem once
    assert [len(step) for step in trained] == [2] * (k + 2)
    assert_every_turn_within(results, k)


async def test_the_bound_holds_for_every_turn_with_several_slow_groups() -> None:
    # Problems 0, 3 and 7 each wait for a step that their window allows them to wait
    # for (0 and 3 start at version 0, 7 at version 1 or later); the later turns of
    # their episodes sample newer weights than their first.
    after = {0: 2, 3: 1, 7: 3}
    releases = {p: anyio.Event() for p in after}
    task = SlowTask(slow=releases)

    async def on_step(result: StepResult) -> None:
        for p, step in after.items():
            if result.step == step:
                releases[p].set()

    cfg = config(steps=6, batch=2, max_steps_off_policy=2, step_order="completion")
    _, results = await run_pipeline(FakeSession(), cfg, task=task, on_step=on_step)
    trained = problems(results)
    assert each_trained(results) == list(range(12))
    assert_every_turn_within(results, 2)
    assert 0 not in trained[0]


async def test_k0_completion_order_trains_what_problem_order_trains() -> None:
    runs = []
    for order in ("problem", "completion"):
        cfg = config(steps=3, batch=3, max_steps_off_policy=0, step_order=order)
        runs.append((await run_pipeline(FakeSession(), cfg, task=CountdownTask()))[1])
    ours, theirs = runs
    assert problems(ours) == problems(theirs) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    for a, b in zip(ours, theirs, strict=True):
        assert [datum_to_dict(d) for d in a.datums] == [datum_to_dict(d) for d in b.datums]


async def test_a_stop_with_a_slow_group_in_flight_resumes_each_problem_once(
    tmp_path: Path,
) -> None:
    blocked = anyio.Event()
    task = SlowTask(slow={0: blocked})
    session = FakeSession()
    cfg = fake_config(tmp_path / "run", steps=4, step_order="completion")
    first, result = await run_stopped_after_first(cfg, task, session)
    assert result.stopped and result.steps_completed == 1
    assert 0 not in problems(first)[0]  # trained ahead of the slow group
    state = first[0].state
    assert state.next_draw == 0 and len(state.trained_ahead) == 2
    assert task.built[0] == 1

    blocked.set()
    second = await run(cfg.replace(resume=tmp_path / "run"), task, session)
    assert each_trained(first + second) == list(range(8))  # none twice, none lost
    assert task.built[0] == 2  # restarted from its problem
    assert_every_turn_within(first + second, 1)


async def test_an_agent_mid_episode_at_a_stop_restarts_from_its_problem(tmp_path: Path) -> None:
    # Problem 0's agent waits between its two calls: at the stop after step 1 its
    # episode is in flight, and the resumed run plays it again from its problem.
    blocked = anyio.Event()
    played: Counter[int] = Counter()

    async def agent(client: openai.AsyncOpenAI, problem: Problem) -> float:
        played[problem.id] += 1
        reward, _ = await two_calls(client, problem, blocked.wait if problem.id == 0 else None)
        return reward

    task = AgentTask(agent, Problems())
    session = ChatSession()
    cfg = fake_config(tmp_path / "run", steps=4, step_order="completion")
    first, result = await run_stopped_after_first(cfg, task, session)
    assert result.steps_completed == 1
    assert 0 not in problems(first)[0] and played[0] == 2  # both episodes in flight

    blocked.set()
    second = await run(cfg.replace(resume=tmp_path / "run"), task, session)
    assert each_trained(first + second) == list(range(8))
    assert played[0] == 4  # restarted from its problem
    assert_every_turn_within(first + second, 1)


def test_a_loop_state_keeps_where_drawing_resumes() -> None:
    state = LoopState(3, {"cursor": 4}, 3, (1, 2), next_draw=2, trained_ahead=((2, 1),))
    again = LoopState.from_dict(state.to_dict())
    assert again == state and again.draw_from == 2
    assert "next_draw" not in LoopState(3, {}, 3).to_dict()  # problem order: as before


@pytest.mark.parametrize("changes", [{"refill_groups": 1}, {"objective": "sft"}])
def test_completion_order_refuses_what_it_cannot_form(changes: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="--step-order completion"):  # before a run
        checked_objective(config(step_order="completion", **changes))


@pytest.mark.parametrize(("k", "w"), [(1, 1), (2, 2), (3, 3), (2, 1), (3, 1), (3, 0)])
def test_steps_keep_their_size_and_every_group_its_bound_in_any_finishing_order(
    k: int, w: int
) -> None:
    # The submitter's side alone: groups in flight (a drawn step's start once the
    # version is at least step - W) finish in a seeded random order, and a step starts
    # forming while the step before it still trains (--submit-ahead: the version it
    # waits for arrives at a random point); every step takes 4 groups, none after its
    # deadline, each once.
    batch, steps = 4, 12
    rng = random.Random(k * 10 + w)
    settings = config(
        steps=steps, batch=batch, max_steps_off_policy=k, start_window=w, step_order="completion"
    ).pipeline
    order = CompletionOrder(settings, LoopState(0, {}, 0), [])
    running: list[tuple[int, int, int]] = []
    drawn = 0
    trained: list[tuple[int, int]] = []

    def start(version: int, step: int) -> None:
        nonlocal drawn
        while drawn < steps and drawn - w <= version:  # the rollout stage's window
            order.receive(StepOpened(drawn, {}), step)
            order.receive(GroupsStarted(drawn, tuple(range(batch)), version), step)
            running.extend((drawn, i, version) for i in range(batch))
            drawn += 1

    for step in range(steps):
        version = max(0, step - 1)  # step - 1 still training
        start(version, step)
        while not order.complete(step):
            if version < step and (not running or rng.random() < 0.3):
                version = step  # step - 1 trained
                start(version, step)
                continue
            s, i, v = running.pop(rng.randrange(len(running)))
            order.receive(ScoredGroup(s, i, Problem(s * batch + i, "", 0), v, ()), step)
        closed = order.close(step)
        assert len(closed.groups) == batch
        assert all(step - k <= g.version <= step for g in closed.groups)
        trained += [(g.step, g.index) for g in closed.groups]
    assert sorted(trained) == [(s, i) for s in range(steps) for i in range(batch)]


def assert_started_within(results: list[StepResult], w: int) -> None:
    """Every trained group's first turn sampled at most ``w`` versions before the step
    it was drawn for."""
    for r in results:
        for g in r.groups:
            first = min(t.version for e in g.trajectories for t in e.turns)
            assert first >= g.step - w, (g.step, g.problem.id, first)


async def test_a_straggler_spans_steps_and_trains_once_below_the_start_window() -> None:
    # K=3, W=1: groups start at most one version ahead of their step, so problem 0 (step
    # 0, version 0) may train up to step 3. Its episodes wait after their first turn
    # until step 3 (1-based) is trained; steps 1-3 fill with groups that finished (of
    # steps 0-2), and its second turns sample the newest weights.
    release = anyio.Event()
    task = SlowTask(slow={0: release})

    async def on_step(result: StepResult) -> None:
        if result.step == 3:
            release.set()

    cfg = config(steps=6, batch=2, max_steps_off_policy=3, start_window=1, step_order="completion")
    _, results = await run_pipeline(FakeSession(), cfg, task=task, on_step=on_step)
    trained = problems(results)
    assert all(0 not in step for step in trained[:3]) and 0 in trained[3]
    (slow,) = [g for g in results[3].groups if g.problem.id == 0]
    for episode in slow.trajectories:
        assert [t.version for t in episode.turns] == [0, 3]  # one turn before, one after
    assert each_trained(results) == list(range(12))
    assert [len(step) for step in trained] == [2] * 6
    assert_every_turn_within(results, 3)
    assert_started_within(results, 1)


async def test_a_straggler_spanning_steps_trains_once_within_the_bound_across_a_resume(
    tmp_path: Path,
) -> None:
    # K=3, W=1: problem 0's episodes are in flight across the steps trained before the
    # run stops; the resumed run restarts them from their problem, they overrun two of
    # its steps again, and every problem trains once, every turn within K.
    task = SlowTask(slow={0: anyio.Event()})
    session = FakeSession()
    cfg = fake_config(
        tmp_path / "run",
        steps=7,
        max_steps_off_policy=3,
        start_window=1,
        step_order="completion",
    )
    first, result = await run_stopped_after_first(cfg, task, session)
    done = result.steps_completed
    assert 2 <= done <= 3  # the steps in flight at the stop, none past the group's deadline
    assert all(0 not in step for step in problems(first))
    assert first[-1].state.next_draw == 0 and task.built[0] == 1

    release = task.slow[0] = anyio.Event()  # the restarted episodes wait again
    second: list[StepResult] = []
    resumed = cfg.replace(resume=tmp_path / "run")
    async with Engine(resumed, task=task, session=session, on_step=second.append) as engine:

        async def release_after_two(result: StepResult) -> None:
            if result.step == done + 2:
                release.set()

        engine.add_step_hook(release_after_two)
        await engine.run()
    assert task.built[0] == 2  # restarted from its problem, once
    (slow,) = [g for r in second for g in r.groups if g.problem.id == 0]
    assert {tuple(t.version for t in e.turns) for e in slow.trajectories} == {(done, done + 2)}
    assert each_trained(first + second) == list(range(14))  # none twice, none lost
    assert_every_turn_within(first + second, 3)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"start_window": 2}, "--start-window 2 must not exceed --max-steps-off-policy 1"),
        ({"start_window": 0}, "--start-window 0 below --max-steps-off-policy 1 needs"),
    ],
)
def test_a_start_window_beyond_k_or_without_completion_order_is_refused(
    changes: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        config(**changes)
