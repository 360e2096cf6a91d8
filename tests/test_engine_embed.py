"""The embeddable Engine: iteration, hooks, files, preflight errors, cancellation.

All against the real local server; the cancellation test lets the Engine start its own
in-process server, so "no task left behind" covers the server's tasks too.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from engine import ConfigError, Engine, EngineConfig, StepResult
from engine.catalog import load_task
from engine.local import LocalServer
from engine.session.api import PendingCheckpoint
from engine.session.preflight import PreflightError
from tests.engine_support import API_KEY, run_engine, small_config

REQUIRED_METRICS = (
    "step",
    "env/all/reward/total",
    "env/all/format_reward/rate",
    "env/all/exact_bonus/rate",
    "env/all/distance_reward",
    "avg_reward",
    "exact_rate",
    "format_rate",
    "datums",
    "groups/used",
    "groups/skipped",
    "skipped/empty_responses",
    "dropped/missing_logprobs",
    "sampling_client/step_min",
    "sampling_client/step_max",
    "sampling_client/step_mean",
    "off_policy/staleness",
    "optim/kl_sample_train_v1",
    "optim/kl_sample_train_v2",
    "optim/entropy",
    "optim/grad_norm",
    "optim/loss",
    "time/sample",
    "time/score",
    "time/train",
    "time/wait",
    "trainer/idle_ratio",
    "sampler/idle_ratio",
    "throughput/samples_per_s",
    "throughput/tokens_per_s",
    "progress/done_frac",
    "retries/sample",
)


@pytest.fixture(scope="module")
def server() -> Iterator[LocalServer]:
    with LocalServer() as s:
        yield s


def test_steps_hooks_and_run_directory(server: LocalServer, tmp_path: Path) -> None:
    seen_sync: list[int] = []
    seen_async: list[int] = []

    async def async_hook(step: StepResult) -> None:
        await anyio.lowlevel.checkpoint()
        seen_async.append(step.step)

    config = small_config(server, tmp_path / "run", steps=2)
    steps, result = run_engine(config, on_step=[lambda s: seen_sync.append(s.step), async_hook])
    assert [s.step for s in steps] == seen_sync == seen_async == [1, 2]
    assert result.run_dir == tmp_path / "run"

    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    events = [json.loads(line) for line in lines]
    assert [e["step"] for e in events] == [1, 2]
    for event, step in zip(events, steps, strict=True):
        assert event["event"] == "step"
        for key in REQUIRED_METRICS:
            assert key in event, key
        assert event["datums"] == len(step.datums)
        assert event["progress/done_frac"] == step.step / 2
    assert result.metrics == tuple(s.metrics for s in steps)

    config_json = (tmp_path / "run" / "config.json").read_text()
    assert API_KEY not in config_json and "api_key" not in config_json
    assert json.loads(config_json)["model"]["base_model"] == server.model_name
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "finished"
    assert summary["final_path"] == result.final_path
    assert summary["steps_completed"] == 2
    assert "| 2 |" in (tmp_path / "run" / "summary.md").read_text()


def test_two_engines_share_one_event_loop_without_sharing_state(
    server: LocalServer, tmp_path: Path
) -> None:
    results = {}

    async def one(name: str, seed: int) -> None:
        config = small_config(server, tmp_path / name, steps=2, seed=seed)
        async with Engine(config) as engine:
            results[name] = await engine.run()

    async def both() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(one, "a", 1)
            tg.start_soon(one, "b", 2)

    anyio.run(both)
    assert results["a"].final_path != results["b"].final_path
    for name in ("a", "b"):
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(line)["step"] for line in lines] == [1, 2]


def test_cancelling_the_host_mid_step_returns_and_leaves_no_task(tmp_path: Path) -> None:
    """The engine starts its own local server here (no key, no URL)."""
    config = EngineConfig(
        local=True,
        steps=50,
        batch=4,
        group=4,
        max_tokens=8,
        run_dir=tmp_path / "run",
        max_steps_off_policy=1,
    )
    finished: list[str] = []

    async def main() -> set[asyncio.Task[object]]:
        before = asyncio.all_tasks()
        first_step = anyio.Event()

        async def host() -> None:
            async with Engine(config, on_step=lambda s: first_step.set()) as engine:
                await engine.run()
            finished.append("run")  # never reached: cancelled mid-run

        with anyio.fail_after(120):  # a hang guard, not a timing assertion
            async with anyio.create_task_group() as tg:
                tg.start_soon(host)
                await first_step.wait()  # step 2 is sampling (K=1), step 1 just trained
                tg.cancel_scope.cancel()
        await anyio.lowlevel.checkpoint()
        return asyncio.all_tasks() - before

    leftover = anyio.run(main)
    assert finished == []
    assert leftover == set()
    events = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert 1 <= len(events) < 50
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "interrupted"
    assert "cancellation of the host task" in summary["error"]
    assert summary["steps_completed"] == len(events)


def test_an_engine_runs_once_inside_its_async_with(server: LocalServer, tmp_path: Path) -> None:
    """Lifecycle: unopened -> opened -> running -> closed; each call out of turn is a
    RuntimeError that says what to do, and properties stay readable after the exit."""
    engine = Engine(small_config(server, tmp_path / "run", steps=1))

    async def lifecycle() -> None:
        with pytest.raises(RuntimeError, match=r"inside 'async with Engine\(\.\.\.\) as"):
            await engine.run()
        with pytest.raises(RuntimeError, match="exists once the engine is entered"):
            _ = engine.session
        async with engine:
            assert engine.state is None and engine.run_dir == tmp_path / "run"
        with pytest.raises(RuntimeError, match="is closed"):
            await engine.run()
        with pytest.raises(RuntimeError, match="already entered"):
            async with engine:
                pass
        engine.request_stop()  # closed: nothing to stop, no error

    anyio.run(lifecycle)
    again = Engine(small_config(server, tmp_path / "again", steps=1))

    async def twice() -> None:
        async with again:
            result = await again.run()
            with pytest.raises(RuntimeError, match=r"runs once: steps\(\)/run\(\) was already"):
                await again.run()
        assert result.steps_completed == 1 and again.state is not None
        assert again.state.next_step == 1 and again.run_dir == result.run_dir

    anyio.run(twice)


def test_a_failed_entry_closes_the_engine_and_leaves_a_summary(tmp_path: Path) -> None:
    config = EngineConfig(
        base_url=f"http://127.0.0.1:{_closed_port()}",
        api_key=API_KEY,
        base_model="m",
        run_dir=tmp_path / "run",
    )
    engine = Engine(config)

    async def enter() -> None:
        with pytest.raises(PreflightError):
            async with engine:
                pass
        with pytest.raises(RuntimeError, match="already entered"):
            async with engine:
                pass

    anyio.run(enter)
    assert engine.run_dir == tmp_path / "run"
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and "cannot reach" in summary["error"]


def test_an_embedding_never_starts_a_local_server_it_did_not_ask_for() -> None:
    with pytest.raises(ConfigError, match="no api_key and local=False"):
        Engine(EngineConfig(steps=1))


def test_from_env_reads_the_environment_like_the_cli() -> None:
    env = {"MINT_API_KEY": "sk-abc", "MINT_CUSTOM_REWARD_STEPS": "3"}
    hosted = EngineConfig.from_env(env, batch=2)
    assert hosted.session.api_key_value == "sk-abc" and not hosted.session.local
    assert (hosted.pipeline.steps, hosted.pipeline.batch) == (3, 2)
    assert EngineConfig.from_env({}).session.local  # nothing to connect to: the local server
    assert not EngineConfig.from_env({}, api_key="sk-x").session.local
    with pytest.raises(ConfigError, match="MINT_CUSTOM_REWARD_STEPS must be an integer"):
        EngineConfig.from_env({"MINT_CUSTOM_REWARD_STEPS": "many"})


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _enter(config: EngineConfig) -> None:
    async with Engine(config):
        pass


def test_preflight_unreachable_server_is_one_sentence(tmp_path: Path) -> None:
    port = _closed_port()
    config = EngineConfig(
        base_url=f"http://127.0.0.1:{port}",
        api_key=API_KEY,
        base_model="m",
        run_dir=tmp_path / "run",
    )
    with pytest.raises(PreflightError) as info:
        anyio.run(_enter, config)
    assert str(info.value) == (
        f"cannot reach the MinT server at http://127.0.0.1:{port} (connection refused); "
        "check MINT_BASE_URL, the network and the server's status"
    )


def test_preflight_rejected_key_and_unknown_model(tmp_path: Path) -> None:
    with LocalServer(api_key="tml-the-right-key") as keyed:
        config = EngineConfig(
            base_url=keyed.base_url,
            api_key="tml-a-wrong-key",
            base_model=keyed.model_name,
            run_dir=tmp_path / "a",
        )
        with pytest.raises(PreflightError) as info:
            anyio.run(_enter, config)
        assert str(info.value) == (
            f"the MinT server at {keyed.base_url} rejected the API key (HTTP 401); "
            "check MINT_API_KEY"
        )
        assert "tml-a-wrong-key" not in str(info.value)
        unknown = config.replace(
            api_key="tml-the-right-key", base_model="nope/model", run_dir=tmp_path / "b"
        )
        with pytest.raises(PreflightError) as info:
            anyio.run(_enter, unknown)
        assert str(info.value) == (
            f"the MinT server at {keyed.base_url} does not serve model 'nope/model' "
            f"(it serves: {keyed.model_name}); set MINT_BASE_MODEL or --base-model"
        )


def test_the_embedding_example_runs_and_cancels_cleanly(tmp_path: Path) -> None:
    example = Path(__file__).resolve().parents[1] / "examples" / "embed_service.py"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MINT_", "TINKER_"))}
    proc = subprocess.run(
        [sys.executable, str(example), "--steps", "3", "--cancel-after", "1"],
        env={**env, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[-2] == '[service] final status: {"state": "cancelled", "after_step": 1}'
    assert lines[-1] == "[service] tasks left besides the service: 0"
    assert sum(1 for line in lines if line.startswith("[service] Step ")) == 1
    # The cancelled run's polls end with its server: no SDK line per re-polled try_again.
    assert "try_again" not in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    "spec", ["tests.user_tasks:make_task", "tests.user_tasks:AsyncDigitCountTask"]
)
def test_user_task_from_a_task_path(spec: str, server: LocalServer, tmp_path: Path) -> None:
    task = load_task(spec)
    steps, _ = run_engine(small_config(server, tmp_path / "run", steps=1), task=task)
    m = steps[0].metrics
    assert "env/all/digits" in m and "env/all/digits/rate" in m
    assert 0.0 <= m["avg_reward"] <= 1.0
    assert "exact_rate" not in m
    assert steps[0].line == f"Step 1: avg_reward={m['avg_reward']:.3f}, datums={m['datums']}"
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["task_name"] == task.name


def test_a_model_alias_the_server_accepts_is_not_refused(tmp_path: Path) -> None:
    with LocalServer(model_aliases=["Qwen/Qwen3-0.6B"]) as server:
        config = small_config(
            server, tmp_path / "run", base_model="Qwen/Qwen3-0.6B", steps=1, batch=2, group=2
        )
        steps, result = run_engine(config)
    assert [s.step for s in steps] == [1]
    assert result.final_path is not None and result.final_path.startswith("tinker://")


def test_a_stop_during_the_step_0_checkpoint_still_checkpoints_at_once(
    server: LocalServer, tmp_path: Path
) -> None:
    """Cancelling the wait for a checkpoint must not cancel its calls: the SDK would
    drop a request that already took its place in the model's sequence, and the stop
    checkpoint behind it would wait for that place until its deadline."""
    config = small_config(server, tmp_path / "run", request_timeout=15.0)

    async def go() -> None:
        async with Engine(config) as engine:
            save = engine.session.submit_checkpoint  # step-0's: as step 0 starts training

            async def stop_while_saving(*args: Any, **kwargs: Any) -> PendingCheckpoint:
                engine.request_stop()
                return await save(*args, **kwargs)

            engine.session.submit_checkpoint = stop_while_saving  # type: ignore[method-assign]
            result = await engine.run()  # the caller's stop ends the run normally
            assert result.stopped and result.steps_completed == 1
            assert result.final_path is not None

    anyio.run(go)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    # Step 0 had begun when the stop came: it finishes, and the stop checkpoints after it.
    assert summary["stopped"] == {
        "reason": "stop",
        "checkpoint_step": 1,
        "checkpoint_written": True,
    }
