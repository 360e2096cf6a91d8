"""Reliability round 3, client side: rewards that cannot stop the run, bad rewards,
picklable presets, damaged datasets and run files, one process per run dir. Fake
sessions and unit calls; no server, no timing assertions."""

from __future__ import annotations

import io
import json
import pickle
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
import pytest
from fake_session import FakeSession

from engine import Engine, EngineConfig, RunResult
from engine.catalog import load_task, task_spec
from engine.config import config_from_sources
from engine.config.values import ScoreWorkers
from engine.core.problems import Problem, RewardBreakdown, SeededSource
from engine.core.state import LoopState
from engine.envs.scoring import RewardError, Scorer
from engine.errors import ConfigError
from engine.local import LocalServer
from engine.observe.idle import NO_TRAINING_STEPS, no_training_summary, no_training_warning
from engine.report import main as report_main
from engine.rollouts import main as rollouts_main
from engine.run import main
from engine.rundir.checkpoint_log import CheckpointLog, CheckpointRecord
from engine.rundir.directory import config_record, write_config
from engine.rundir.lock import RunDirLock
from engine.session.api import ServerInfo
from engine.session.preflight import local_server_profile
from engine.tasks.arithmetic import ArithmeticTask
from engine.tasks.dataset import DatasetTask
from engine.tasks.rewards import make_reward
from tests.engine_support import run_engine
from tests.process_rewards import DyingTask, NoisyTask
from tests.reliability_support import checkpoints, events, fast_config, metrics, read_json
from tests.test_reliability_input import make_run_dir

PROBLEM = Problem(0, "q", "7")


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# -- 9: reward values are validated where they are received ----------------------------


class BadComponentTask:
    name = "bad-components"

    def __init__(self, reward: Any) -> None:
        self.reward = reward

    def source(self, seed: int, state: Mapping[str, Any] | None = None) -> SeededSource:
        return SeededSource(lambda rng, i: Problem(i, f"p{i}", i), seed, state)

    def prompt(self, problem: Problem) -> str:
        return problem.question

    def score(self, response: str, problem: Problem) -> Any:
        return self.reward


@pytest.mark.parametrize(
    "reward",
    [
        RewardBreakdown(0.5, {"c": "high"}),  # type: ignore[dict-item]
        RewardBreakdown(0.5, {"c": float("nan")}),
        RewardBreakdown(0.5, {"c": True}),
        RewardBreakdown("0.5"),  # type: ignore[arg-type]
        RewardBreakdown(0.5, ["c"]),  # type: ignore[arg-type]
    ],
)
def test_a_reward_with_bad_components_is_a_reward_error(reward: RewardBreakdown) -> None:
    scorer = Scorer(BadComponentTask(reward), concurrency=2, workers=ScoreWorkers())
    with pytest.raises(RewardError, match="reward"):
        anyio.run(scorer.score, PROBLEM, ["a", "b"])


# -- 6: the presets can run in worker processes, checked before anything is spent -------


@pytest.mark.parametrize(
    ("preset", "options"),
    [("exact", {}), ("numeric", {"tolerance": "0.1"}), ("regex", {"pattern": r"(\d+)"})],
)
def test_reward_presets_are_picklable(preset: str, options: dict[str, str]) -> None:
    reward = make_reward(preset, options)
    again = pickle.loads(pickle.dumps(reward))
    assert again("7", "7").total == 1.0


def test_a_dataset_task_scores_in_worker_processes(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "p", "answer": "7"}])
    task = DatasetTask.from_args(str(data), {"reward": "numeric"}, "jsonl")
    scorer = Scorer(task, concurrency=2, workers=ScoreWorkers("processes", 1))
    problem = task.source(0).next()
    assert problem is not None
    rewards = anyio.run(scorer.score, problem, ["7", "8"])
    assert [r.total for r in rewards] == [1.0, 0.0]


# -- 4: a catastrophic pattern cannot hold the run -------------------------------------


