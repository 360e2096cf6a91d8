"""SFT, then RL on its result, as one command (``--then``; engine/stages.py), on the
fake session (tests/fake_session.py): both stages on one session, the second from the
first's final weights with a fresh optimizer, each in its run dir; a stop in either
stage resumed with ``--resume RUN`` trains every step of both exactly once; bad
combinations are one line (exit 2), checked after a resume's stored settings are
merged. The real local server and both SDK generations: tests/test_stages_cli.py and
tests/test_sdk_matrix.py."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from test_pipeline_stages import config
from test_sft import ChatSession, conversations

from engine import EngineConfig, Stages
from engine.errors import ConfigError, ResumeError
from engine.loop.results import RunResult, StepResult
from engine.run import main, parse_config
from engine.rundir.teacher_weights import teacher_weights
from engine.stages import second_stage_config

pytestmark = pytest.mark.anyio

TOY = "test_pipeline_stages:ToyTask"


def chain_config(root: Path, data: Path, **changes: Any) -> EngineConfig:
    """SFT for 4 steps (batch 2), then RL on the toy task for 3 (batch 2)."""
    base: dict[str, Any] = {
        "task": f"jsonl:{data}",
        "objective": "sft",
        "run_dir": root,
        "checkpoint_every": 1,
        "progress": False,
        "then": "rl",
        "then_task": TOY,
        "then_steps": 3,
        "then_batch": 2,
    }
    return config(**{**base, **changes})


async def run_chain(
    cfg: EngineConfig, session: ChatSession, stop_at: tuple[str, int] | None = None
) -> tuple[RunResult, list[StepResult]]:
    """Run the stages; ``stop_at`` (objective, step) asks for a stop after that step."""
    steps: list[StepResult] = []
    stages = Stages(cfg, session=session, on_step=steps.append)

    def stop(step: StepResult) -> None:
        stage = "sft" if "sft/loss" in step.metrics else "rl"
        if (stage, step.step) == stop_at:
            stages.request_stop()

    stages.add_step_hook(stop)
    return await stages.run(), steps


def trained(run_dir: Path) -> list[tuple[int, list[int]]]:
    """Each step of a run dir's metrics.jsonl with the problems it trained."""
    rows = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return [(row["step"], row["problem_ids"]) for row in rows]


async def test_both_stages_run_on_one_session_the_second_from_the_first_final_weights(
    tmp_path: Path,
) -> None:
    root = tmp_path / "run"
    session = ChatSession()
    result, steps = await run_chain(
        chain_config(root, conversations(tmp_path / "c.jsonl", 20)), session
    )
    assert result.run_dir == root / "rl" and not result.stopped
    assert result.final_path == "fake://sampler/toy-final"  # the last stage's result
    assert [s for s, _ in trained(root)] == [1, 2, 3, 4]
    assert [s for s, _ in trained(root / "rl")] == [1, 2, 3]
    assert [s.step for s in steps] == [1, 2, 3, 4, 1, 2, 3]
    # The second stage loads the first's final weights (4 optimizer steps) without its
    # optimizer state, before it trains; SFT trains with cross_entropy, RL with ppo.
    weights = session.index(("restore_weights", 4))
    assert weights < session.log.index(("forward_backward", 1), session.index(("finished", 4)))
    assert [loss.name for loss in session.losses] == ["cross_entropy"] * 4 + ["ppo"] * 3
    second = json.loads((root / "rl" / "config.json").read_text())
    assert second["model"]["init_from"] == "tinker://fake-model-0/weights/final"
    assert second["training"]["objective"] == "rl" and second["task"]["spec"] == TOY
    assert second["then"]["objective"] is None and second["pipeline"]["steps"] == 3
    first = json.loads((root / "config.json").read_text())
    assert first["then"]["objective"] == "rl" and first["training"]["objective"] == "sft"
    for run_dir in (root, root / "rl"):
        assert json.loads((run_dir / "summary.json").read_text())["status"] == "finished"


async def test_a_stop_in_either_stage_resumes_both_with_every_step_once(
    tmp_path: Path,
) -> None:
    data = conversations(tmp_path / "c.jsonl", 20)
    await run_chain(chain_config(tmp_path / "whole", data), ChatSession())
    for stop_at in (("sft", 2), ("rl", 2)):
        root = tmp_path / stop_at[0]
        session = ChatSession()
        stopped, before = await run_chain(chain_config(root, data), session, stop_at=stop_at)
        assert stopped.stopped
        assert (root / "rl").exists() == (stop_at[0] == "rl")
        result, after = await run_chain(chain_config(root, data, resume=root), session)
        assert result.run_dir == root / "rl" and not result.stopped
        for stage in (Path(), Path("rl")):  # each step once, the same problems as unstopped
            assert trained(root / stage) == trained(tmp_path / "whole" / stage)
        # The stop came after the step in flight; the resume trains the steps after it,
        # and a finished SFT stage is not run again.
        for metric, last in (("sft/loss", 4), ("avg_reward", 3)):
            done = [s.step for s in before if metric in s.metrics]
            assert [s.step for s in after if metric in s.metrics] == list(
                range(len(done) + 1, last + 1)
            )


async def test_a_finished_chain_resumed_with_more_steps_continues_its_second_stage(
    tmp_path: Path,
) -> None:
    root = tmp_path / "run"
    session = ChatSession()
    data = conversations(tmp_path / "c.jsonl", 20)
    await run_chain(chain_config(root, data), session)
    changed = chain_config(root, data, resume=root, then_task="arithmetic")
    with pytest.raises(ResumeError, match=r"then\.task is 'test_pipeline_stages:ToyTask'"):
        await run_chain(changed, session)  # the first stage is done: checked here
    result, after = await run_chain(chain_config(root, data, resume=root, then_steps=5), session)
    assert [s.step for s in after] == [4, 5] and result.steps_completed == 5
    assert [s for s, _ in trained(root)] == [1, 2, 3, 4]
    ids = [i for _, step in trained(root / "rl") for i in step]
    assert ids == list(range(10))


