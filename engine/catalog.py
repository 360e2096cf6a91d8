"""Turn ``--task`` (and its ``--task-arg`` values) into a Task: the built-in arithmetic
task, a JSONL dataset (``jsonl:PATH``), a Hugging Face dataset on disk (``hf:PATH``),
problems with tests run in the sandbox (``code:PATH``; over several submissions with the
failing tests' output between them: ``code-env:PATH``), ``package.module:attr``, any
of these scored by a judge (``judge:SPEC``), or an agent process per episode
(``agent-cmd:COMMAND``).

Why strict: a typo in a task path should stop the run before any server work, with one
sentence naming what is wrong, not an ImportError traceback halfway through step 1.
Why :func:`task_spec`: a run directory records the spec and arguments of the task it
trains, also when an embedding service passed a task object, so ``--resume`` rebuilds
the same task from the command line.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from engine.common.imports import import_attr
from engine.core.problems import Task
from engine.envs.types import AnyTask, is_env_task
from engine.errors import ConfigError
from engine.objectives import objective_named
from engine.tasks.arithmetic import ArithmeticTask
from engine.tasks.dataset import DataFormat
from engine.tasks.judge_task import judged_task

__all__ = ["BUILTIN_TASKS", "load_task", "preferred_local_model", "task_spec"]

SHIPPED_ENVIRONMENTS = {
    "guess-sum": "engine.envs.examples.guess_sum:GuessSumTask",
    "calculator": "engine.envs.examples.calculator:CalculatorTask",
}
"""Short names of the environments in engine.envs.examples (docs/environments.md)."""

BUILTIN_TASKS = (
    "arithmetic",
    "jsonl:PATH",
    "hf:PATH",
    "code:PATH",
    "code-env:PATH",
    "judge:SPEC",
    "agent-cmd:COMMAND",
    *SHIPPED_ENVIRONMENTS,
)

_DATA_FORMATS: tuple[DataFormat, ...] = ("jsonl", "hf")

_REQUIRED = ("name", "source", "prompt", "score")


def load_task(spec: str, args: Mapping[str, str] | None = None, *, objective: str = "rl") -> Task:
    """``"arithmetic"``, ``"jsonl:PATH"``, ``"hf:PATH"``, a shipped environment
    (``"guess-sum"``, ``"calculator"``) or a user task at ``package.module:attr``,
    where ``attr`` is a Task or a callable (a class or factory) returning one; ``args``
    are passed to it as keyword arguments (strings). ``"judge:SPEC"`` is ``SPEC``'s task
    scored by the judge its ``judge.*`` arguments set (:mod:`engine.tasks.judge_task`);
    ``"agent-cmd:COMMAND"`` runs an agent process per episode (:mod:`engine.agents.process`).
    With ``objective="sft"``, ``"jsonl:PATH"`` and ``"hf:PATH"`` hold chat conversations
    (:mod:`engine.tasks.conversations`), with ``objective="dpo"`` preference pairs
    (:mod:`engine.tasks.pairs`). Raises ConfigError with a one-line reason."""
    args = dict(args or {})
    if spec.startswith("judge:"):
        return judged_task(spec, args, _judged)
    if spec.startswith("agent-cmd:"):  # an agent process per episode (the agents extra)
        from engine.agents.process import agent_command_task

        return agent_command_task(spec.removeprefix("agent-cmd:"), args, load_task)  # type: ignore[return-value]
    if spec.startswith("code:"):  # problems with tests, run in the sandbox
        from engine.tasks.code import CodeTask

        if not spec.removeprefix("code:"):
            raise ConfigError("invalid task 'code:': name the problems, e.g. code:problems.jsonl")
        return CodeTask.from_args(spec.removeprefix("code:"), args)
    if spec.startswith("code-env:"):  # the same, over several submissions with feedback
        from engine.envs.code import CodeEnvTask

        if not spec.removeprefix("code-env:"):
            raise ConfigError(
                "invalid task 'code-env:': name the problems, e.g. code-env:problems.jsonl"
            )
        return CodeEnvTask.from_args(spec.removeprefix("code-env:"), args)  # type: ignore[return-value]
    spec = SHIPPED_ENVIRONMENTS.get(spec, spec)
    if spec == "arithmetic":
        try:
            return ArithmeticTask.from_args(args)
        except ValueError as exc:
            raise ConfigError(f"invalid arithmetic task: {exc}") from exc
    data_format = _data_format(spec)
    if data_format is not None:
        path = spec.removeprefix(f"{data_format}:")
        if not path:
            raise ConfigError(
                f"invalid task '{data_format}:': name the data, e.g. {data_format}:data/train"
                + (".jsonl" if data_format == "jsonl" else ".parquet")
            )
        return objective_named(objective).data_task(path, args, data_format)
    obj = _import_attr(spec)
    attr = spec.partition(":")[2]
    if not _is_task(obj) and callable(obj):
        try:
            obj = obj(**args)
        except Exception as exc:
            raise ConfigError(f"invalid task {spec!r}: calling {attr} failed ({exc})") from exc
    elif args:
        raise ConfigError(
            f"invalid task {spec!r}: it is a task object, so it takes no task arguments "
            f"(got {', '.join(sorted(args))})"
        )
    if not _is_task(obj):
        missing = [name for name in _REQUIRED if not hasattr(obj, name)]
        raise ConfigError(
            f"invalid task {spec!r}: {type(obj).__name__} is not a Task "
            f"(missing {', '.join(missing)})"
        )
    return obj  # type: ignore[no-any-return]


def _import_attr(spec: str) -> Any:
    """The object ``package.module:attr`` names (not called); ConfigError if none."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(
            f"invalid task {spec!r}: use 'arithmetic', 'jsonl:PATH', 'hf:PATH', "
            f"{', '.join(repr(n) for n in SHIPPED_ENVIRONMENTS)}, 'package.module:attr' "
            "or 'judge:SPEC'"
        )
    return import_attr(spec, "task")


