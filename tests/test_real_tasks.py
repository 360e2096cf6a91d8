"""Real tasks end to end on the local server: a JSONL dataset task with held-out eval,
rollouts.jsonl, the dataset cursor across --resume, embedded runs resumed from the CLI,
stop strings, --init-from, chat prompts under the Qwen3 alias, and the console script."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from transformers import AutoTokenizer

from engine import Engine, EngineConfig
from engine.envs.scoring import RewardError
from engine.local import LocalServer
from engine.rollouts import main as rollouts_main
from engine.run import main as run_main
from engine.tasks import ArithmeticTask, Problem, RewardBreakdown
from engine.tasks.dataset import DatasetTask
from scripts.make_model import DEFAULT_OUT
from tests.engine_support import API_KEY, run_engine, small_config
from tests.user_tasks import ChatDigitCountTask, DigitCountTask

# A real-server end-to-end set: deselected by default, run with -m slow (CI runs both).
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server() -> Iterator[LocalServer]:
    with LocalServer() as s:
        yield s


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    rows = [
        {"messages": [{"role": "user", "content": f"What is {a} + {a + 7}?"}], "answer": 2 * a + 7}
        for a in range(10, 30)
    ]
    path = tmp_path / "sums.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def task_config(server: LocalServer, run_dir: Path, **overrides: Any) -> EngineConfig:
    """small_config without its arithmetic settings (they only apply to that task)."""
    return small_config(server, run_dir, op=None, min_operand=None, max_operand=None, **overrides)


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_dataset_task_logs_eval_and_readable_rollouts(
    server: LocalServer, dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    config = task_config(
        server,
        run_dir,
        task=f"jsonl:{dataset}",
        task_args={"eval_size": "6"},
        eval_every=2,
        log_rollouts=2,
        steps=3,
    )
    steps, _ = run_engine(config)
    evals = lines(run_dir / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 2, 3]  # start, every 2, last
    assert all(e["eval/problems"] == 6 and 0 <= e["eval/correct/rate"] <= 1 for e in evals)
    assert "eval/correct/rate" in steps[1].metrics and "eval/correct/rate" not in steps[0].metrics
    assert "exact_rate" in steps[0].metrics
    rollouts = lines(run_dir / "rollouts.jsonl")
    assert [r["step"] for r in rollouts] == [1, 1, 2, 2, 3, 3]
    first = rollouts[0]
    episodes = first["episodes"]
    assert {e["turns"][0]["observation"] for e in episodes} == {
        f"<s>Question: {first['question']}\nAnswer:"
    }
    assert first["sampler_version"] == 0 and len(episodes) == config.pipeline.group
    group = steps[0].groups[0]
    assert [e["reward"] for e in episodes] == group.totals
    assert [e["advantage"] for e in episodes] == list(steps[0].advantages[0])
    assert sum(e["advantage"] for e in episodes) == pytest.approx(0.0, abs=1e-9)
    actions = [e["turns"][0]["action"] for e in episodes]
    assert all("</s>" not in a for a in actions)  # special tokens stripped
    capsys.readouterr()
    assert rollouts_main([str(run_dir), "--step", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("step 2 - problem") == 2 and "correct=" in out
    config_json = json.loads((run_dir / "config.json").read_text())
    assert config_json["task"] == {
        "spec": f"jsonl:{dataset.resolve()}",
        "args": {"eval_size": "6"},
        "seed": 42,
    }


def test_the_default_task_evaluates_its_held_out_pairs(server: LocalServer, tmp_path: Path) -> None:
    """--eval-every works with the arithmetic task out of the box: 64 held-out pairs,
    none of them among the training problems."""
    run_dir = tmp_path / "run"
    steps, _ = run_engine(small_config(server, run_dir, eval_every=2, steps=2))
    evals = lines(run_dir / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 2]
    assert all(e["eval/problems"] == 64 and "eval/exact_bonus/rate" in e for e in evals)
    held_out = {p.question for p in ArithmeticTask("+", 10, 99).eval_problems()}
    trained = [g.problem.question for s in steps for g in s.groups]
    assert len(trained) == 8 and held_out.isdisjoint(trained)


def test_dataset_cursor_across_cli_resume_matches_an_uninterrupted_run(
    server: LocalServer, dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """6 training rows, 4 per step: steps cross epochs. Run B is started embedded with a
    task object, stopped after 2 steps and resumed from the command line."""
    args = {"eval_size": "14"}  # 20 rows - 14 held out = 6 training rows
    whole, _ = run_engine(
        task_config(server, tmp_path / "a", task=f"jsonl:{dataset}", task_args=args, steps=4)
    )
    task = DatasetTask.from_args(str(dataset), args)
    run_engine(small_config(server, tmp_path / "b", steps=2), task=task)
    monkeypatch.setenv("MINT_BASE_URL", server.base_url)
    monkeypatch.setenv("MINT_API_KEY", API_KEY)
    assert run_main(["--resume", str(tmp_path / "b"), "--steps", "4", "--no-progress"]) == 0
    resumed = lines(tmp_path / "b" / "metrics.jsonl")
    assert [m["step"] for m in resumed] == [1, 2, 3, 4]
    assert [m["problems/digest"] for m in resumed] == [s.metrics["problems/digest"] for s in whole]
    assert [m["problem_ids"] for m in resumed] == [s.metrics["problem_ids"] for s in whole]


def test_hf_dataset_from_the_command_line_evaluates_its_test_split(
    server: LocalServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A DatasetDict written by save_to_disk, trained from its train split and evaluated
    on its test split, offline (HF_HUB_OFFLINE=1), from the command line."""
    import datasets

    rows = [
        {"question": f"What is {a} + {a + 7}?", "answer": 2 * a + 7, "source": "synthetic"}
        for a in range(10, 30)
    ]
    data = tmp_path / "sums"
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list(rows[:14]),
            "test": datasets.Dataset.from_list(rows[14:]),
        }
    ).save_to_disk(str(data))
    monkeypatch.setenv("MINT_BASE_URL", server.base_url)
    monkeypatch.setenv("MINT_API_KEY", API_KEY)
    run_dir = tmp_path / "run"
    argv = [
        *("--task", f"hf:{data}", "--task-arg", "eval_split=test", "--task-arg", "reward=numeric"),
        *("--eval-every", "2", "--steps", "2", "--batch", "4", "--group", "4"),
        *("--max-tokens", "8", "--lr", "3e-3", "--lora-rank", "8", "--base-model"),
        *(server.model_name, "--run-dir", str(run_dir), "--no-progress"),
    ]
    assert run_main(argv) == 0
    out = capsys.readouterr().out
    assert "Eval after step 2: reward=" in out and "(6 held-out problems, greedy)" in out
    assert [e["step"] for e in lines(run_dir / "eval.jsonl")] == [0, 2]
    config_json = json.loads((run_dir / "config.json").read_text())
    assert (config_json["task"]["spec"], config_json["task_name"]) == (
        f"hf:{data.resolve()}",
        "hf-sums",
    )
    drawn = {i for m in lines(run_dir / "metrics.jsonl") for i in m["problem_ids"]}
    assert drawn == set(range(8))  # 2 steps of 4 draws from the 14 training rows


