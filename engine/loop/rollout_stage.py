"""The rollout stage: problems -> groups of trajectories, sampled at the newest policy.

It draws each step's problems from the seeded source and announces the step
(:class:`~engine.loop.messages.StepOpened`), waits for admission -- the newest policy
version must be at least ``step - W`` (``--start-window``, else K) -- and starts every
group of the step, each one
task that runs the group's episodes and rewards (:class:`~engine.envs.rollout.EpisodeRunner`).
Every turn samples from the newest sampler (at most ``--concurrency`` requests in flight)
and records its version; a group's version is that of its oldest turn. A scored group's
trajectories get the run's length control (:mod:`~engine.loop.length_control`); with
``--refill-groups`` a group without signal starts one of the step's reserves
(:mod:`~engine.loop.refill`), and the step's size is announced
(:class:`~engine.loop.messages.StepClosed`) once it is final. With a teacher
(``--objective distill``) each group's action tokens get the teacher's logprobs before
the group is sent on (:mod:`~engine.loop.teacher`).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import anyio
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectSendStream

from engine.config.loop_settings import ScoringSettings
from engine.config.model_settings import SamplingSettings
from engine.core.problems import Problem, ProblemSource
from engine.core.seeds import sampling_seed
from engine.core.state import ScoredGroup
from engine.core.trajectory import Observation
from engine.envs.rollout import EpisodeRunner, GroupRollout, SampledAction, turn_settings
from engine.envs.types import EnvGroupBuilder
from engine.loop.groups import GroupPlan, NotSampled
from engine.loop.length_control import LengthControl
from engine.loop.messages import GroupsStarted, RolledOut, StepClosed, StepOpened, steps_done
from engine.loop.recipe import StageContext
from engine.loop.refill import StepRefill
from engine.loop.teacher import Teacher, TeacherScores
from engine.session.usage import spending_for

__all__ = ["RolloutStage", "draw_step"]


@dataclass
class _OpenStep:
    """A step whose groups are being rolled out: its problems (the batch, then the
    reserves), which of them to sample (``refill``), whether its size was announced, and
    the task group its rollouts run in."""

    step: int
    problems: list[Problem]
    refill: StepRefill
    tg: TaskGroup
    closed: bool = False


def draw_step(source: ProblemSource, batch: int) -> list[Problem] | None:
    """The next step's ``batch`` problems from ``source`` (None: it ran out first)."""
    problems: list[Problem] = []
    for _ in range(batch):
        problem = source.next()
        if problem is None:
            return None
        problems.append(problem)
    return problems