def preferred_local_model(task: AnyTask | None, spec: str) -> Path | None:
    """The model directory a task asks the local server to load when none is configured:
    its ``local_model`` attribute (the shipped environments name the packaged agent
    model). Read from ``task``, else from the class or factory ``spec`` names without
    building it; None when there is none (a bad spec is reported by :func:`load_task`)."""
    source: Any = task
    if source is None and spec.startswith("agent-cmd:"):
        from engine.agents.process import AGENT_PROCESS_MODEL

        return AGENT_PROCESS_MODEL
    if source is None:
        spec = SHIPPED_ENVIRONMENTS.get(spec, spec)
        if (
            spec == "arithmetic"
            or spec.startswith(("code:", "code-env:"))
            or _data_format(spec) is not None
        ):
            return None
        try:
            source = _import_attr(spec)
        except ConfigError:
            return None
    model = getattr(source, "local_model", None)
    return Path(model) if isinstance(model, str | Path) else None


def task_spec(task: AnyTask, spec: str, args: Mapping[str, str]) -> tuple[str, dict[str, str]]:
    """The ``--task`` spec and arguments that rebuild ``task``: its own ``spec``
    attribute (the built-in tasks have one), else the configured ``spec`` and ``args``
    when they name a user task, else the task's class as ``module:Class`` (the
    configured arguments were for a built-in task, so none)."""
    own = getattr(task, "spec", None)
    if (
        isinstance(own, tuple)
        and len(own) == 2
        and isinstance(own[0], str)
        and isinstance(own[1], Mapping)
    ):
        return own[0], {str(k): str(v) for k, v in own[1].items()}
    if spec != "arithmetic" and _data_format(spec) is None:
        return spec, dict(args)
    cls = type(task)
    return f"{cls.__module__}:{cls.__qualname__}", {}


def _judged(spec: str, args: Mapping[str, str]) -> Task:
    """The task a judge scores: single-turn, not an environment (whose episodes end with
    rewards of their own)."""
    task = load_task(spec, args)
    if is_env_task(task):
        raise ConfigError(
            f"invalid task 'judge:{spec}': a judge scores single-turn responses, and {spec} "
            "is an environment whose episodes give their own rewards"
        )
    return task


def _data_format(spec: str) -> DataFormat | None:
    return next((f for f in _DATA_FORMATS if spec.startswith(f"{f}:")), None)


def _is_task(obj: object) -> bool:
    """A Task, or an environment task (:class:`engine.envs.types.EnvTask`)."""
    if isinstance(obj, type):
        return False
    return all(hasattr(obj, name) for name in _REQUIRED) or is_env_task(obj)
