"""Tasks: where problems come from and how responses are rewarded."""

from engine.tasks.arithmetic import ArithmeticTask, extract_prediction, score_arithmetic
from engine.tasks.base import Problem, ProblemSource, RewardBreakdown, SeededSource, Task
from engine.tasks.loader import BUILTIN_TASKS, load_task

__all__ = [
    "BUILTIN_TASKS",
    "ArithmeticTask",
    "Problem",
    "ProblemSource",
    "RewardBreakdown",
    "SeededSource",
    "Task",
    "extract_prediction",
    "load_task",
    "score_arithmetic",
]
