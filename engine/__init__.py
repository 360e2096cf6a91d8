"""engine: an async, pipelined RL training engine for MinT.

Embedding API (see ``examples/embed_service.py``)::

    from engine import Engine, EngineConfig

    async with Engine(EngineConfig(steps=4)) as engine:
        result = await engine.run()

The names below are imported on first use, so ``import engine.local`` (the server) does
not pay for the SDK and the pipeline.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.engine import Engine, StepHook
    from engine.results import RunResult, StepResult, StepTimeline
    from engine.state import LoopState, ScoredGroup
    from engine.tasks import ArithmeticTask, Problem, ProblemSource, RewardBreakdown, Task

__all__ = [
    "ArithmeticTask",
    "Engine",
    "EngineConfig",
    "LoopState",
    "Problem",
    "ProblemSource",
    "RewardBreakdown",
    "RunResult",
    "ScoredGroup",
    "StepHook",
    "StepResult",
    "StepTimeline",
    "Task",
]

_HOMES = {
    "EngineConfig": "engine.config",
    "Engine": "engine.engine",
    "StepHook": "engine.engine",
    "RunResult": "engine.results",
    "StepResult": "engine.results",
    "StepTimeline": "engine.results",
    "LoopState": "engine.state",
    "ScoredGroup": "engine.state",
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
    return getattr(importlib.import_module(home), name)
