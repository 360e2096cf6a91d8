"""Held-out evaluation below the seam (a fake session): the metrics, pass@k for a list of
k, the per-problem records, eval.jsonl, ``engine.eval``'s table and its errors for a bad
list of k, and a reward that raises on a held-out problem under each ``--on-reward-error``."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import anyio
import pytest

from engine.config import EngineConfig, OnRewardError, config_from_sources
from engine.envs.scoring import RewardError
from engine.errors import ConfigError, find_error
from engine.eval import format_table
from engine.eval import main as eval_main
from engine.loop.evaluation import (
    EVAL_FILE,
    Evaluation,
    Evaluator,
    HeldOutLog,
    evaluate,
    evaluate_problems,
    pass_at_k,
    problem_records,
)
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
        HeldOutLog(cfg, tmp_path, lambda step, metrics: None),
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


def _sampled(task: Any, *, samples: int, ks: tuple[int, ...] = (), **kwargs: Any) -> Evaluation:
    session = FakeSession()

    async def go() -> Evaluation:
        return await evaluate_problems(
            session,
            SamplerHandle(1, None),
            _plan(_config(max_tokens=4), task, session),
            task.eval_problems(),
            max_tokens=4,
            samples=samples,
            ks=ks,
            **kwargs,
        )

    return anyio.run(go)


def test_pass_at_k_for_a_list_of_k_keeps_pass_at_1_and_pass_at_n() -> None:
    # samples "1 0".."1 7": exactly one of the 8 passes for each answer (0, 2, 7)
    metrics = _sampled(_LastDigitTask(), samples=8, ks=(2, 4)).metrics
    passes = {k: v for k, v in metrics.items() if "pass@" in k}
    assert passes == pytest.approx(
        {
            "eval/sampled/pass@1": 1 / 8,
            "eval/sampled/pass@2": 2 / 8,
            "eval/sampled/pass@4": 4 / 8,
            "eval/sampled/pass@8": 1.0,
        }
    )
    with pytest.raises(ValueError, match="pass@9 needs at least 9 sampled responses"):
        _sampled(_LastDigitTask(), samples=8, ks=(2, 9))


def test_problem_records_hold_prompts_responses_and_rewards_with_bounded_texts() -> None:
    task = _LastDigitTask()
    evaluation = _sampled(task, samples=4)
    session = FakeSession()
    records = problem_records(evaluation, PromptRenderer(task, session.tokenizer), texts=2)
    assert [r["answer"] for r in records] == [0, 2, 7]
    first, second, _ = records
    assert first["prompt"] == "held out 0" and first["reward_error"] is None
    assert first["greedy"] == {
        "response": "1 0",
        "reward": 1.0,
        "components": {"correct": 1.0},
        "passed": True,
    }
    # every sampled response keeps its reward; only the first 2 keep their text
    assert [s.get("response") for s in second["samples"]] == ["1 0", "1 1", None, None]
    assert [s["reward"] for s in second["samples"]] == [0.0, 0.0, 1.0, 0.0]
    assert [s["passed"] for s in second["samples"]] == [False, False, True, False]
    assert all(s["components"] == {"correct": s["reward"]} for s in second["samples"])


def test_problem_records_say_which_problem_was_left_out_and_why() -> None:
    task = _HeldOutTask()
    evaluation = _sampled(task, samples=1, on_reward_error=lambda error: None)
    records = problem_records(evaluation, PromptRenderer(task, FakeSession().tokenizer), texts=1)
    left_out = records[1]
    assert left_out["greedy"] is None and left_out["samples"] == []
    assert "no answer key for this one" in left_out["reward_error"]
    assert records[0]["greedy"]["passed"] and not records[2]["greedy"]["passed"]


def test_episode_records_give_the_transcript_after_the_prompt_and_the_outcome() -> None:
    task = _EpisodesTask()
    session = FakeSession()
    plan = _plan(_config(env_max_turns=2, max_tokens=4), task, session)

    async def go() -> Evaluation:
        return await evaluate_problems(
            session,
            SamplerHandle(1, None),
            plan,
            task.eval_problems(),
            max_tokens=4,
            on_reward_error=lambda error: None,
        )

    renderer = PromptRenderer(task, session.tokenizer)
    one_turn, _, cut = problem_records(anyio.run(go), renderer, texts=0)
    assert "outcome" not in one_turn["greedy"]  # one turn, done
    assert one_turn["greedy"]["response"] == "1 0"
    assert cut["greedy"]["outcome"] == "max_turns" and cut["greedy"]["turns"] == 2
    assert one_turn["prompt"] == "go:" and cut["greedy"]["response"] == "1 0|1 0"


def test_training_evaluates_pass_at_k_for_eval_k_and_keeps_its_metric_names(
    tmp_path: Path,
) -> None:
    session, task = FakeSession(), _LastDigitTask()
    cfg = _config(steps=1, eval_every=1, max_tokens=4, eval_k=(2,))
    assert cfg.evaluation.samples_drawn == 2  # --eval-samples unset: the largest k
    held_out = HeldOutLog(cfg, tmp_path, lambda step, metrics: None)
    evaluator = Evaluator(session, _plan(cfg, task, session), task.eval_problems(), cfg, held_out)

    async def go() -> dict[str, float]:
        return await evaluator(1, SamplerHandle(1, None))

    metrics = anyio.run(go)
    assert {k for k in metrics if "pass@" in k} == {"eval/sampled/pass@1", "eval/sampled/pass@2"}
    [record] = [json.loads(line) for line in (tmp_path / EVAL_FILE).read_text().splitlines()]
    assert record == {"step": 1, "sampler_version": 1, **metrics}
    wider = _config(steps=1, eval_every=1, eval_samples=8, eval_k=(2, 4))
    assert wider.evaluation.samples_drawn == 8


def test_eval_k_from_flags_environment_and_its_one_line_errors() -> None:
    assert config_from_sources({}, {"ENGINE_EVAL_K": "4,1,4"}).evaluation.eval_k == (4, 1)
    assert config_from_sources({"eval_k": "1,8"}, {}).evaluation.samples_drawn == 8
    with pytest.raises(ConfigError, match=r"--eval-k must be comma-separated integers, got '1,a'"):
        config_from_sources({"eval_k": "1,a"}, {})
    with pytest.raises(ConfigError, match=r"--eval-k must be positive integers, got '0,2'"):
        config_from_sources({"eval_k": "0,2"}, {})
    with pytest.raises(
        ConfigError,
        match=r"--eval-k pass@8 needs at least 8 sampled responses per problem, and 4 are drawn",
    ):
        config_from_sources({"eval_k": "1,8", "eval_samples": "4"}, {})


def test_the_eval_table_shows_component_means_and_pass_at_k_in_order_of_k() -> None:
    metrics = {
        "problems": 3.0,
        "reward/total": 0.5,
        "pass_rate": 0.25,
        "exact": 0.25,
        "exact/rate": 0.25,
        "close": 0.75,
        "close/rate": 1.0,
        "sampled/reward/total": 0.5,
        "sampled/pass@1": 0.1,
        "sampled/pass@16": 0.9,
        "sampled/pass@4": 0.4,
    }
    result = {"task": "t", "step": 2, "samples": 16, "temperature": 1.0, "metrics": metrics}
    rows = [line.split(" | ")[0].removeprefix("| ") for line in format_table(result).splitlines()]
    assert rows[3:] == [
        "reward/total",
        "close",
        "exact",
        "pass_rate",
        "sampled/reward/total",
        "sampled/pass@1",
        "sampled/pass@4",
        "sampled/pass@16",
    ]


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--k", "1,x"], "--k must be comma-separated integers, got '1,x'"),
        (["--k", ","], "--k must name at least one k, e.g. 1,4,8, got ','"),
        (["--k", "0"], "--k must be positive integers, got '0'"),
        (
            ["--k", "1,8", "--samples", "4"],
            "--k pass@8 needs at least 8 sampled responses per problem, and 4 are drawn "
            "(--samples 4)",
        ),
    ],
)
def test_a_bad_list_of_k_is_a_one_line_error_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], error: str
) -> None:
    assert eval_main([str(tmp_path / "no-such-run"), *argv]) == 2
    assert capsys.readouterr().err == f"Error: {error}\n"


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (
            ["--temperature", "0"],
            "--temperature must be > 0 (the greedy responses are evaluated anyway), got 0.0",
        ),
        (["--max-tokens", "0"], "argument --max-tokens: must be an integer >= 1, got '0'"),
        (["--samples", "-1"], "--samples must be >= 0, got -1"),
    ],
)
def test_bad_sampling_flags_are_the_parsers_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], error: str
) -> None:
    """In the flags' own words (they were the config's field names, or its reason for
    training), before the checkpoint is looked at."""
    with pytest.raises(SystemExit) as exit_:
        eval_main([str(tmp_path / "no-such-run"), *argv])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == f"Error: {error} (see --help)\n"
