"""Tasks: where problems come from and how responses are rewarded."""

from engine.core.problems import Problem, ProblemSource, RewardBreakdown, SeededSource, Task
from engine.tasks.arithmetic import ArithmeticTask, extract_prediction, score_arithmetic
from engine.tasks.dataset import DatasetTask
from engine.tasks.render import ChatMessage, Prompt, PromptRenderer, TaskContext

__all__ = [
    "ArithmeticTask",
    "ChatMessage",
    "DatasetTask",
    "Problem",
    "ProblemSource",
    "Prompt",
    "PromptRenderer",
    "RewardBreakdown",
    "SeededSource",
    "Task",
    "TaskContext",
    "extract_prediction",
    "score_arithmetic",
]
