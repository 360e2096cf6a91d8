"""Bad input: the reliability flags and --resume (exit 2, one exact line), reward
functions that raise (--on-reward-error skip), requests the server refuses, and API keys
that must never reach a log line, a file or an error message."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from engine import Engine
from engine.catalog import load_task, task_spec
from engine.config import config_from_sources
from engine.core.state import LoopState
from engine.errors import PermanentServiceError
from engine.local import LocalServer
from engine.run import main
from engine.rundir.checkpoint_log import CheckpointLog, CheckpointRecord
from engine.rundir.directory import write_config
from engine.session.adapter import SdkSession
from engine.session.api import SamplingParams
from engine.session.preflight import local_server_profile
from tests.engine_support import run_engine
from tests.reliability_support import (
    SMALL_RUN,
    FailingRewardTask,
    checkpoints,
    cli_env,
    fast_config,
    metrics,
)

ENV_PREFIXES = ("MINT_", "TINKER_")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith(ENV_PREFIXES) and name != "TINKER_TELEMETRY":
            monkeypatch.delenv(name)


@pytest.fixture(scope="module")
def server() -> Iterator[LocalServer]:
    with LocalServer() as s:
        yield s


def exit_and_stderr(
    argv: list[str], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse usage errors
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


FLAG_ERRORS = [
    (["--checkpoint-every", "-1"], "Error: --checkpoint-every must be >= 0, got '-1'"),
    (["--request-timeout", "0"], "Error: --request-timeout must be a positive number, got '0'"),
    (["--stall-timeout", "nan"], "Error: --stall-timeout must be a positive number, got 'nan'"),
    (["--stall-timeout", "soon"], "Error: --stall-timeout must be a number, got 'soon'"),
    (
        ["--max-consecutive-failures", "0"],
        "Error: --max-consecutive-failures must be positive, got '0'",
    ),
    (["--retry-attempts", "0"], "Error: --retry-attempts must be positive, got '0'"),
    (["--retry-backoff", "-2"], "Error: --retry-backoff must be a number >= 0, got '-2'"),
    (
        ["--on-reward-error", "ignore"],
        "Error: --on-reward-error must be one of fail, skip, got 'ignore'",
    ),
]


@pytest.mark.parametrize(("argv", "message"), FLAG_ERRORS)
def test_bad_reliability_flags_exit_2_with_one_line(
    argv: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, err = exit_and_stderr(argv, capsys, tmp_path)
    assert (code, err, out) == (2, message + "\n", "")
    assert not (tmp_path / "runs").exists()


def make_run_dir(path: Path, **flags: str) -> None:
    """A run dir as a real run leaves it: config.json from the same flags, and a
    checkpoint record."""
    config = config_from_sources(
        {k.replace("-", "_"): v for k, v in flags.items()} | {"progress": False}, {}
    ).resolved(local_server_profile(None))
    task = load_task(config.task.spec, config.task.args)
    spec, args = task_spec(task, config.task.spec, config.task.args)  # as the engine records it
    write_config(
        path,
        {
            **config.replace(task=spec, task_args=args).public_dict(),
            "task_repr": repr(task),
            "task_name": task.name,
        },
    )
    record = CheckpointRecord(
        step=2,
        state_path="tinker://model-x/weights/step-2",
        reason="periodic",
        loop_state=LoopState(2, task.source(config.task.seed).state(), 2).to_dict(),
    )
    CheckpointLog(path).append(record)


def test_resume_errors_exit_2_with_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    missing = tmp_path / "missing"
    not_a_run = tmp_path / "not-a-run"
    not_a_run.mkdir()
    run = tmp_path / "run"
    make_run_dir(run, batch="4", steps="3")
    cases = [
        (["--resume", str(missing)], f"Error: cannot resume: {missing} does not exist"),
        (
            ["--resume", str(not_a_run)],
            f"Error: cannot resume: {not_a_run} is not a run directory (no config.json)",
        ),
        (
            ["--resume", str(run), "--run-dir", str(tmp_path / "elsewhere")],
            f"Error: --resume {run} and --run-dir {tmp_path / 'elsewhere'} name different "
            "directories: a resumed run continues in its own directory",
        ),
        (
            ["--resume", str(run), "--steps", "1"],
            f"Error: cannot resume {run}: its latest checkpoint is at step 2, beyond --steps 1",
        ),
        (
            ["--resume", str(run), "--batch", "8", "--loss", "dro"],
            f"Error: cannot resume {run}: the config differs from its config.json: "
            "pipeline.batch is 4 in the run dir but 8 now; training.loss is 'ppo' in the run "
            "dir but 'dro' now (use the same settings, or a new run dir)",
        ),
    ]
    for argv, message in cases:
        code, out, err = exit_and_stderr(argv, capsys, tmp_path)
        assert (code, err) == (2, message + "\n"), argv
        assert "Traceback" not in out
    assert not (tmp_path / "runs").exists()
    assert not (run / "metrics.jsonl").exists()  # refused before anything was written


@pytest.mark.slow
def test_a_reward_error_with_skip_drops_the_group_and_counts_it(
    server: LocalServer, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    config = fast_config(server, run_dir, steps=3, on_reward_error="skip")
    console = io.StringIO()
    steps, _ = run_engine(config, task=FailingRewardTask([1, 6]), console=console)
    lines = metrics(run_dir)
    assert [m["groups/reward_errors"] for m in lines] == [1, 1, 0]
    assert [m["reward_errors/problem_ids"] for m in lines] == [[1], [6], []]
    # the group is part of its step (nothing lost, nothing re-drawn) but trains nothing
    assert [m["problem_ids"] for m in lines] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert all(len(s.datums) <= 3 * 4 for s in steps[:2])
    assert all(m["groups/total"] == 4 for m in lines)
    warnings = [x for x in console.getvalue().splitlines() if "reward function failed" in x]
    assert len(warnings) == 2
    assert warnings[0].startswith(
        "Warning: step 1: the reward function failed on problem 1 ('What is "
    )
    assert warnings[0].endswith("; the group was left out of the step (--on-reward-error skip)")
    assert steps[0].groups[1].reward_error is not None


@pytest.mark.slow
def test_requests_the_server_refuses_fail_fast_with_the_reason(
    server: LocalServer, tmp_path: Path
) -> None:
    """The server validates names and sizes; the engine reports its reason in one
    sentence and does not retry (PermanentServiceError)."""
    config = fast_config(server, tmp_path / "run", steps=1)

    async def go() -> tuple[PermanentServiceError, PermanentServiceError]:
        async with Engine(config) as engine:
            session = engine.session
            assert isinstance(session, SdkSession)  # save_state and retries are the SDK's
            with pytest.raises(PermanentServiceError) as bad_name:
                await session.save_state("../../outside")
            _, weights = await session.save_checkpoint("ok", "ok")
            sampler = await session.open_sampler(0, weights)
            params = SamplingParams(max_tokens=2, temperature=1.0)
            with pytest.raises(PermanentServiceError) as too_many:
                await session.sample(sampler, [1, 2, 3], 100_000, params)
            assert session.retries.totals()["retries/save_state"] == 0
            assert session.retries.totals()["retries/sample"] == 0
            return bad_name.value, too_many.value

    bad_name, too_many = anyio.run(go)
    assert str(bad_name).startswith("save_state failed: ")
    assert "'../../outside'" in str(bad_name) and "plain name" in str(bad_name)
    assert str(too_many).startswith("sample failed: ")
    assert "num_samples" in str(too_many)


@pytest.mark.slow
def test_an_sk_key_never_reaches_logs_files_or_errors(tmp_path: Path) -> None:
    """A real MinT-style ``sk-`` key against the local server configured with it (JWT
    mode, as hosted MinT): not in stdout/stderr, not in any file of the run dir -- not
    even when the user's reward function puts it in an error message."""
    key = "sk-reliability-0123456789abcdefghijklmnop"
    with LocalServer(api_key=key) as server:
        env = cli_env(MINT_API_KEY=key, MINT_BASE_URL=server.base_url)
        common = [*SMALL_RUN, "--base-model", server.model_name, "--steps", "2"]
        task = ["--task", "tests.reliability_support:leaky_reward_task"]
        runs = {}
        for policy in ("skip", "fail"):
            run_dir = tmp_path / policy
            args = [*common, *task, "--on-reward-error", policy, "--run-dir", str(run_dir)]
            runs[policy] = subprocess.run(
                [sys.executable, "-m", "engine.run", *args],
                cwd=tmp_path,
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
                check=False,
            )
    skip, fail = runs["skip"], runs["fail"]
    assert skip.returncode == 0, skip.stderr
    assert fail.returncode == 1
    # the registered key is replaced whole wherever it shows up
    assert "(key [REDACTED]); the group was left out of the step" in skip.stdout
    [line] = fail.stderr.splitlines()
    assert line.startswith("Error: the reward function failed on problem 1 (")
    assert line.endswith("(key [REDACTED])")
    texts = [skip.stdout, skip.stderr, fail.stdout, fail.stderr]
    texts += [  # report.png too: an ASCII key would show in its bytes
        p.read_bytes().decode("utf-8", "replace") for p in tmp_path.rglob("*") if p.is_file()
    ]
    assert all(key not in t for t in texts)
    # no JWT either (a header.payload run: 'eyJ' alone occurs by chance in a PNG's bytes)
    jwt = re.compile(r"eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}")
    assert all(not jwt.search(t) for t in texts)
    assert json.loads((tmp_path / "skip" / "config.json").read_text())["server"] == "remote"
    assert checkpoints(tmp_path / "fail")[-1]["reason"] == "error"
