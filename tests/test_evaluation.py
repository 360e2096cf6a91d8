"""Held-out evaluation below the seam (a fake session): the metrics, eval.jsonl, and a
reward that raises on a held-out problem under each ``--on-reward-error``."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import anyio
import pytest

from engine.config import EngineConfig, OnRewardError
from engine.envs.scoring import RewardError
from engine.errors import find_error
from engine.loop.evaluation import EVAL_FILE, Evaluator, evaluate, pass_at_k
from engine.loop.groups import GroupPlan
from engine.session.api import SamplerHandle
from engine.session.preflight import local_server_profile
from engine.tasks import Problem, RewardBreakdown, SeededSource
from engine.tasks.render import PromptRenderer
from tests.fake_session import FakeSession


class _HeldOutTask:
    """Three held-out problems; the reward of problem 1 raises, problem 0 scores 1."""

    name = "held-out"

    def source(self, seed: int, state: Mapping[str, Any] | None = None) -> SeededSource:
        return SeededSource(lambda rng, i: Problem(i, f"train {i}", 0), seed, state)

    def eval_problems(self) -> list[Problem]:
        return [Problem(i, f"held out {i}", i) for i in range(3)]

    def prompt(self, problem: Problem) -> str:
        return problem.question

    def score(self, response: str, problem: Problem) -> RewardBreakdown:
        if problem.id == 1:
            raise ValueError("no answer key for this one")
        correct = 1.0 if problem.id == 0 else 0.0
        return RewardBreakdown(correct, {"correct": correct})


def _config(**settings: Any) -> EngineConfig:
    return EngineConfig(local=True, concurrency=4, score_concurrency=4, **settings).resolved(
        local_server_profile(None)
    )


def _plan(cfg: EngineConfig, task: Any, session: FakeSession) -> GroupPlan:
    return GroupPlan(cfg, task, PromptRenderer(task, session.tokenizer), session.info.max_context)


def evaluate_once(
    tmp_path: Path, on_reward_error: OnRewardError
) -> tuple[dict[str, float], list[str]]:
    session, task = FakeSession(), _HeldOutTask()
    warnings: list[str] = []
    cfg = _config(steps=1, eval_every=1, max_tokens=4, on_reward_error=on_reward_error)
    evaluator = Evaluator(
        session,
        _plan(cfg, task, session),
        task.eval_problems(),
        cfg,
        tmp_path,
        warn=warnings.append,
    )

    async def go() -> dict[str, float]:
        return await evaluator(1, SamplerHandle(1, None))

    return anyio.run(go), warnings


def test_skip_leaves_a_failing_problem_out_of_the_eval_metrics(tmp_path: Path) -> None:
    metrics, warnings = evaluate_once(tmp_path, "skip")
    assert metrics == {
        "eval/problems": 2.0,
        "eval/reward_errors": 1.0,
        "eval/reward/total": 0.5,
        "eval/pass_rate": 0.5,
        "eval/correct": 0.5,
        "eval/correct/rate": 0.5,
    }
    [warning] = warnings
    assert warning.startswith("eval after step 1: the reward function failed on problem 1 ")
    assert "no answer key for this one" in warning and "(--on-reward-error skip)" in warning
    [record] = [json.loads(line) for line in (tmp_path / EVAL_FILE).read_text().splitlines()]
    assert record == {"step": 1, "sampler_version": 1, **metrics}


def test_fail_stops_at_the_first_failing_problem(tmp_path: Path) -> None:
    with pytest.raises(BaseException) as raised:
        evaluate_once(tmp_path, "fail")
    error = find_error(raised.value, RewardError)  # raised out of the evaluation's task group
    assert error is not None and "failed on problem 1" in str(error)
    assert not (tmp_path / EVAL_FILE).exists()


class _LastDigitTask(_HeldOutTask):
    """The fake session's i-th response is "<version> <i>": it passes when i is the
    answer."""

    def eval_problems(self) -> list[Problem]:
        return [Problem(i, f"held out {i}", answer) for i, answer in enumerate((0, 2, 7))]

    def score(self, response: str, problem: Problem) -> RewardBreakdown:
        correct = 1.0 if response.endswith(str(problem.answer)) else 0.0
        return RewardBreakdown(correct, {"correct": correct})


def test_sampled_evaluation_reports_mean_reward_and_unbiased_pass_at_k() -> None:
    session, task = FakeSession(), _LastDigitTask()

    async def go() -> dict[str, float]:
        return await evaluate(
            session,
            SamplerHandle(1, None),
            _plan(_config(max_tokens=4), task, session),
            task.eval_problems(),
            max_tokens=4,
            samples=4,
        )

    metrics = anyio.run(go)
    # greedy: response 0, right only for answer 0; samples 0..3: one right for 0 and 2
    assert metrics["eval/pass_rate"] == pytest.approx(1 / 3)
    assert metrics["eval/sampled/reward/total"] == pytest.approx(2 / 12)
    assert metrics["eval/sampled/pass@1"] == pytest.approx((0.25 + 0.25 + 0) / 3)
    assert metrics["eval/sampled/pass@4"] == pytest.approx(2 / 3)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(5, 0, 3) == 0.0 and pass_at_k(5, 4, 2) == 1.0


class _EpisodesTask:
    """An environment task: held-out problem ``i`` is a countdown of ``1 + i`` turns;
    building problem 1's group raises."""

    name = "held-out-episodes"

    def source(self, seed: int, state: Mapping[str, Any] | None = None) -> SeededSource:
        return SeededSource(lambda rng, i: Problem(i, f"train {i}", 0), seed, state)

    def eval_problems(self) -> list[Problem]:
        return [Problem(i, f"held out {i}", i) for i in range(3)]

    def group_builder(self, problem: Problem, group_size: int, context: Any) -> Any:
        from tests.env_support import CountdownEnv, RankedGroup

        if problem.id == 1:
            return _FailingGroup()
        return RankedGroup([CountdownEnv(turns=1 + problem.id) for _ in range(group_size)])


class _FailingGroup:
    async def make_envs(self) -> list[Any]:
        raise ValueError("no simulator for this one")

    async def compute_group_rewards(self, trajectories: Any, envs: Any) -> Any:
        return []

    async def cleanup(self) -> None:
        return None


def test_held_out_episodes_of_an_environment_task_and_a_group_that_fails() -> None:
    session, task = FakeSession(), _EpisodesTask()
    plan = _plan(_config(env_max_turns=2, max_tokens=4), task, session)
    failed: list[RewardError] = []

    async def go(**kwargs: Any) -> dict[str, float]:
        return await evaluate(
            session, SamplerHandle(1, None), plan, task.eval_problems(), max_tokens=4, **kwargs
        )

    metrics = anyio.run(lambda: go(on_reward_error=failed.append))
    # problem 0: 1 turn (reward 1 + rank 1); problem 2: cut at max_turns=2 (reward 0)
    assert metrics["eval/problems"] == 2 and metrics["eval/reward_errors"] == 1
    assert metrics["eval/reward/total"] == pytest.approx(1.0)
    assert metrics["eval/success_rate"] == 0.5 and metrics["eval/turns_per_episode"] == 1.5
    [error] = failed
    assert "no simulator for this one" in str(error)
    with pytest.raises(BaseException) as raised:
        anyio.run(go)
    assert find_error(raised.value, RewardError) is not None