def test_a_catastrophic_regex_is_bounded_and_lets_other_threads_run() -> None:
    reward = make_reward("regex", {"pattern": "(.|.|.|.)*#", "pattern_timeout": "1"})
    outcome: list[BaseException | RewardBreakdown] = []
    done = threading.Event()

    def match() -> None:
        try:
            outcome.append(reward("#" + "a" * 60, "x"))
        except BaseException as exc:
            outcome.append(exc)
        done.set()

    threading.Thread(target=match, daemon=True).start()
    ticks = 0
    while not done.wait(0.01):  # this thread keeps running Python while the match runs
        ticks += 1
    assert done.wait(120)
    assert ticks > 0  # the match let go of the interpreter lock
    assert isinstance(outcome[0], TimeoutError), outcome
    assert "pattern" in str(outcome[0])


def test_bad_regex_patterns_are_refused_up_front() -> None:
    with pytest.raises(ConfigError, match="invalid reward pattern"):
        make_reward("regex", {"pattern": "(unclosed"})
    with pytest.raises(ConfigError, match="pattern_timeout"):
        make_reward("regex", {"pattern": "a", "pattern_timeout": "-1"})


# -- 11: damaged dataset files: one line naming file:line ------------------------------


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b'{"prompt": "ok", "answer": "1"}\n{"prompt": "\xff", "answer": "1"}\n', "UTF-8"),
        (b'{"prompt": "ok", "answer": "1"}\n' + b"[" * 100_000 + b"\n", "nested"),
        (b'{"prompt": "ok", "answer": "1"}\n{"prompt": "p", "answer": ' + b"9" * 5000 + b"}\n", ""),
        (b'{"prompt": "ok", "answer": "1"}\n{"prompt": "a\\ud800b", "answer": "1"}\n', "surrogate"),
        (
            b'{"prompt": "ok", "answer": "1"}\n'
            b'{"prompt": [{"role": "user", "content": "\\udfff"}], "answer": "1"}\n',
            "surrogate",
        ),
    ],
)
def test_a_damaged_jsonl_dataset_is_one_line_naming_file_and_line(
    tmp_path: Path, content: bytes, reason: str
) -> None:
    data = tmp_path / "d.jsonl"
    data.write_bytes(content)
    with pytest.raises(ConfigError) as error:
        DatasetTask.from_args(str(data), {}, "jsonl")
    message = str(error.value)
    assert f"{data}:2" in message and reason in message
    assert "\n" not in message and len(message) < 400


def test_an_unpicklable_task_with_processes_is_refused_before_the_run_dir(
    tmp_path: Path,
) -> None:
    class Local(BadComponentTask):  # a class defined in a function cannot be pickled
        pass

    config = EngineConfig(local=True, run_dir=tmp_path / "run", score_workers="processes:2")
    engine = Engine(config, task=Local(1.0))  # reads nothing yet

    async def enter() -> None:
        async with engine:
            pass

    with pytest.raises(ConfigError, match="picklable"):
        anyio.run(enter)
    assert not (tmp_path / "run").exists()


# -- 8: a reward may write to fd 1 in a worker process; a dead worker explains itself ---


# NoisyTask and DyingTask are deliberately partial tasks (only the name and a score that
# returns a bare number, which the scorer accepts), so a worker imports nothing heavy.


def test_a_reward_writing_to_fd_1_works_in_worker_processes() -> None:
    scorer = Scorer(NoisyTask(), concurrency=2, workers=ScoreWorkers("processes", 1))  # type: ignore[arg-type]
    rewards = anyio.run(scorer.score, PROBLEM, ["a", "b"])
    assert [r.total for r in rewards] == [1.0, 1.0]


def test_a_worker_process_that_dies_explains_itself() -> None:
    scorer = Scorer(DyingTask(), concurrency=2, workers=ScoreWorkers("processes", 1))  # type: ignore[arg-type]
    with pytest.raises(RewardError, match="worker process"):
        anyio.run(scorer.score, PROBLEM, ["a"])


# -- 5: one run dir, one process --------------------------------------------------------