async def test_a_bad_second_stage_stops_the_command_before_the_first_trains(
    tmp_path: Path,
) -> None:
    session = ChatSession()
    data = conversations(tmp_path / "c.jsonl", 20)
    cfg = chain_config(tmp_path / "run", data, then_task=f"jsonl:{tmp_path / 'missing.jsonl'}")
    with pytest.raises(ConfigError, match=r"missing\.jsonl"):
        await run_chain(cfg, session)
    assert session.log == []


def test_the_second_stage_takes_its_own_settings_and_shares_the_rest(tmp_path: Path) -> None:
    first = chain_config(
        tmp_path / "run",
        tmp_path / "c.jsonl",
        learning_rate=2e-3,
        batch=16,
        eval_every=20,
        max_tokens=12,
        then_task_args={"reward": "exact"},
    )
    second = second_stage_config(first, tmp_path / "run" / "rl", "tinker://m/weights/final")
    assert second.training.objective == "rl" and second.task.spec == TOY
    assert second.task.args == {"reward": "exact"}
    assert (second.pipeline.steps, second.pipeline.batch) == (3, 2)
    assert second.training.learning_rate is None  # the server's recommendation, not 2e-3
    assert second.evaluation.eval_every == 0
    assert second.sampling.max_tokens == 12 and second.model == first.model.model_copy(
        update={"init_from": "tinker://m/weights/final"}
    )
    assert second.logging.run_dir == tmp_path / "run" / "rl"
    assert second.checkpoints.resume is None and second.then.objective is None
    distill = chain_config(tmp_path / "d", tmp_path / "c.jsonl", then="distill", then_teacher="t")
    later = second_stage_config(distill, tmp_path / "d" / "distill", "tinker://m/weights/final")
    assert (later.training.objective, later.distillation.teacher) == ("distill", "t")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--objective", "sft", "--then", "sft"], "--then sft: a second stage is rl or distill"),
        (["--then", "rl"], "--then rl follows a first stage (an --objective sft run), not"),
        (["--then-steps", "3"], "--then-steps set a second stage's settings: add --then rl"),
        (
            ["--objective", "sft", "--then", "distill"],
            "--then distill needs --then-teacher",
        ),
        (
            ["--objective", "sft", "--then", "rl", "--then-teacher", "runs/t"],
            "--then-teacher needs --then distill",
        ),
    ],
)
def test_bad_combinations_are_one_line_and_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--local", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err


async def test_then_settings_on_resume_are_checked_after_the_stored_ones(
    tmp_path: Path,
) -> None:
    root = tmp_path / "run"
    data = conversations(tmp_path / "c.jsonl", 20)
    await run_chain(chain_config(root, data), ChatSession())
    resumed = parse_config(["--resume", str(root), "--then-steps", "5"], {})
    assert resumed.then.objective == "rl" and resumed.then.steps == 5
    with pytest.raises(ConfigError, match=re.escape(f"is the second stage of {root}: resume both")):
        parse_config(["--resume", str(root / "rl")], {})
    (tmp_path / "plain").mkdir()
    plain = chain_config(tmp_path / "plain", data, then=None, then_task=None, then_steps=None)
    (tmp_path / "plain" / "config.json").write_text(
        json.dumps({**plain.public_dict(), "task_name": "sft", "then": {}})
    )
    with pytest.raises(ConfigError, match="--then-steps set a second stage's settings"):
        parse_config(["--resume", str(tmp_path / "plain"), "--then-steps", "5"], {})


def test_the_shipped_toml_is_the_documented_command() -> None:
    root = Path(__file__).resolve().parents[1]
    from_file = parse_config(["--config", str(root / "examples" / "sft_then_rl.toml")], {})
    flags = parse_config(
        [
            *("--objective", "sft", "--task", "jsonl:examples/sft_repeat.jsonl"),
            *("--task-arg", "eval_size=100", "--eval-every", "20", "--steps", "20"),
            *("--batch", "16", "--lr", "2e-3", "--max-tokens", "4", "--group", "8"),
            *("--temperature", "1.0", "--then", "rl"),
            *("--then-task", "jsonl:examples/rl_repeat.jsonl", "--then-task-arg", "reward=exact"),
            *("--then-task-arg", "eval_size=45", "--then-eval-every", "10"),
            *("--then-steps", "30"),
        ],
        {},
    )
    assert from_file.public_dict() == flags.public_dict()
    assert from_file.then.task_args == {"reward": "exact", "eval_size": "45"}


def test_a_second_stage_teacher_is_copied_from_its_first_stage_dir(tmp_path: Path) -> None:
    """``--teacher RUN/rl``: a second stage keeps its weights in its first stage's
    ``local-server/``; they are copied into the student's server dir from there."""
    root = tmp_path / "run"
    (root / "rl").mkdir(parents=True)
    saved = root / "local-server" / "m" / "sampler_weights" / "final"
    saved.mkdir(parents=True)
    (saved / "adapter.safetensors").write_bytes(b"weights")
    record = {"step": 3, "state_path": "tinker://m/weights/final", "reason": "final"}
    record["sampler_path"] = "tinker://m/sampler_weights/final"
    (root / "rl" / "checkpoints.jsonl").write_text(json.dumps(record) + "\n")
    student = tmp_path / "student" / "local-server"
    assert teacher_weights(str(root / "rl"), student) == "tinker://m/sampler_weights/final"
    copied = student / "m" / "sampler_weights" / "final" / "adapter.safetensors"
    assert copied.read_bytes() == b"weights"
