"""Dynamic sampling (``--refill-groups``) and length control (``--overlong-filter``,
``--overlong-buffer``) on the fake session (tests/fake_session.py): a step's reserves
replace its groups without signal, bounded, counted, seeded by (step, index), the same
whatever order groups finish in and after a resume; overlong responses are masked or
penalised. No server, no sleeps."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest
from fake_session import FakeSession
from test_engine_fake_session import fake_config, run_stopped_after_first
from test_engine_fake_session import run as run_engine
from test_pipeline_stages import ToyProblems, config, rl_steps

from engine.core.problems import Problem, RewardBreakdown
from engine.core.seeds import ALL_EPISODES, sampling_seed
from engine.core.state import LoopState, ScoredGroup
from engine.core.trajectory import Trajectory, Turn
from engine.errors import ConfigError, ResumeError
from engine.loop.length_control import LengthControl, is_overlong, overlong_penalty
from engine.loop.pipeline import Pipeline
from engine.loop.recipe import StageContext
from engine.loop.refill import StepRefill
from engine.loop.results import StepResult
from engine.loop.stopping import StopGate
from engine.objectives import checked_objective
from engine.objectives.rl import RL
from engine.session.api import SampleResult, SamplerHandle, SamplingParams

pytestmark = pytest.mark.anyio


class TieTask(ToyProblems):
    """Problem ``i`` in ``tied`` scores 1 for every response (its group ties); any
    other scores response ``"<version> <j>"`` with ``j % 2`` (a mixed group)."""

    def __init__(self, tied: set[int]) -> None:
        self.tied = tied

    def score(self, response: str, problem: Problem) -> RewardBreakdown:
        if problem.id in self.tied:
            return RewardBreakdown(1.0)
        return RewardBreakdown(float(int(response.split()[1]) % 2))


@dataclasses.dataclass
class SeedRecordingSession(FakeSession):
    """A FakeSession that records the seed of every sample request."""

    seeds: list[int] = dataclasses.field(default_factory=list)

    async def sample(
        self,
        sampler: SamplerHandle,
        prompt_tokens: Sequence[int],
        num_samples: int,
        settings: SamplingParams,
    ) -> SampleResult:
        assert settings.seed is not None  # derived from --seed: every request has one
        self.seeds.append(settings.seed)
        return await super().sample(sampler, prompt_tokens, num_samples, settings)


async def run(
    session: FakeSession, task: Any, state: LoopState | None = None, **changes: Any
) -> list[StepResult]:
    cfg = config(**changes)
    source = task.source(cfg.task.seed, None if state is None else state.source_state)
    state = state or LoopState(0, source.state(), 0)
    results: list[StepResult] = []

    async def record(result: StepResult) -> None:
        results.append(result)

    gate = StopGate()
    pipeline = Pipeline(
        StageContext.start(
            cfg.pipeline, session, source, state, SamplerHandle(state.sampler_version, 0), gate
        ),
        rl_steps(cfg, task, session),
        record,
        learning_rate=cfg.training.learning_rate,
        checkpoint_due=cfg.checkpoint_due,
    )
    with anyio.CancelScope() as scope:
        gate.attach(scope)
        await pipeline.run()
    return results


def _ids(result: StepResult) -> list[int]:
    return [g.problem.id for g in result.groups]


# ------------------------------------------------------------------ the refill rule


def _group(index: int, *, tied: bool) -> ScoredGroup:
    rewards = [1.0, 1.0] if tied else [0.0, 1.0]
    trajectories = tuple(
        Trajectory((Turn((1,), (2,), (-0.5,), 0, "stop"),), group_reward=RewardBreakdown(r))
        for r in rewards
    )
    return ScoredGroup(0, index, Problem(index, "q", None), 0, trajectories)


def _settle(refill: StepRefill, tied: set[int], order: Sequence[int]) -> tuple[int, frozenset[int]]:
    """Finish started groups in the preference ``order`` (the first started one of it
    each time); the step's size and the groups it sampled."""
    started = set(refill.to_start())
    finished: set[int] = set()
    while finished != started:
        index = next(i for i in order if i in started - finished)
        finished.add(index)
        started.update(refill.finished(_group(index, tied=index in tied)))
    assert refill.size is not None
    return refill.size, frozenset(started)


def test_the_reserves_a_step_samples_depend_on_outcomes_not_on_finishing_order() -> None:
    tied = {0, 2, 4}  # batch 0..2, reserves 3..6
    outcomes = {
        _settle(StepRefill(3, 4), tied, order) for order in itertools.permutations(range(7))
    }
    # 0, 2 tie -> reserves 3, 4; reserve 4 ties -> reserve 5; 3 + 3 groups with signal.
    assert outcomes == {(6, frozenset(range(6)))}


