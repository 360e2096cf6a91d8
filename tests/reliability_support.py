"""Shared pieces of the reliability tests: fast configs, run-dir readers, and a task whose
reward function fails on chosen problems."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio

from engine import Engine, EngineConfig, RunResult, StepResult
from engine.local import LocalServer
from engine.tasks import Problem, RewardBreakdown
from engine.tasks.arithmetic import ArithmeticTask
from tests.clock import ManualClock
from tests.engine_support import small_config

REPO = Path(__file__).resolve().parents[1]


def fast_config(server: LocalServer, run_dir: Path, **overrides: Any) -> EngineConfig:
    """``small_config`` with short retry waits and a checkpoint every 2 steps."""
    base = small_config(server, run_dir, retry_backoff=0.01, checkpoint_every=2)
    return base.replace(**overrides)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    return read_jsonl(run_dir / "metrics.jsonl")


def checkpoints(run_dir: Path) -> list[dict[str, Any]]:
    return read_jsonl(run_dir / "checkpoints.jsonl")


def events(run_dir: Path, name: str | None = None) -> list[dict[str, Any]]:
    found = read_jsonl(run_dir / "events.jsonl")
    return [e for e in found if name is None or e["event"] == name]


def problem_sequence(run_dir: Path) -> list[tuple[int, tuple[int, ...], str]]:
    """(step, problem ids, problems digest) per metrics line, in file order."""
    return [(m["step"], tuple(m["problem_ids"]), m["problems/digest"]) for m in metrics(run_dir)]


def optimizer_steps_of(server: LocalServer, model_id: str) -> int:
    """What the server's optimizer state of ``model_id`` has applied (restored with a
    checkpoint, counted up by each applied optim_step)."""
    return server.backend_call(lambda b: b.optimizer_steps(model_id))


def trained_steps(lines: Sequence[Mapping[str, Any]]) -> int:
    """Steps that sent an optim_step (a step without datums sends none, as in the
    quickstart)."""
    return sum(1 for m in lines if m["datums"] > 0)


def saved_state_steps(run_dir: Path, state_path: str) -> int:
    """``optimizer_steps`` recorded in a local server's saved state (data dir in the run
    dir), read from disk: the server process that wrote it may be gone."""
    model_id, kind, name = state_path.removeprefix("tinker://").split("/")
    meta = run_dir / "local-server" / model_id / kind / name / "meta.json"
    return int(json.loads(meta.read_text())["optimizer_steps"])


BATCH = 4


def expected_ids(steps: int) -> list[list[int]]:
    """Problem ids per step of an uninterrupted run (problem i of step s is s*B + i)."""
    return [[s * BATCH + i for i in range(BATCH)] for s in range(steps)]


def run_and_keep_model(config: EngineConfig, **kwargs: Any) -> tuple[list[StepResult], str]:
    """Run to the end; return every StepResult the hook saw and the final model id."""
    seen: list[StepResult] = []
    model: list[str] = []

    async def go() -> None:
        async with Engine(config, on_step=seen.append, **kwargs) as engine:
            await engine.run()
            model_id = engine.session.model_id
            assert model_id is not None
            model.append(model_id)

    anyio.run(go)
    return seen, model[0]


async def until(condition: Callable[[], bool], *, limit_s: float = 240.0) -> None:
    """Wait (polling, on the event loop) until ``condition()`` holds: for state outside
    the run, such as what a server holds; the limit only keeps a broken run from hanging
    the suite."""
    with anyio.fail_after(limit_s):
        while not condition():  # noqa: ASYNC110  # nothing outside the run can set an Event
            await anyio.sleep(0.02)


def run_engine_driven(
    config: EngineConfig, clock: ManualClock, driver: Callable[[], Coroutine[Any, Any, None]]
) -> RunResult:
    """Run the engine on ``clock`` with ``driver`` beside it in the same event loop (it
    moves the clock when the run is where the test wants it); the run's error is raised
    as itself."""

    async def go() -> RunResult:
        outcome: list[RunResult] = []
        failure: list[Exception] = []
        async with Engine(config, clock=clock) as engine, anyio.create_task_group() as tg:
            tg.start_soon(driver)
            try:
                outcome.append(await engine.run())
            except Exception as exc:
                failure.append(exc)
            tg.cancel_scope.cancel()
        if failure:
            raise failure[0]
        return outcome[0]

    return anyio.run(go)


# ------------------------------------------------------------------ the CLI in a process


def cli_env(**extra: str) -> dict[str, str]:
    """The environment of a ``python -m engine.run`` child: no key (local server),
    offline, the repository importable."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("MINT_", "TINKER_")) or k == "TINKER_TELEMETRY"
    }
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(REPO))
    env.update(extra)
    return env


def run_cli(
    args: list[str], cwd: Path, *, timeout: float = 400, **env: str
) -> subprocess.CompletedProcess[str]:
    """``python -m engine.run ARGS`` in ``cwd`` with :func:`cli_env` (plus ``env``)."""
    return subprocess.run(
        [sys.executable, "-m", "engine.run", *args],
        cwd=cwd,
        env=cli_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


SMALL_RUN = (
    "--batch",
    "4",
    "--group",
    "4",
    "--max-tokens",
    "8",
    "--lora-rank",
    "8",
    "--no-progress",
)


def start_cli(args: Sequence[str], *, cwd: Path, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "engine.run", *args],
        cwd=cwd,
        env=cli_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_metrics(
    run_dir: Path, lines: int, proc: subprocess.Popen[str], *, limit_s: float = 240.0
) -> int:
    """Poll metrics.jsonl until it has ``lines`` lines (or the process ended); returns
    the count seen. Polling a file the child appends to is the progress signal; the limit
    only keeps a broken run from hanging the suite."""
    end = time.monotonic() + limit_s
    seen = 0
    while time.monotonic() < end:
        seen = len(metrics(run_dir)) if (run_dir / "metrics.jsonl").exists() else 0
        if seen >= lines or proc.poll() is not None:
            return seen
        time.sleep(0.05)
    return seen


# ------------------------------------------------------------------ tasks


class FailingRewardTask(ArithmeticTask):
    """Two-digit addition whose reward function raises on the problems in ``fail_on``
    (by problem id); the error text echoes ``secret`` when one is given, the way careless
    user code might."""

    def __init__(self, fail_on: Sequence[int], secret: str | None = None) -> None:
        super().__init__("+", 10, 99)
        self.name = "failing-reward"
        self._fail_on = frozenset(fail_on)
        self._secret = secret

    def score(self, response: str, problem: Problem) -> RewardBreakdown:
        if problem.id in self._fail_on:
            extra = f" (key {self._secret})" if self._secret else ""
            raise ZeroDivisionError(f"cannot score {response!r}{extra}")
        return super().score(response, problem)


def failing_reward_task() -> FailingRewardTask:
    """``--task tests.reliability_support:failing_reward_task``: fails on problem 5."""
    return FailingRewardTask([5])


def leaky_reward_task() -> FailingRewardTask:
    """``--task tests.reliability_support:leaky_reward_task``: fails on problem 1 with an
    error that echoes the API key from the environment."""
    return FailingRewardTask([1], secret=os.environ.get("MINT_API_KEY"))
