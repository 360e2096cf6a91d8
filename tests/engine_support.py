"""Shared pieces of the engine tests: a small, fast config and a runner."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio

from engine import Engine, EngineConfig, RunResult, StepHook, StepResult
from engine.catalog import load_task
from engine.local import LocalServer
from engine.session.preflight import read_server_profile
from engine.tasks import ArithmeticTask

API_KEY = "tml-engine-tests-key"


def small_config(server: LocalServer, run_dir: Path, **overrides: Any) -> EngineConfig:
    """A few tiny steps against ``server`` as a remote endpoint: its model and the task
    arguments it recommends, with a larger learning rate and a smaller rank (quick
    signal, cheap steps)."""
    base = EngineConfig(
        base_url=server.base_url,
        api_key=API_KEY,
        lora_rank=8,
        steps=3,
        batch=4,
        group=4,
        learning_rate=3e-3,
        max_tokens=8,
        temperature=1.0,
        run_dir=run_dir,
    )
    return base.replace(**overrides)


def quickstart_task_knobs(server: LocalServer) -> dict[str, Any]:
    """The arithmetic task arguments ``server`` recommends, as the quickstart loop's
    ``op``, ``min_operand`` and ``max_operand``."""
    profile = anyio.run(read_server_profile, server.base_url, API_KEY)
    task = load_task("arithmetic", profile.task_args["arithmetic"])
    assert isinstance(task, ArithmeticTask)
    return {"op": task.op, "min_operand": task.min_operand, "max_operand": task.max_operand}


def run_engine(config: EngineConfig, **engine_kwargs: Any) -> tuple[list[StepResult], RunResult]:
    """Run the engine to the end; every StepResult is collected by an on_step hook."""
    steps: list[StepResult] = []
    extra = engine_kwargs.pop("on_step", [])
    hooks: list[StepHook] = [steps.append, *(extra if isinstance(extra, list) else [extra])]

    async def go() -> RunResult:
        async with Engine(config, on_step=hooks, **engine_kwargs) as engine:
            return await engine.run()

    result = anyio.run(go)
    return steps, result