def test_reserves_are_bounded_and_a_step_without_enough_stays_short() -> None:
    size, started = _settle(StepRefill(2, 2), {0, 1, 2, 3}, range(4))
    assert size == 4 and started == frozenset(range(4))
    refill = StepRefill(2, 1)
    assert refill.to_start() == [0, 1]
    assert refill.finished(_group(0, tied=True)) == [2]
    assert refill.size == 3  # every reserve started: final before the groups finish
    assert refill.finished(_group(1, tied=True)) == []


def test_without_reserves_the_size_is_the_batch_at_once() -> None:
    refill = StepRefill(4, 0)
    assert refill.to_start() == [0, 1, 2, 3] and refill.size == 4


def test_a_restored_reserve_restarts_the_reserves_before_it() -> None:
    # Reserve 1 (index 3) was checkpointed, reserve 0 (index 2) and group 1 were not.
    refill = StepRefill(2, 3, [_group(0, tied=True), _group(3, tied=True)])
    assert sorted(refill.to_start()) == [1, 2]
    assert refill.finished(_group(1, tied=False)) == []
    assert refill.size is None
    assert refill.finished(_group(2, tied=False)) == []
    assert refill.size == 4  # 0 and 3 tie: two reserves, two groups with signal


def test_a_group_finishing_twice_is_an_error() -> None:
    refill = StepRefill(1, 0)
    refill.to_start()
    refill.finished(_group(0, tied=False))
    with pytest.raises(ValueError, match="finished twice"):
        refill.finished(_group(0, tied=False))


# ------------------------------------------------------------------ the pipeline


async def test_refill_samples_reserves_for_tied_groups_and_counts_them() -> None:
    # Step s draws problems 4s..4s+3: 2 of its batch, 2 reserves.
    results = await run(FakeSession(), TieTask({0, 2, 9}), refill_groups=2)
    assert [_ids(r) for r in results] == [[0, 1, 2, 3], [4, 5], [8, 9, 10], [12, 13]]
    m = [r.metrics for r in results]
    assert [x["groups/with_signal"] for x in m] == [2, 2, 2, 2]
    assert [x["refill/extra_groups"] for x in m] == [2, 0, 1, 0]
    assert [x["refill/replaced"] for x in m] == [1, 0, 1, 0]
    assert [x["refill/unused_reserves"] for x in m] == [0, 2, 1, 2]
    assert [x["refill/short"] for x in m] == [0, 0, 0, 0]
    # Tied groups stay in their step, skipped: no datums from them.
    assert [x["groups/skipped"] for x in m] == [2, 0, 1, 0]
    assert all(x["datums"] == 2 * 2 for x in m)  # 2 groups x 2 responses with signal
    assert all(x["off_policy/staleness"] <= 1 for x in m)
    assert "groups=2/4 (+2 refill) " in RL.step_detail(m[0])
    assert "refill" not in RL.step_detail(m[1])


async def test_without_refill_a_tied_group_is_skipped_and_the_step_trains_short() -> None:
    results = await run(FakeSession(), TieTask({0, 3}))
    assert [_ids(r) for r in results] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    m = [r.metrics for r in results]
    assert [x["refill/short"] for x in m] == [1, 1, 0, 0]
    assert [x["groups/skipped"] for x in m] == [1, 1, 0, 0]
    assert all(x["refill/extra_groups"] == 0 and x["refill/unused_reserves"] == 0 for x in m)


async def test_a_step_whose_reserves_run_out_stays_short() -> None:
    results = await run(FakeSession(), TieTask({0, 1, 2, 3}), steps=1, refill_groups=2)
    (m,) = [r.metrics for r in results]
    assert m["refill/extra_groups"] == 2 and m["refill/short"] == 1
    assert m["groups/with_signal"] == 0 and m["datums"] == 0


async def test_reserves_are_seeded_by_their_step_and_index_and_runs_repeat() -> None:
    first, again = SeedRecordingSession(), SeedRecordingSession()
    one = await run(first, TieTask({0, 2, 9}), refill_groups=2, max_steps_off_policy=0)
    two = await run(again, TieTask({0, 2, 9}), refill_groups=2, max_steps_off_policy=0)
    expected = {
        sampling_seed(config().task.seed, r.step - 1, g.index, ALL_EPISODES, 0)
        for r in one
        for g in r.groups
    }
    assert set(first.seeds) == expected and len(first.seeds) == len(expected)
    assert sorted(first.seeds) == sorted(again.seeds)
    assert [_ids(r) for r in one] == [_ids(r) for r in two]
    assert [r.metrics["avg_reward"] for r in one] == [r.metrics["avg_reward"] for r in two]


