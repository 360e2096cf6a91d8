"""The pipeline's stages on a fake session (tests/fake_session.py): submit-ahead order,
staleness, checkpoints that hold exactly their steps, stops between steps, concurrent
scoring in a stable order, and rewards that raise or hang. No server, no sleeps."""

from __future__ import annotations

import random
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import anyio
import pytest
from fake_session import FakeSession

from engine.config import EngineConfig
from engine.config.values import parse_score_workers
from engine.core.problems import Problem, RewardBreakdown, SeededSource
from engine.core.state import LoopState
from engine.envs.scoring import check_score_workers
from engine.errors import ConfigError, Interrupted, StepOutcomeUnknown
from engine.loop.groups import GroupPlan
from engine.loop.pipeline import Pipeline, PipelineOutcome
from engine.loop.recipe import StageContext
from engine.loop.results import StepResult
from engine.loop.stopping import StopGate
from engine.objectives.rl import RlSteps
from engine.session.api import SamplerHandle
from engine.session.preflight import local_server_profile
from engine.tasks.render import PromptRenderer
from tests.datums import model_input_tokens

pytestmark = pytest.mark.anyio


class ToyProblems:
    """Problem ``i`` asks ``p<i>``: the problems and prompts of the toy tasks, whose
    rewards (plain or async) the subclasses give."""

    name = "toy"

    def source(self, seed: int, state: Mapping[str, Any] | None = None) -> SeededSource:
        return SeededSource(lambda rng, i: Problem(i, f"p{i}", i), seed, state)

    def prompt(self, problem: Problem) -> str:
        return problem.question


class ToyTask(ToyProblems):
    """Problem ``i`` asks ``p<i>``; a response ``"<version> <j>"`` earns ``j % 2`` (so
    every group is mixed and yields datums)."""

    def score(self, response: str, problem: Problem) -> RewardBreakdown:
        return RewardBreakdown(float(int(response.split()[1]) % 2))


def config(**changes: Any) -> EngineConfig:
    base: dict[str, Any] = {
        "local": True,
        "steps": 4,
        "batch": 2,
        "group": 2,
        "max_steps_off_policy": 1,
        "submit_ahead": 1,
    }
    return EngineConfig(**{**base, **changes}).resolved(local_server_profile(None))


def rl_steps(cfg: EngineConfig, task: Any, session: FakeSession) -> RlSteps:
    """How the pipeline builds and trains ``task``'s groups (as ``--objective rl``'s run
    makes it)."""
    renderer = PromptRenderer(task, session.tokenizer)
    return RlSteps(cfg, GroupPlan(cfg, task, renderer, session.info.max_context))


async def run_pipeline(
    session: FakeSession,
    cfg: EngineConfig,
    *,
    task: Any = None,
    gate: StopGate | None = None,
    on_step: Callable[[StepResult], Awaitable[None]] | None = None,
) -> tuple[PipelineOutcome | None, list[StepResult]]:
    task = task or ToyTask()
    source = task.source(cfg.task.seed)
    state = LoopState(0, source.state(), 0)
    results: list[StepResult] = []

    async def record(result: StepResult) -> None:
        results.append(result)
        if on_step is not None:
            await on_step(result)

    gate = gate or StopGate()
    pipeline = Pipeline(
        StageContext.start(cfg.pipeline, session, source, state, SamplerHandle(0, 0), gate),
        rl_steps(cfg, task, session),
        record,
        learning_rate=cfg.training.learning_rate,
        checkpoint_due=cfg.checkpoint_due,
    )
    outcome: PipelineOutcome | None = None
    with anyio.CancelScope() as scope:
        gate.attach(scope)
        outcome = await pipeline.run()
    return outcome, results


def _append_to(out: list[StepResult]) -> Callable[[StepResult], Awaitable[None]]:
    async def append(result: StepResult) -> None:
        out.append(result)

    return append


async def until(condition: Callable[[], bool]) -> None:
    """Let the other tasks run until ``condition`` holds (bounded; no clock involved)."""
    for _ in range(100_000):
        if condition():
            return
        await anyio.lowlevel.checkpoint()
    raise AssertionError("condition never held")


async def test_the_next_step_is_submitted_while_the_previous_results_are_outstanding() -> None:
    session = FakeSession()
    release = session.hold(1)
    results: list[StepResult] = []
    async with anyio.create_task_group() as tg:

        async def go() -> None:
            results.extend((await run_pipeline(session, config()))[1])

        tg.start_soon(go)
        await until(lambda: ("snapshot", 2) in session.log)
        assert ("finished", 1) not in session.log
        assert session.index(("optim_step", 2)) < session.index(("snapshot", 2))
        release.set()
    assert [r.step for r in results] == [1, 2, 3, 4]
    # A checkpoint after step 1 keeps step 2's groups although step 2 was submitted.
    assert {(g.step, g.index) for g in results[0].state.pending_groups} >= {(1, 0), (1, 1)}
    # Step 3 (K=1) needs version 1: it is sampled only once step 1 is finished.
    assert session.index(("finished", 1)) < session.index(("sample", 1))