class RolloutStage:
    """Rolls out steps ``state.draw_from`` to ``--steps`` (the groups a checkpoint kept
    or trained are not rolled out again), sampling with ``sampling`` (seeded from
    ``seed``), failing or skipping a reward error as ``scoring`` says and applying
    ``length``. ``exhausted`` is set when the source ran out first. The context's
    ``submitted`` is the submitter's count of submitted steps: with ``--sample-ahead`` a
    step waits for the step ahead of it to be submitted."""

    def __init__(
        self,
        context: StageContext,
        plan: GroupPlan,
        sampling: SamplingSettings,
        scoring: ScoringSettings,
        length: LengthControl,
        *,
        seed: int,
        teacher: Teacher | None = None,
    ) -> None:
        self._pipeline = context.pipeline
        self._sampling = sampling
        self._fail_on_reward_error = scoring.on_reward_error == "fail"
        self._seed = seed
        self._teacher = teacher
        self._plan = plan
        self._session = context.session
        self._source = context.source
        self._state = context.state
        self._versions = context.versions
        self._submitted = context.submitted
        self._meter = context.meter
        self._gate = context.gate
        self._clock = context.clock
        self._progress = context.progress
        self._on_reward_error = context.on_reward_error
        self._slots = anyio.Semaphore(context.pipeline.concurrency)
        ahead = context.pipeline.sample_ahead
        self._sample_ahead = ahead if ahead is not None or plan.episodic else 0
        self._length = length
        self.exhausted = False

    async def run(self, tg: TaskGroup, send: MemoryObjectSendStream[RolledOut]) -> None:
        cfg = self._pipeline
        restored: dict[int, list[ScoredGroup]] = {}
        for g in self._state.pending_groups:
            restored.setdefault(g.step, []).append(g)  # rolled out before a resume: reused
        trained = set(self._state.trained_ahead)  # completion order: trained before a resume
        async with send:
            for step in range(self._state.draw_from, cfg.steps):
                problems = draw_step(self._source, cfg.batch + cfg.refill_groups)
                if problems is None:
                    self.exhausted = True
                    return
                await send.send(StepOpened(step, self._source.state()))
                await self._versions.wait_for(step - cfg.start_lag)  # admission
                if self._sample_ahead is not None:
                    await self._submitted.wait_for(step - self._sample_ahead)
                refill = StepRefill(cfg.batch, cfg.refill_groups, restored.pop(step, ()))
                opened = _OpenStep(step, problems, refill, tg)
                indices = [i for i in refill.to_start() if (step, i) not in trained]
                if cfg.step_order == "completion":
                    admitted = self._versions.current.version
                    await send.send(GroupsStarted(step, tuple(indices), admitted))
                await self._start(opened, indices, send)

    async def _start(
        self, opened: _OpenStep, indices: list[int], send: MemoryObjectSendStream[RolledOut]
    ) -> None:
        """Start the rollouts of ``indices`` of the open step (sampled at the newest
        policy); a group that cannot be sampled is sent at once. Then announce the
        step's size if it is final."""
        queue = list(indices)
        while queue:
            index = queue.pop(0)
            problem = opened.problems[index]
            admitted = self._versions.current.version
            built = self._plan.build(problem, self._pipeline.group)
            if isinstance(built, NotSampled):
                now = self._clock()
                group = ScoredGroup(opened.step, index, problem, admitted, (), now, now, now, now)
                group = dataclasses.replace(group, too_long=built.reason)
                await send.send(group)
                queue.extend(opened.refill.finished(group))
                continue
            job = (opened, index, admitted, built, send.clone())
            opened.tg.start_soon(self._rollout_group, *job)
        size = opened.refill.size
        if size is not None and not opened.closed:
            opened.closed = True
            await send.send(StepClosed(opened.step, size))

    async def _rollout_group(
        self,
        opened: _OpenStep,
        index: int,
        admitted: int,
        builder: EnvGroupBuilder,
        send: MemoryObjectSendStream[RolledOut],
    ) -> None:
        step, problem = opened.step, opened.problems[index]
        async with send:
            with spending_for(steps_done(step)):  # its samples, teacher and judge calls
                try:
                    sample = functools.partial(self._sample_turn, step, index)
                    runner = EpisodeRunner(sample, self._plan.limits, clock=self._clock)
                    rollout = await runner.run_group(builder, problem)
                    scores = None
                    if self._teacher is not None and rollout.error is None:
                        scores = await self._teacher.score(
                            rollout.trajectories, self._slots, self._clock
                        )
                except Exception as exc:
                    # Sampling (or teacher) retries are spent, or the breaker is open: stop
                    # after the steps in flight instead of cancelling them half-way.
                    self._gate.request(exc)
                    return
                if rollout.error is not None:
                    self._on_reward_error(rollout.error)
                    if self._fail_on_reward_error:
                        # Stop after the steps in flight; until then keep the streams open
                        # (closing them would break the other rollout tasks mid-send).
                        self._gate.request(rollout.error)
                        await anyio.sleep_forever()
                self._progress(f"step {steps_done(step)} group {index} rolled out")
                group = _scored(step, index, problem, admitted, rollout, scores, self._length)
                await send.send(group)
                await self._start(opened, opened.refill.finished(group), send)

    async def _sample_turn(
        self,
        step: int,
        group: int,
        observation: Observation,
        n: int,
        room: int | None,
        *,
        episode: int,
        turn: int,
    ) -> list[SampledAction]:
        """``n`` actions for ``observation`` from the newest sampler, seeded by where the
        request sits in the run (``--sampling-seed``: that one seed for every request,
        as the quickstart sends it)."""
        cfg = self._sampling
        seed = cfg.sampling_seed
        if seed is None:
            seed = sampling_seed(self._seed, step, group, episode, turn)
        settings = turn_settings(
            observation,
            room,
            max_tokens=cfg.max_tokens,
            temperature=cfg.resolved_temperature,
            seed=seed,
        )
        async with self._slots:
            sampler = self._versions.current
            self._meter.begin()
            samples = tokens = 0
            try:
                result = await self._session.sample(sampler, observation.tokens, n, settings)
                samples = len(result.completions)
                tokens = sum(len(c.tokens) for c in result.completions)
            finally:
                self._meter.end(items=samples, tokens=tokens)
        return [
            SampledAction(c, result.version, result.retries if i == 0 else 0)
            for i, c in enumerate(result.completions)
        ]


def _scored(
    step: int,
    index: int,
    problem: Problem,
    admitted: int,
    rollout: GroupRollout,
    scores: TeacherScores | None,
    length: LengthControl,
) -> ScoredGroup:
    trajectories = length.apply(rollout.trajectories if scores is None else scores.trajectories)
    return ScoredGroup(
        step=step,
        index=index,
        problem=problem,
        version=min((t.version for t in trajectories if t.turns), default=admitted),
        trajectories=trajectories,
        sample_started=rollout.started,
        sample_finished=rollout.episodes_finished,
        score_started=rollout.episodes_finished,
        score_finished=rollout.rewards_finished,
        retries=rollout.retries,
        reward_error=None if rollout.error is None else str(rollout.error),
        teacher_started=0.0 if scores is None else scores.started,
        teacher_finished=0.0 if scores is None else scores.finished,
    )