async def test_a_checkpoint_mid_refill_resumes_to_the_same_batch() -> None:
    task = TieTask({4, 6, 9})  # step 1: 4 ties -> reserve 6 ties -> reserve 7
    full = await run(FakeSession(), task, refill_groups=2, max_steps_off_policy=0)
    assert _ids(full[1]) == [4, 5, 6, 7]
    # The checkpoint after step 1 kept step 2's tied group 4 and its second reserve
    # (7) only: group 5 and reserve 6 were in flight.
    kept = tuple(g for g in full[1].groups if g.index in (0, 3))
    state = dataclasses.replace(full[0].state, pending_groups=kept)
    restored = FakeSession(_submitted_optims=1)  # the server restored after step 1
    resumed = await run(restored, task, state, refill_groups=2, max_steps_off_policy=0)
    assert [_ids(r) for r in resumed] == [_ids(r) for r in full[1:]]
    for one, two in zip(resumed, full[1:], strict=True):
        assert one.metrics["datums"] == two.metrics["datums"]
        assert one.metrics["refill/extra_groups"] == two.metrics["refill/extra_groups"]
        assert one.advantages == two.advantages


async def test_an_engine_stopped_and_resumed_trains_what_an_uninterrupted_run_trains(
    tmp_path: Path,
) -> None:
    task = TieTask({0, 2, 9})
    whole = await run_engine(fake_config(tmp_path / "whole", refill_groups=2), task, FakeSession())
    cfg = fake_config(tmp_path / "run", refill_groups=2)
    session = FakeSession()
    first, result = await run_stopped_after_first(cfg, task, session)
    assert result.stopped
    second = await run_engine(cfg.replace(resume=tmp_path / "run"), task, session)
    assert [_ids(r) for r in first + second] == [_ids(r) for r in whole]
    assert [r.metrics["refill/extra_groups"] for r in first + second] == [2, 0, 1, 0]
    with pytest.raises(ResumeError, match=r"pipeline\.refill_groups is 2 in the run dir but 3"):
        await run_engine(
            cfg.replace(steps=5, refill_groups=3, resume=tmp_path / "run"), task, session
        )


# ------------------------------------------------------------------ length control


def _trajectory(lengths: Sequence[int], stop: str = "stop", reward: float = 1.0) -> Trajectory:
    turns = tuple(Turn((1,), (2,) * n, (-0.5,) * n, 0, stop) for n in lengths)
    return Trajectory(turns, group_reward=RewardBreakdown(reward, {"correct": reward}))


def test_the_soft_penalty_falls_linearly_over_the_buffer() -> None:
    assert overlong_penalty(12, 16, 4, 1.0) == 0.0
    assert overlong_penalty(14, 16, 4, 1.0) == pytest.approx(-0.5)
    assert overlong_penalty(16, 16, 4, 2.0) == pytest.approx(-2.0)
    assert overlong_penalty(16, 16, 0, 1.0) == 0.0


def test_length_control_penalises_each_turn_and_masks_cut_episodes() -> None:
    control = LengthControl(filter=True, budget=16, buffer=4, factor=1.0)
    kept, cut, episode = control.apply(
        [_trajectory([14]), _trajectory([16], stop="length"), _trajectory([14, 15])]
    )
    assert kept.total_reward == pytest.approx(0.5) and not kept.masked
    assert kept.group_reward.components == {"correct": 1.0, "overlong_penalty": -0.5}
    assert cut.masked and is_overlong(cut) and cut.total_reward == pytest.approx(0.0)
    assert episode.total_reward == pytest.approx(1.0 - 0.5 - 0.75) and not episode.masked
    ran_out = dataclasses.replace(_trajectory([3]), outcome="max_tokens")
    assert is_overlong(ran_out)
    off = LengthControl(filter=False, budget=16, buffer=0, factor=1.0)
    raw = _trajectory([16], stop="length")
    assert off.apply([raw]) == (raw,)


def test_an_overlong_buffer_above_max_tokens_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="--overlong-buffer 20 must not exceed --max-tokens 16"):
        config(overlong_buffer=20, max_tokens=16)


def test_refill_with_supervised_fine_tuning_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"--refill-groups .* needs --objective rl"):
        checked_objective(config(refill_groups=2, objective="sft"))


async def test_overlong_filtering_masks_cut_responses_and_refill_replaces_their_groups() -> None:
    # The fake sampler's responses all stop at "length": every one is overlong.
    results = await run(FakeSession(), TieTask(set()), steps=1, overlong_filter=True)
    (m,) = [r.metrics for r in results]
    assert m["length/overlong_frac"] == 1.0 and m["length/overlong_masked"] == 4
    assert m["datums"] == 0 and m["groups/with_signal"] == 0
    assert all(t.masked for g in results[0].groups for t in g.trajectories)
    refilled = await run(
        FakeSession(), TieTask(set()), steps=1, overlong_filter=True, refill_groups=3
    )
    assert refilled[0].metrics["refill/extra_groups"] == 3
    assert refilled[0].metrics["refill/short"] == 1


async def test_the_soft_penalty_is_a_reward_component_of_the_step() -> None:
    # Responses "<v> <j>" are 3 tokens of 4: a buffer of 2 penalises each by 0.5.
    results = await run(FakeSession(), TieTask({0, 1}), steps=1, max_tokens=4, overlong_buffer=2)
    (m,) = [r.metrics for r in results]
    assert m["env/all/overlong_penalty"] == pytest.approx(-0.5)
    assert m["avg_reward"] == pytest.approx(0.5)