async def test_without_submit_ahead_each_step_is_awaited_before_the_next() -> None:
    session = FakeSession()
    _, results = await run_pipeline(session, config(submit_ahead=0))
    assert len(results) == 4
    for step in (1, 2, 3):
        assert session.index(("finished", step)) < session.index(("forward_backward", step + 1))


@pytest.mark.parametrize("k", [0, 1, 2])
async def test_staleness_never_exceeds_k(k: int) -> None:
    session = FakeSession()
    _, results = await run_pipeline(session, config(steps=6, max_steps_off_policy=k))
    assert [r.step for r in results] == list(range(1, 7))
    for r in results:
        assert all(r.step - 1 - v <= k for v in r.sampler_versions)
        assert r.staleness <= k
    if k == 0:
        assert all(set(r.sampler_versions) == {r.step - 1} for r in results)
    # Problems are trained in order, each once: problem i of step s is s * batch + i.
    ids = [g.problem.id for r in results for g in r.groups]
    assert ids == list(range(12))


async def test_a_due_checkpoint_is_reserved_behind_its_step_and_drains_nothing() -> None:
    session = FakeSession()
    release = session.hold(2)
    cfg = config(steps=5, checkpoint_every=2)
    results: list[StepResult] = []
    async with anyio.create_task_group() as tg:

        async def go() -> None:
            results.extend((await run_pipeline(session, cfg))[1])

        tg.start_soon(go)
        # Step 3 is submitted while step 2, whose checkpoint is due, is outstanding.
        await until(lambda: ("optim_step", 3) in session.log)
        assert ("finished", 2) not in session.log
        release.set()
    saved = [n for kind, n in session.log if kind == "checkpoint"]
    assert saved == [2, 4]  # optimizer steps in the weights each one saves
    # Its place in the model's sequence: right behind step 2, before step 3's calls.
    assert (
        session.index(("optim_step", 2))
        < session.index(("checkpoint", 2))
        < session.index(("forward_backward", 3))
    )
    pending = [r.checkpoint.step if r.checkpoint else None for r in results]
    assert pending == [None, 2, None, 4, None]


async def test_a_stop_lands_after_every_step_in_flight_and_submits_nothing_new() -> None:
    session = FakeSession()
    release = session.hold(1)
    gate = StopGate()
    results: list[StepResult] = []
    async with anyio.create_task_group() as tg:

        async def go() -> None:
            results.extend((await run_pipeline(session, config(), gate=gate))[1])

        tg.start_soon(go)
        await until(lambda: ("optim_step", 2) in session.log)
        gate.request(Interrupted())
        release.set()
    assert [r.step for r in results] == [1, 2]  # both steps in flight were recorded
    assert ("forward_backward", 3) not in session.log
    assert gate.clean


async def test_an_unknown_outcome_with_two_steps_in_flight_records_neither() -> None:
    session = FakeSession(fail_step=1)
    release = session.hold(1)
    recorded: list[StepResult] = []
    with pytest.raises(BaseExceptionGroup) as err:
        async with anyio.create_task_group() as tg:

            async def go() -> None:
                await run_pipeline(session, config(), on_step=_append_to(recorded))

            tg.start_soon(go)
            await until(lambda: ("optim_step", 2) in session.log)  # submitted behind step 1
            release.set()
    assert err.group_contains(StepOutcomeUnknown)
    assert recorded == []


class AsyncJudgeTask(ToyProblems):
    """An async reward whose calls finish in a shuffled order."""

    def __init__(self) -> None:
        self.running = 0
        self.peak = 0

    async def score(self, response: str, problem: Problem) -> RewardBreakdown:
        self.running += 1
        self.peak = max(self.peak, self.running)
        for _ in range(random.Random(response + problem.question).randint(0, 50)):
            await anyio.lowlevel.checkpoint()
        self.running -= 1
        return RewardBreakdown(float(int(response.split()[1]) % 2), {"index": 1.0})


async def test_scoring_is_concurrent_bounded_and_keeps_response_and_problem_order() -> None:
    task = AsyncJudgeTask()
    session = FakeSession()
    _, results = await run_pipeline(
        session, config(batch=4, group=6, score_concurrency=5), task=task
    )
    assert 1 < task.peak <= 5
    for r in results:
        assert [g.index for g in r.groups] == [0, 1, 2, 3]
        for g in r.groups:
            assert g.totals == [float(i % 2) for i in range(6)]
        # Datums follow problem order, then response order: every odd response.
        inputs = [bytes(model_input_tokens(d)[:2]) for d in r.datums]
        assert len(inputs) == 4 * 6