def test_a_run_dir_in_use_by_another_process_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MINT_API_KEY", raising=False)
    run = tmp_path / "run"
    make_run_dir(run, batch="4", steps="3")
    holder = subprocess.Popen(  # another process holding the run dir, as a training run does
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
            "fcntl.flock(fd, fcntl.LOCK_EX); os.write(fd, str(os.getpid()).encode()); "
            "print('locked', flush=True); sys.stdin.read()",
            str(run / ".lock"),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
        before = (run / "checkpoints.jsonl").read_bytes()
        assert main(["--resume", str(run), "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert err == (
            f"Error: run directory {run} is in use by another process (pid {holder.pid}): "
            "one process per run dir; wait for it to end (or stop it) first\n"
        )
        assert (run / "checkpoints.jsonl").read_bytes() == before
        assert not (run / "metrics.jsonl").exists()
    finally:
        holder.communicate("")
    # The holder is gone: its lock went with it.
    lock = RunDirLock.acquire(run)
    lock.release()


# -- 7: resume refuses changed data -----------------------------------------------------


def test_resume_refuses_a_changed_dataset(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MINT_API_KEY", raising=False)
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"p{i}", "answer": i} for i in range(4)])
    run = tmp_path / "run"
    config = config_from_sources({"task": f"jsonl:{data}", "progress": False}, {}).resolved(
        local_server_profile(None)
    )
    task = load_task(config.task.spec, config.task.args)
    spec, args = task_spec(task, config.task.spec, config.task.args)
    write_config(run, config_record(config.replace(task=spec, task_args=args), task))
    state = LoopState(1, task.source(config.task.seed).state(), 1).to_dict()
    record = CheckpointRecord(1, "tinker://m/weights/step-1", "periodic", loop_state=state)
    CheckpointLog(run).append(record)
    write_jsonl(data, [{"prompt": f"p{i}", "answer": i + 1} for i in range(4)])
    assert main(["--resume", str(run), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"Error: cannot resume {run}: the task's data changed since the run")
    assert err.count("\n") == 1
    assert not (run / "metrics.jsonl").exists()


# -- 12: the tools and --resume on damaged run files ------------------------------------

ROLLOUT = {
    "step": 1,
    "index": 0,
    "problem_id": 0,
    "question": "q",
    "answer": "a",
    "prompt": "p",
    "sampler_version": 0,
    "reward_error": None,
    "responses": [{"text": "t", "reward": 1.0, "components": {}, "advantage": 0.0, "tokens": 1}],
}


@pytest.mark.parametrize(
    "damage", [b"\xff\xfe not utf-8", b"{not json", b'{"step": 1}', b'{"step": "x"}', b"[1]"]
)
def test_rollouts_skip_damaged_lines_say_so_and_exit_non_zero(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: bytes
) -> None:
    good = json.dumps(ROLLOUT).encode()
    (tmp_path / "rollouts.jsonl").write_bytes(good + b"\n" + damage + b"\n" + good + b"\n")
    assert rollouts_main([str(tmp_path)]) == 1
    out, err = capsys.readouterr()
    assert out.count("step 1 - problem 0") == 2
    assert err == (
        f"Warning: skipped 1 damaged line(s) of {tmp_path / 'rollouts.jsonl'} (line 2); "
        "the rest was read\n"
    )


def test_a_report_skips_damaged_lines_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    step = {"step": 1, "avg_reward": 0.5, "time/step": 1.0, "off_policy/staleness": 0}
    lines = [json.dumps(step).encode(), b"\xff\xfe", json.dumps({**step, "step": 2}).encode()]
    (tmp_path / "metrics.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    (tmp_path / "summary.json").write_bytes(b"\xff")
    assert report_main([str(tmp_path)]) == 1
    out, err = capsys.readouterr()
    assert "report.png" in out
    assert err.startswith("Warning: skipped 1 damaged line(s) of") and err.count("\n") == 1
    (tmp_path / "metrics.jsonl").write_bytes(b"\xff\xfe\n{}\n")
    assert report_main([str(tmp_path)]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_resume_refuses_a_checkpoint_without_loop_state(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MINT_API_KEY", raising=False)
    run = tmp_path / "run"
    make_run_dir(run, batch="4", steps="3")
    with (run / "checkpoints.jsonl").open("a") as f:
        f.write('{"step": 3, "state_path": "tinker://m/weights/step-3", "reason": "periodic"}\n')
    assert main(["--resume", str(run), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"Error: cannot resume {run}: ") and "loop state" in err, err
    assert err.count("\n") == 1


# -- runs that waste a user's time in silence ---------------------------------------------


def test_a_streak_of_untrained_steps_warns_at_n_2n_4n_and_names_the_cause() -> None:
    def step(n: int, datums: int = 0, **counts: int) -> dict[str, Any]:
        base = {"groups/total": 4, "groups/skipped": 4, "avg_reward": 0.0}
        return {"step": n, "datums": datums, **base, **counts}

    metrics: list[dict[str, Any]] = []
    warned = []
    for n in range(1, 14):
        metrics.append(step(n, datums=8 if n == 1 else 0))
        if (line := no_training_warning(metrics)) is not None:
            warned.append((n, line))
    assert [n for n, _ in warned] == [1 + NO_TRAINING_STEPS, 1 + 2 * NO_TRAINING_STEPS, 13]
    assert "all rewards within each group were equal (12 of 12 groups" in warned[0][1]
    summary = no_training_summary(metrics)
    assert summary is not None and summary["longest_streak"] == [2, 13]
    empty = [step(n, **{"groups/skipped": 0, "skipped/empty_responses": 16}) for n in (1, 2, 3)]
    assert "every response was empty" in str(no_training_warning(empty))
    failed = [step(n, **{"groups/skipped": 0, "groups/reward_errors": 4}) for n in (1, 2, 3)]
    assert "every group's reward failed" in str(no_training_warning(failed))
    assert no_training_summary(metrics[:3]) is None


class ZeroRewardTask(ArithmeticTask):
    """Addition whose reward is 0 everywhere, and raises KeyError on problem 1."""

    def __init__(self) -> None:
        super().__init__("+", 10, 99)
        self.name = "zero-reward"

    def score(self, response: str, problem: Problem) -> RewardBreakdown:
        if problem.id == 1:
            # A KeyError on purpose; the test below finds this line in the traceback.
            return {}["missing"]  # type: ignore[index]
        return RewardBreakdown(0.0)


@pytest.fixture(scope="module")
def server() -> Iterator[LocalServer]:
    with LocalServer() as s:
        yield s


@pytest.mark.slow
def test_a_run_that_trains_nothing_says_so_and_reward_tracebacks_are_kept(
    server: LocalServer, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    config = fast_config(
        server, run_dir, steps=NO_TRAINING_STEPS, on_reward_error="skip", log_level="debug"
    )
    console = io.StringIO()
    run_engine(config, task=ZeroRewardTask(), console=console)
    warnings = [x for x in console.getvalue().splitlines() if "nothing was trained" in x]
    assert len(warnings) == 1 and "all rewards within each group were equal" in warnings[0]
    summary = read_json(run_dir / "summary.json")
    assert summary["no_training"]["longest_streak"] == [1, NO_TRAINING_STEPS]
    assert "trained nothing" in (run_dir / "summary.md").read_text()
    failed = events(run_dir, "reward.failed")
    assert len(failed) == 1 and failed[0]["problem_id"] == 1
    assert "Traceback" in failed[0]["traceback"] and "KeyError: 'missing'" in failed[0]["traceback"]
    assert 'return {}["missing"]' in failed[0]["traceback"]
    assert 'return {}["missing"]' in console.getvalue()  # --log-level debug: on the console too


# -- embedding ------------------------------------------------------------------------------


@pytest.mark.slow
def test_leaving_steps_early_checkpoints_what_was_trained(
    server: LocalServer, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    # run_dir as a str; no periodic checkpoint before the end
    config = fast_config(server, run_dir, steps=6, checkpoint_every=0)
    config = config.replace(run_dir=str(run_dir))  # type: ignore[arg-type]
    console = io.StringIO()

    async def go() -> int:
        async with Engine(config, console=console) as engine:
            async for step in engine.steps():
                if step.step == 2:
                    break
        return step.step

    assert anyio.run(go) == 2
    latest = checkpoints(run_dir)[-1]
    assert latest["reason"] == "stop" and latest["step"] >= 2
    assert len(metrics(run_dir)) == latest["step"]  # every trained step is in the checkpoint
    summary = read_json(run_dir / "summary.json")
    # the caller's stop is no error: the run stopped, and says who stopped it
    assert summary["status"] == "stopped" and summary["error"] is None
    assert summary["stopped"]["reason"] == "stop"
    assert "embedding code leaving steps()" in console.getvalue()
    assert "SIGINT" not in console.getvalue()


@pytest.mark.slow
def test_request_stop_says_the_embedding_code_asked(server: LocalServer, tmp_path: Path) -> None:
    config = fast_config(server, tmp_path / "run", steps=4)
    console = io.StringIO()

    async def go() -> RunResult | None:
        async with Engine(config, console=console) as engine:
            async for _ in engine.steps():
                engine.request_stop()
        return engine.result

    result = anyio.run(go)  # the caller's stop ends the run normally, with its result
    assert result is not None and result.stopped and result.final_path is not None
    assert "SIGINT" not in console.getvalue()
    assert "stop requested by Engine.request_stop()" in console.getvalue()
    assert "request_stop" in events(tmp_path / "run", "stop.requested")[0]["message"]


def test_config_paths_accept_str_and_pathlike_and_a_task_object_is_redirected(
    tmp_path: Path,
) -> None:
    config = EngineConfig(local=True, run_dir=str(tmp_path / "a"))  # type: ignore[arg-type]
    assert config.logging.run_dir == tmp_path / "a"
    with pytest.raises(ConfigError, match=r"Engine\(config, task=\.\.\.\)"):
        EngineConfig(local=True, task=ArithmeticTask("+", 10, 99))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="takes an EngineConfig first"):
        Engine(ArithmeticTask("+", 10, 99))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"goes in EngineConfig\(task=\.\.\.\)"):
        Engine(EngineConfig(local=True), task="arithmetic")  # type: ignore[arg-type]


# -- a prompt longer than the context ---------------------------------------------------


class LongPromptTask(BadComponentTask):
    """Problem 1's prompt is far longer than the fake model's context."""

    def __init__(self) -> None:
        super().__init__(0.0)

    def source(self, seed: int, state: Mapping[str, Any] | None = None) -> SeededSource:
        return SeededSource(
            lambda rng, i: Problem(i, "x" * 500 if i == 1 else f"p{i}", i), seed, state
        )

    def score(self, response: str, problem: Problem) -> Any:
        return float(int(response.split()[1]) % 2)


class SmallContextSession(FakeSession):
    @property
    def info(self) -> ServerInfo:
        return replace(super().info, max_context=64)


@pytest.mark.anyio
async def test_a_prompt_longer_than_the_context_skips_its_group_not_the_run() -> None:
    from tests.test_pipeline_stages import config, run_pipeline

    outcome, results = await run_pipeline(
        SmallContextSession(), config(steps=2, max_tokens=16), task=LongPromptTask()
    )
    assert outcome is not None and outcome.steps_completed == 2
    first = results[0]
    assert first.metrics["groups/too_long"] == 1
    assert first.metrics["groups/used"] == 1  # the other group trained
    skipped = first.groups[1]
    assert skipped.trajectories == () and "exceeds the model's context of 64" in str(
        skipped.too_long
    )
    assert results[1].metrics["groups/too_long"] == 0


@pytest.mark.slow
def test_resume_reads_past_bad_bytes_in_its_run_files(server: LocalServer, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_engine(fast_config(server, run_dir, steps=2, checkpoint_every=1))
    for name in ("metrics.jsonl", "checkpoints.jsonl", "rollouts.jsonl"):
        lines = (run_dir / name).read_bytes().split(b"\n")
        (run_dir / name).write_bytes(b"\n".join([lines[0], b"\xff\xfe{", *lines[1:]]))
    _, result = run_engine(fast_config(server, run_dir, steps=3, resume=run_dir))
    assert result.steps_completed == 3
    assert [m["step"] for m in metrics(run_dir)] == [1, 2, 3]
