"""On-policy distillation (``--objective distill``): the per-token advantage arithmetic,
the teacher's scores of every action token, resume and the refusals, on the fake
session (tests/fake_session.py). No server; the end-to-end run is in
tests/test_distill_local.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fake_session import FakeSession
from test_engine_fake_session import fake_config, run, run_stopped_after_first
from test_envs_pipeline import CountdownTask
from test_pipeline_stages import ToyTask

from engine import EngineConfig
from engine.core.datums import DistillSignal, group_datums, reverse_kl
from engine.core.problems import RewardBreakdown
from engine.core.trajectory import Trajectory, Turn
from engine.core.trajectory_json import trajectory_from_dict, trajectory_to_dict
from engine.errors import (
    ConfigError,
    EngineError,
    PermanentServiceError,
    RetriesExhausted,
    exit_code,
    format_error,
)
from engine.loop.teacher import TeacherFailed, tokenizer_mismatch
from engine.objectives import checked_objective
from engine.rollouts import main as rollouts_main
from engine.rundir.teacher_weights import teacher_weights

pytestmark = pytest.mark.anyio


def turn(
    obs: tuple[int, ...], action: tuple[int, ...], student: float, teacher: list[float]
) -> Turn:
    return Turn(obs, action, (student,) * len(action), 0, "stop", teacher_logprobs=tuple(teacher))


def distilled(**changes: Any) -> dict[str, Any]:
    return {"objective": "distill", "teacher": "fake-model", **changes}


def test_each_action_token_gets_coef_times_teacher_minus_student_plus_weighted_reward() -> None:
    signal = DistillSignal(coef=2.0, reward_weight=0.5)
    better = Trajectory(
        (turn((1, 2), (3, 4), -0.5, [-0.25, -1.5]),), group_reward=RewardBreakdown(1.0)
    )
    worse = Trajectory((turn((1, 2), (5,), -1.0, [-1.0]),), group_reward=RewardBreakdown(0.0))
    built = group_datums([better, worse], distill=signal)
    assert built.advantages == [0.5, -0.5]  # the group-relative ones, as in RL
    first, second = built.datums
    # positions predict tokens 2, 3, 4: the prompt token gets nothing
    np.testing.assert_allclose(first.loss_fn_inputs["weights"], [0, 1, 1])
    np.testing.assert_allclose(
        first.loss_fn_inputs["advantages"], [0, 2 * 0.25 + 0.25, 2 * -1.0 + 0.25]
    )
    np.testing.assert_allclose(second.loss_fn_inputs["advantages"], [0, 0 - 0.25])


def test_a_constant_reward_group_still_trains_on_the_teacher_signal() -> None:
    same = [Trajectory((turn((1,), (2,), -1.0, [-0.5]),)) for _ in range(2)]
    assert group_datums(same).datums == []  # RL: no reward difference, nothing to learn
    built = group_datums(same, distill=DistillSignal())
    assert [d.loss_fn_inputs["advantages"].tolist() for d in built.datums] == [[0.5], [0.5]]


def test_every_action_token_of_a_multi_turn_episode_gets_its_own_advantage() -> None:
    episode = Trajectory(
        (
            turn((1,), (2, 3), -1.0, [-1.0, -3.0]),
            turn((1, 2, 3, 9), (4,), -2.0, [-0.5]),  # extends the context: one datum
        )
    )
    (datum,) = group_datums([episode], distill=DistillSignal()).datums
    np.testing.assert_allclose(datum.loss_fn_inputs["weights"], [1, 1, 0, 1])
    np.testing.assert_allclose(datum.loss_fn_inputs["advantages"], [0, -2, 0, 1.5])
    assert reverse_kl([episode]) == (0.0 + 2.0 - 1.5, -4.5, 3)


def test_a_turn_without_teacher_logprobs_never_trains_as_zeros() -> None:
    plain = Trajectory((Turn((1,), (2,), (-1.0,), 0, "stop"),))
    with pytest.raises(EngineError, match="without the teacher's logprob"):
        group_datums([plain], distill=DistillSignal())


def test_checkpoints_keep_the_teacher_logprobs() -> None:
    episode = Trajectory((turn((1,), (2, 3), -1.0, [-0.5, -0.25]),))
    assert trajectory_from_dict(json.loads(json.dumps(trajectory_to_dict(episode)))) == episode
    plain = Trajectory((Turn((1,), (2,), (-1.0,), 0, "stop"),))
    assert "teacher_logprobs" not in trajectory_to_dict(plain)["turns"][0]


def test_distill_and_teacher_come_together() -> None:
    with pytest.raises(ConfigError, match="--objective distill needs --teacher"):
        checked_objective(EngineConfig(objective="distill"))
    with pytest.raises(ConfigError, match="--teacher needs --objective distill"):
        checked_objective(EngineConfig(teacher="tinker://x/sampler_weights/y"))
    with pytest.raises(ConfigError, match="--distill-coef is a setting of --objective distill"):
        checked_objective(EngineConfig(distill_coef=2.0))
    second = EngineConfig(objective="sft", then="distill", then_teacher="base", distill_coef=2.0)
    assert checked_objective(second).name == "sft"


def test_a_run_directory_teacher_is_its_latest_sampler_weights(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="without a checkpoint that has sampler weights"):
        teacher_weights(str(tmp_path))
    (tmp_path / "checkpoints.jsonl").write_text(
        json.dumps({"step": 4, "state_path": "tinker://m/weights/a", "reason": "final"})
        + "\n"
        + json.dumps(
            {
                "step": 8,
                "state_path": "tinker://m/weights/b",
                "sampler_path": "tinker://m/sampler_weights/b",
                "reason": "final",
            }
        )
        + "\n"
    )
    assert teacher_weights(str(tmp_path)) == "tinker://m/sampler_weights/b"
    assert teacher_weights("some/base-model") == "some/base-model"


class VocabTokenizer:
    eos_token_id = 0

    def __init__(self, size: int) -> None:
        self._vocab = {f"t{i}": i for i in range(size)}

    def get_vocab(self) -> dict[str, int]:
        return self._vocab


def test_tokenizers_match_by_vocabulary_and_end_token() -> None:
    assert tokenizer_mismatch(VocabTokenizer(4), VocabTokenizer(4)) is None
    assert "vocabulary of 5 tokens is not the student's 4" in str(
        tokenizer_mismatch(VocabTokenizer(4), VocabTokenizer(5))
    )


async def test_a_teacher_with_another_tokenizer_is_refused_before_any_step(
    tmp_path: Path,
) -> None:
    session = FakeSession(teacher_tokenizer=VocabTokenizer(7))
    with pytest.raises(ConfigError, match="has another tokenizer than the student") as caught:
        await run(fake_config(tmp_path / "run", **distilled()), ToyTask(), session)
    assert caught.value.exit_code == 2
    assert not any(entry[0] == "forward_backward" for entry in session.log)


async def test_every_sampled_token_is_trained_toward_the_teacher(tmp_path: Path) -> None:
    session = FakeSession()
    steps = await run(fake_config(tmp_path / "run", **distilled()), ToyTask(), session)
    assert [s.step for s in steps] == [1, 2, 3, 4]
    scored = sum(1 for entry in session.log if entry[0] == "teacher_logprobs")
    assert scored == 4 * 2 * 2  # steps x batch x group: one request per turn
    for step in steps:
        for datum in step.datums:
            weights = datum.loss_fn_inputs["weights"]
            # the fake student samples each token at -0.5, the fake teacher scores -1.0
            np.testing.assert_allclose(datum.loss_fn_inputs["advantages"], -0.5 * weights)
        assert step.metrics["distill/reverse_kl"] == pytest.approx(0.5)
        assert step.metrics["distill/teacher_logprob"] == pytest.approx(-1.0)
        assert 0.0 <= step.metrics["distill/teacher_frac"] <= 1.0
        assert "reverse_kl=0.5000" in step.line
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert all("distill/reverse_kl" in json.loads(line) for line in lines)


async def test_a_distilled_runs_rollouts_show_each_turns_reverse_kl(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    await run(fake_config(tmp_path / "run", **distilled()), ToyTask(), FakeSession())
    assert rollouts_main([str(tmp_path / "run"), "--step", "2"]) == 0
    responses = [line for line in capsys.readouterr().out.splitlines() if "| '" in line]
    assert responses and all("kl +0.500 teacher -1.000 |" in line for line in responses)
    await run(fake_config(tmp_path / "env", **distilled()), CountdownTask(), FakeSession())
    assert rollouts_main([str(tmp_path / "env"), "--step", "2"]) == 0
    actions = [line for line in capsys.readouterr().out.splitlines() if "action [" in line]
    assert actions and all("kl +0.500 teacher -1.000: " in line for line in actions)


async def test_an_environments_every_action_token_gets_its_teacher_logprob(
    tmp_path: Path,
) -> None:
    session = FakeSession()
    steps = await run(fake_config(tmp_path / "run", **distilled()), CountdownTask(), session)
    turns = [t for s in steps for g in s.groups for e in g.trajectories for t in e.turns]
    assert turns and all(t.teacher_logprobs == (-1.0,) * len(t.action) for t in turns)
    assert sum(1 for entry in session.log if entry[0] == "teacher_logprobs") == len(turns)


async def test_a_resumed_distillation_trains_each_problem_once_with_kept_scores(
    tmp_path: Path,
) -> None:
    session = FakeSession()
    cfg = fake_config(tmp_path / "run", **distilled(steps=3))
    first, result = await run_stopped_after_first(cfg, ToyTask(), session)
    assert result.stopped
    records = (tmp_path / "run" / "checkpoints.jsonl").read_text().splitlines()
    pending = json.loads(records[-1])["loop_state"]["pending_groups"]
    assert pending  # K=1: the next step's groups were sampled and kept
    assert all(
        t["teacher_logprobs"] is not None
        for g in pending
        for e in g["trajectories"]
        for t in e["turns"]
    )
    asked = sum(1 for entry in session.log if entry[0] == "teacher_logprobs")
    second = await run(cfg.replace(resume=tmp_path / "run"), ToyTask(), session)
    trained = [g.problem.id for s in first + second for g in s.groups]
    assert trained == list(range(6))  # each once
    asked_after = sum(1 for entry in session.log if entry[0] == "teacher_logprobs")
    fresh = sum(len(s.groups) for s in second) - len(pending)
    assert asked_after - asked == fresh * 2  # the kept groups are not asked again
    assert all(s.metrics["distill/reverse_kl"] == pytest.approx(0.5) for s in second)


async def test_a_teacher_that_fails_mid_run_stops_the_run_after_a_checkpoint(
    tmp_path: Path,
) -> None:
    session = FakeSession(teacher_fails_after=6)
    with pytest.raises(RuntimeError, match="the fake teacher is gone"):
        await run(fake_config(tmp_path / "run", **distilled()), ToyTask(), session)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["steps_completed"] >= 1
    records = (tmp_path / "run" / "checkpoints.jsonl").read_text().splitlines()
    assert json.loads(records[-1])["step"] == summary["steps_completed"]


TEACHER_FAILURES = {
    # the server kept answering 503 past the retries
    "server-error": RetriesExhausted(
        "compute_logprobs failed after 3 attempts: HTTP 503 service unavailable",
        kind="sample",
        attempts=3,
        transient=True,
    ),
    # the teacher's sampler weights were deleted: refused at once
    "weights-gone": PermanentServiceError(
        "compute_logprobs failed: HTTP 404 sampler weights not found",
        kind="sample",
        attempts=1,
        transient=False,
    ),
}


@pytest.mark.parametrize("failure", list(TEACHER_FAILURES))
async def test_a_teacher_failing_mid_run_is_one_line_a_stop_checkpoint_and_a_full_resume(
    tmp_path: Path, failure: str
) -> None:
    error = TEACHER_FAILURES[failure]
    session = FakeSession(teacher_fails_after=6, teacher_error=error)
    cfg = fake_config(tmp_path / "run", **distilled(steps=4))
    with pytest.raises(TeacherFailed) as caught:
        await run(cfg, ToyTask(), session)
    line = format_error(caught.value)
    assert line == f"Error: the teacher fake-model failed: {error}; a teacher must stay " + (
        "reachable for the whole run (resume once it is)"
    )
    assert exit_code(caught.value) == 1
    run_dir = tmp_path / "run"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and "the teacher fake-model failed" in summary["error"]
    done = summary["steps_completed"]
    assert 1 <= done < 4  # 6 requests: step 1's 4, then the failure during step 2's
    last = json.loads((run_dir / "checkpoints.jsonl").read_text().splitlines()[-1])
    assert last["step"] == done and last["reason"] == "error"  # the stop checkpoint
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    [stopped] = [e for e in events if e["event"] == "run.stopped"]
    assert (
        f"resume from step {done} with: python -m engine.run --resume {run_dir}"
        in (stopped["message"])
    )

    session.teacher_fails_after = None  # the teacher is back
    await run(cfg.replace(resume=run_dir), ToyTask(), session)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    trained = [i for r in rows for i in r["problem_ids"]]
    assert trained == list(range(8))  # every problem once: none lost, none twice
    assert all(r["distill/reverse_kl"] == pytest.approx(0.5) for r in rows)