class GroupRankTask(ToyTask):
    def __init__(self) -> None:
        self.calls: list[int] = []

    def score_group(self, responses: Sequence[str], problem: Problem) -> list[float]:
        self.calls.append(problem.id)
        return [float(i == 0) for i in range(len(responses))]


async def test_a_group_reward_scores_each_group_once() -> None:
    task = GroupRankTask()
    _, results = await run_pipeline(FakeSession(), config(steps=2), task=task)
    assert sorted(task.calls) == [0, 1, 2, 3]
    assert all(g.totals == [1.0, 0.0] for r in results for g in r.groups)


class RaisingTask(ToyTask):
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def score(self, response: str, problem: Problem) -> RewardBreakdown:
        if problem.id == 1:
            raise self.exc
        return super().score(response, problem)


@pytest.mark.parametrize("exc", [SystemExit(3), KeyboardInterrupt(), ValueError("bad")])
async def test_a_reward_that_raises_anything_is_a_reward_error(exc: BaseException) -> None:
    _, results = await run_pipeline(
        FakeSession(), config(steps=2, on_reward_error="skip"), task=RaisingTask(exc)
    )
    assert [r.metrics["groups/reward_errors"] for r in results] == [1, 0]
    assert results[0].metrics["reward_errors/problem_ids"] == [1]
    assert type(exc).__name__ in (results[0].groups[1].reward_error or "")


class HangingTask(ToyTask):
    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def score(self, response: str, problem: Problem) -> RewardBreakdown:
        self.entered.set()
        self.release.wait()
        return RewardBreakdown(0.0)


async def test_a_hung_reward_does_not_hold_up_cancellation() -> None:
    task = HangingTask()

    async def go() -> None:
        await run_pipeline(FakeSession(), config(), task=task)

    try:
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(go)
                await until(task.entered.is_set)
                scope.cancel()
        assert scope.cancelled_caught
        daemons = [t for t in threading.enumerate() if t.name == "engine-reward"]
        assert daemons and all(t.daemon for t in daemons)  # the interpreter will not wait
    finally:
        task.release.set()


def test_processes_need_a_picklable_task() -> None:
    class Local(ToyTask):  # a class defined in a function cannot be pickled
        pass

    with pytest.raises(ConfigError, match="picklable"):
        check_score_workers(Local(), parse_score_workers("processes:2"))


async def test_a_cpu_bound_reward_runs_in_worker_processes() -> None:
    _, results = await run_pipeline(
        FakeSession(), config(steps=1, score_workers="processes:2"), task=ToyTask()
    )
    assert results[0].groups[0].totals == [0.0, 1.0]


async def test_each_step_reports_response_lengths_and_the_trained_group_fraction() -> None:
    _, results = await run_pipeline(FakeSession(), config(steps=2))
    for result in results:
        m = result.metrics
        # the fake session's responses are "<version> <j>": 3 tokens, stopped by length
        assert (m["response_len/mean"], m["response_len/max"]) == (3.0, 3.0)
        assert m["response_len/truncated_frac"] == 1.0 and m["response_len/empty_frac"] == 0.0
        assert m["groups/trained_frac"] == m["groups/used"] / m["groups/total"] == 1.0


class ProblemLog(FakeSession):
    """Logs ("problem", i) for every sample request (problem i's prompt ends in p<i>)."""

    async def sample(
        self, sampler: Any, prompt_tokens: Any, num_samples: int, settings: Any
    ) -> Any:
        problem = int(bytes(prompt_tokens).decode().rsplit("p", 1)[1].split()[0])
        self.log.append(("problem", problem))
        return await super().sample(sampler, prompt_tokens, num_samples, settings)


@pytest.mark.parametrize("k", [1, 2])
async def test_a_step_starts_sampling_once_the_step_ahead_of_it_is_submitted(k: int) -> None:
    """Two steps admitted together (K >= 1 lets steps 1 and 2 both sample on version 0)
    sample one after the other: the second step's requests would otherwise compete with
    the first's for the sampler and the client, and both miss the clock tick. It waits
    until the first step's calls have reached the server, not only until they are
    submitted: its requests would otherwise queue in the SDK ahead of them."""
    session = ProblemLog()
    cfg = config(steps=5, batch=2, max_steps_off_policy=k)
    assert cfg.pipeline.sample_ahead is None  # auto: 0 for a reward task
    _, results = await run_pipeline(session, cfg)
    assert [r.step for r in results] == [1, 2, 3, 4, 5]
    for step in range(1, 5):  # 0-based step s samples problems 2s and 2s + 1
        first_sample = min(session.index(("problem", 2 * step + i)) for i in (0, 1))
        delivered = session.index(("delivered", step))
        assert session.index(("optim_step", step)) < delivered < first_sample
