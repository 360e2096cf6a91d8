"""engine: an async, pipelined RL training engine for MinT.

Embedding API (see ``examples/embed_service.py``)::

    from engine import Engine, EngineConfig

    async with Engine(EngineConfig.from_env(steps=4)) as engine:
        result = await engine.run()

The names below are imported on first use, so ``import engine.local`` (the server) does
not pay for the SDK and the pipeline.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.core.state import LoopState, ScoredGroup
    from engine.engine import Engine, StepHook
    from engine.envs.scoring import RewardError
    from engine.errors import (
        CircuitOpen,
        ConfigError,
        EngineError,
        Interrupted,
        ResumeError,
        RunFileError,
        RunStopped,
        ServerUnreachable,
        ServiceError,
        Stalled,
        StepOutcomeUnknown,
    )
    from engine.loop.results import RunResult, StepResult, StepTimeline
    from engine.session.preflight import PreflightError
    from engine.stages import Stages
    from engine.tasks import ArithmeticTask, Problem, ProblemSource, RewardBreakdown, Task

__all__ = [
    "ArithmeticTask",
    "CircuitOpen",
    "ConfigError",
    "Engine",
    "EngineConfig",
    "EngineError",
    "Interrupted",
    "LoopState",
    "PreflightError",
    "Problem",
    "ProblemSource",
    "ResumeError",
    "RewardBreakdown",
    "RewardError",
    "RunFileError",
    "RunResult",
    "RunStopped",
    "ScoredGroup",
    "ServerUnreachable",
    "ServiceError",
    "Stages",
    "Stalled",
    "StepHook",
    "StepOutcomeUnknown",
    "StepResult",
    "StepTimeline",
    "Task",
]

_HOMES = {
    "EngineConfig": "engine.config",
    "Engine": "engine.engine",
    "StepHook": "engine.engine",
    "CircuitOpen": "engine.errors",
    "ConfigError": "engine.errors",
    "EngineError": "engine.errors",
    "Interrupted": "engine.errors",
    "ResumeError": "engine.errors",
    "RunFileError": "engine.errors",
    "RunStopped": "engine.errors",
    "ServerUnreachable": "engine.errors",
    "ServiceError": "engine.errors",
    "Stalled": "engine.errors",
    "StepOutcomeUnknown": "engine.errors",
    "RewardError": "engine.envs.scoring",
    "PreflightError": "engine.session.preflight",
    "Stages": "engine.stages",
    "RunResult": "engine.loop.results",
    "StepResult": "engine.loop.results",
    "StepTimeline": "engine.loop.results",
    "LoopState": "engine.core.state",
    "ScoredGroup": "engine.core.state",
    "ArithmeticTask": "engine.tasks",
    "Problem": "engine.tasks",
    "ProblemSource": "engine.tasks",
    "RewardBreakdown": "engine.tasks",
    "Task": "engine.tasks",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    if home == "engine.config":
        importlib.import_module("engine.tasks")  # the built-in tasks register their settings
    return getattr(importlib.import_module(home), name)