def test_embedded_user_task_resumes_from_the_cli(
    server: LocalServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tmp_path / "run"
    run_engine(small_config(server, run_dir, steps=1), task=DigitCountTask())
    config = json.loads((run_dir / "config.json").read_text())
    assert (config["task"]["spec"], config["task"]["args"]) == (
        "tests.user_tasks:DigitCountTask",
        {},
    )
    monkeypatch.setenv("MINT_BASE_URL", server.base_url)
    monkeypatch.setenv("MINT_API_KEY", API_KEY)
    assert run_main(["--resume", str(run_dir), "--steps", "2", "--no-progress"]) == 0
    assert [m["step"] for m in lines(run_dir / "metrics.jsonl")] == [1, 2]


def test_task_args_reach_a_user_factory(server: LocalServer, tmp_path: Path) -> None:
    config = task_config(
        server,
        tmp_path / "run",
        task="tests.user_tasks:ScaledDigitCountTask",
        task_args={"scale": "0"},
        steps=1,
    )
    steps, _ = run_engine(config)
    assert steps[0].metrics["avg_reward"] == 0.0
    assert json.loads((tmp_path / "run" / "config.json").read_text())["task_name"] == (
        "digit-count-x0"
    )


class _StopAtSpace(DigitCountTask):
    name = "stop-at-space"
    stop = (" ",)


class _EvalRewardFails(DigitCountTask):
    """Held-out problems whose reward raises on one of the three."""

    name = "eval-reward-fails"

    def eval_problems(self) -> list[Problem]:
        return [Problem(i, q, 0) for i, q in enumerate(("Write 2 digits.", "boom", "Say 7."))]

    def score(self, response: str, problem: Problem) -> RewardBreakdown:
        if problem.question == "boom":
            raise ValueError("the grader is down")
        return DigitCountTask.score(self, response, problem)


def test_a_failing_eval_reward_is_skipped_or_stops_the_run(
    server: LocalServer, tmp_path: Path
) -> None:
    console = io.StringIO()
    config = small_config(server, tmp_path / "skip", steps=2, eval_every=1, on_reward_error="skip")
    steps, result = run_engine(config, task=_EvalRewardFails(), console=console)
    assert result.steps_completed == 2
    evals = lines(tmp_path / "skip" / "eval.jsonl")
    assert [(e["step"], e["eval/problems"], e["eval/reward_errors"]) for e in evals] == [
        (0, 2, 1),
        (1, 2, 1),
        (2, 2, 1),
    ]
    assert steps[1].metrics["eval/reward_errors"] == 1
    warned = [line for line in console.getvalue().splitlines() if "the grader is down" in line]
    assert len(warned) == 3 and all("left out of the eval metrics" in w for w in warned)
    with pytest.raises(RewardError, match="the grader is down"):
        run_engine(
            config.replace(run_dir=tmp_path / "fail", on_reward_error="fail"),
            task=_EvalRewardFails(),
        )
    summary = json.loads((tmp_path / "fail" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["steps_completed"] == 0


def test_stop_strings_reach_the_sampler(server: LocalServer, tmp_path: Path) -> None:
    """The tiny model answers ' 46</s>': stopping at ' ' ends a response at its first
    space (its first token, as a rule), and the decoded text is cut before the stop
    string. (Sampled at temperature 1, a response may also start without a space.)"""
    steps, _ = run_engine(small_config(server, tmp_path / "run", steps=1), task=_StopAtSpace())
    completions = [e.turns[0].action for g in steps[0].groups for e in g.trajectories]
    [space] = AutoTokenizer.from_pretrained(DEFAULT_OUT).encode(" ", add_special_tokens=False)
    assert all(space not in c[:-1] for c in completions)  # nothing sampled past one
    assert any(list(c) == [space] for c in completions)
    rollouts = lines(tmp_path / "run" / "rollouts.jsonl")
    assert all(" " not in e["turns"][0]["action"] for g in rollouts for e in g["episodes"])
    assert any(e["turns"][0]["action"] == "" for g in rollouts for e in g["episodes"])


def test_init_from_starts_from_saved_weights(
    server: LocalServer, dataset: Path, tmp_path: Path
) -> None:
    common: dict[str, Any] = {
        "task": f"jsonl:{dataset}",
        "task_args": {"eval_size": "10"},
        "learning_rate": 1e-2,
    }
    run_engine(task_config(server, tmp_path / "a", eval_every=3, steps=3, **common))
    final = [r for r in lines(tmp_path / "a" / "checkpoints.jsonl") if r["reason"] == "final"]
    state_path = final[-1]["state_path"]
    a_evals = {e["step"]: e["eval/reward/total"] for e in lines(tmp_path / "a" / "eval.jsonl")}
    for name, optimizer in (("b", False), ("c", True)):
        config = task_config(
            server,
            tmp_path / name,
            init_from=state_path,
            init_from_optimizer=optimizer,
            eval_every=1,
            steps=1,
            **common,
        )
        run_engine(config)
        start = lines(tmp_path / name / "eval.jsonl")[0]
        assert start["step"] == 0
        # Greedy answers of the same weights (a shared batch may flip a near-tie).
        assert start["eval/reward/total"] == pytest.approx(a_evals[3], abs=0.1)
        assert json.loads((tmp_path / name / "config.json").read_text())["model"]["init_from"] == (
            state_path
        )


def test_chat_task_against_the_qwen_alias(tmp_path: Path) -> None:
    with LocalServer(model_aliases=["Qwen/Qwen3-0.6B"]) as server:
        config = small_config(server, tmp_path / "run", base_model="Qwen/Qwen3-0.6B", steps=1)

        async def go() -> str:
            async with Engine(config, task=ChatDigitCountTask()) as engine:
                await engine.run()
                return str(engine.session.tokenizer.chat_template)

        template = anyio.run(go)
    assert "Question: " in template  # the served tokenizer's template rendered the prompt
    rollout = lines(tmp_path / "run" / "rollouts.jsonl")[0]
    prompt = rollout["episodes"][0]["turns"][0]["observation"]
    assert prompt == f"<s>Question: {rollout['question']}\nAnswer:"


def test_console_script_finds_a_task_module_in_the_current_directory(tmp_path: Path) -> None:
    script = Path(sys.executable).parent / "engine-run"
    if not script.exists():
        pytest.skip("the engine-run console script is not installed")
    (tmp_path / "mytask.py").write_text(
        "def make():\n    raise RuntimeError('found me')\n", encoding="utf-8"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    env.pop("MINT_API_KEY", None)
    proc = subprocess.run(
        [str(script), "--task", "mytask:make"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr == "Error: invalid task 'mytask:make': calling make failed (found me)\n"


class _ExactAnswer(ArithmeticTask):
    """A user's reward as a newcomer writes it: ``==`` on the stripped response (the
    answers it saw are kept)."""

    name = "exact-answer"

    def __init__(self) -> None:
        super().__init__(op="+", min_operand=10, max_operand=99)
        self.seen: list[str] = []

    def score(self, response: str, problem: Problem) -> RewardBreakdown:  # type: ignore[override]
        self.seen.append(response)
        return RewardBreakdown(1.0 if response.strip() == str(problem.answer) else 0.0)


@pytest.mark.parametrize("keep", [False, True])
def test_an_equality_reward_sees_the_answer_without_the_end_token(
    server: LocalServer, tmp_path: Path, keep: bool
) -> None:
    """The packaged model answers ' 76</s>': the reward sees ' 76' (and scores it), the
    trained tokens still end with the EOS token; --keep-stop-text shows it the '</s>'."""
    task = _ExactAnswer()
    config = task_config(server, tmp_path / "run", steps=1, keep_stop_text=keep)
    steps, _ = run_engine(config, task=task)
    eos = AutoTokenizer.from_pretrained(DEFAULT_OUT).eos_token_id
    actions = [t.turns[0].action for g in steps[0].groups for t in g.trajectories]
    assert any(action[-1] == eos for action in actions)
    assert any("</s>" in text for text in task.seen) is keep
    if not keep:
        assert steps[0].metrics["avg_reward"] > 0
