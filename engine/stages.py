"""One command, two stages: supervised fine-tuning, then RL or on-policy distillation
from its final weights (``--then rl`` / ``--then distill``; docs/sft.md). Which
objective may take which stage is the objective's to say (its ``stage``,
:data:`engine.objectives.StageRole`).

Each stage is one :class:`~engine.engine.Engine` run with a run directory of its own:
the first in the command's run dir, the second in ``<run dir>/<objective>``, each with
its metrics, checkpoints, summary and report. The second starts from the first's
``final`` state (``init_from``: its weights, with a fresh optimizer) on the same server:
with the local server, one server kept for both (its data dir is the first run dir's
``local-server/``); with a given session, that session.

``--resume RUN`` continues the first stage unless it has its ``final`` checkpoint, then
the second stage from its own latest checkpoint (or from its start when it has none).
The ``then`` settings are the second stage's own (``[then]`` in TOML, ``--then-*``);
every other setting is shared by both stages.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final, TextIO

from engine.common.clock import LOOP_CLOCK, Clock
from engine.common.setting import setting_fields
from engine.config import EngineConfig, stored_settings
from engine.config.groups import ThenSettings
from engine.engine import Engine, SessionFactory, StepHook, prepare_run
from engine.errors import ConfigError, ResumeError, StopRequested
from engine.loop.results import RunResult
from engine.objectives import OBJECTIVES, objective_named, staged
from engine.rundir.checkpoint_log import CheckpointLog
from engine.rundir.directory import LOCAL_SERVER_DIR
from engine.rundir.events import QUIET
from engine.rundir.resume import CONFIG_FILE, read_run_config, resumed_config
from engine.session.api import Session
from engine.session.opening import SharedLocalServer

__all__ = [
    "Stages",
    "check_not_a_second_stage",
    "check_stages",
    "second_stage_config",
]

_THEN_FIELDS: Final = setting_fields(ThenSettings, "then")


def check_stages(config: EngineConfig) -> None:
    """ConfigError (one line, exit 2) for a ``--then`` combination that cannot run. Call
    it once a resumed run's stored settings are merged: ``--resume RUN --then-steps N``
    is fine when RUN has a second stage."""
    then = config.then
    seconds = staged("second")
    if then.objective is None:
        given = [f.flag for f in _THEN_FIELDS if getattr(then, f.name) not in (None, {})]
        if given:
            raise ConfigError(
                f"{', '.join(given)} set a second stage's settings: add "
                f"{_either('--then', seconds)} after an {_first_stages()} run"
            )
        return
    if then.objective not in seconds:
        raise ConfigError(
            f"--then {then.objective}: a second stage is {' or '.join(seconds)}, trained on "
            f"the result of a first stage (an {_first_stages()} run)"
        )
    if objective_named(config.training.objective).stage != "first":
        raise ConfigError(
            f"--then {then.objective} follows a first stage (an {_first_stages()} run), not "
            f"--objective {config.training.objective}"
        )
    if objective_named(then.objective).takes_teacher != (then.teacher is not None):
        taught = _either("--then", [n for n, o in OBJECTIVES.items() if o.takes_teacher])
        raise ConfigError(
            f"{taught} needs --then-teacher (a tinker:// sampler path, a run directory or a "
            f"base model name), and --then-teacher needs {taught}"
        )


def _first_stages() -> str:
    return _either("--objective", staged("first"))


def _either(flag: str, names: list[str]) -> str:
    """``--then rl (or --then distill)``: ``flag`` with the first of ``names``, the
    others as alternatives."""
    if not names:
        return f"{flag} of a registered objective (none is)"
    first, *others = [f"{flag} {name}" for name in names]
    return first + (f" (or {' or '.join(others)})" if others else "")


def second_stage_config(
    config: EngineConfig, run_dir: Path | None, start_from: str | None
) -> EngineConfig:
    """The second stage's config: ``config`` (the first stage's) with its ``then``
    settings in place of the per-stage ones (unset: a run of its own's defaults),
    training in ``run_dir`` (resumed when it holds a run) from the saved state
    ``start_from`` (weights only). ``run_dir`` and ``start_from`` None: the settings
    alone, to check them before the first stage runs."""
    then = config.then
    assert then.objective is not None, "a config without --then has no second stage"
    own = EngineConfig()
    held = run_dir is not None and (run_dir / CONFIG_FILE).is_file()
    resume = run_dir if held else None
    return config.replace(
        objective=then.objective,
        teacher=then.teacher,
        task={"spec": then.task or own.task.spec, "args": dict(then.task_args)},
        steps=then.steps or own.pipeline.steps,
        batch=then.batch or own.pipeline.batch,
        learning_rate=then.learning_rate,
        eval_every=own.evaluation.eval_every if then.eval_every is None else then.eval_every,
        init_from=start_from,
        init_from_optimizer=False,
        run_dir=run_dir,
        resume=resume,
        then=ThenSettings(),
    )


class Stages:
    """The two stages of a config with ``then`` set, one :class:`Engine` after the other
    (the facade's :class:`Engine` runs one stage). ``run()`` returns the last stage's
    result. ``on_step``, ``console``, ``clock`` and ``session`` are passed to each
    stage's engine; a given session serves both stages."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        on_step: StepHook | Sequence[StepHook] = (),
        console: TextIO | None = None,
        clock: Clock = LOOP_CLOCK,
        session: Session | SessionFactory | None = None,
    ) -> None:
        config = resumed_config(config)
        check_stages(config)
        if config.then.objective is None:
            raise ConfigError(
                "Stages runs a config with a second stage: set then "
                f"({' or '.join(staged('second'))})"
            )
        self._config = config
        self._hooks: list[StepHook] = [on_step] if callable(on_step) else list(on_step)
        self._console = console
        self._clock = clock
        self._session = session
        self._engine: Engine | None = None
        self._stop: Exception | None = None

    @property
    def config(self) -> EngineConfig:
        """The command's config: the first stage's, with the second's ``then`` settings."""
        return self._config

    def add_step_hook(self, hook: StepHook) -> None:
        self._hooks.append(hook)

    def request_stop(self, reason: Exception | None = None) -> None:
        """Stop the stage that runs as :meth:`Engine.request_stop` does; no later stage
        starts (``--resume`` does it)."""
        self._stop = reason if reason is not None else StopRequested("Stages.request_stop()")
        if self._engine is not None:
            self._engine.request_stop(self._stop)

    async def run(self, *, on_stage: Callable[[Engine], None] | None = None) -> RunResult:
        """Run the stages that are not done; ``on_stage`` is called with each stage's
        engine once it is entered."""
        config = self._config
        then = config.then
        assert then.objective is not None
        root = config.checkpoints.resume
        first, _ = prepare_run(config, None)  # the model and server both stages use
        # The second stage's bad input stops the command now, not after the first stage.
        later = root / then.objective if root is not None else None
        prepare_run(second_stage_config(first, later, None), None)
        first_done = root is not None and _finished(root)
        if root is not None and first_done:
            _check_then_unchanged(root, config)
        kept = SharedLocalServer(root / LOCAL_SERVER_DIR if root is not None else None)
        async with kept.kept():
            if not first_done:
                engine = self._engine_for(config, kept)
                self._say(1, engine, None)
                result = await self._stage(engine, on_stage)
                root = result.run_dir
                if result.stopped or not _finished(root):
                    return result
            assert root is not None
            if self._stop is not None:
                if isinstance(self._stop, StopRequested):
                    return _stopped_between(root)
                raise self._stop
            final = CheckpointLog(root, log=QUIET).latest()
            assert final is not None
            second = second_stage_config(first, root / then.objective, final.state_path)
            engine = self._engine_for(second, kept)
            self._say(2, engine, final.state_path)
            return await self._stage(engine, on_stage)

    def _engine_for(self, config: EngineConfig, kept: SharedLocalServer) -> Engine:
        engine = Engine(
            config,
            on_step=self._hooks,
            console=self._console,
            clock=self._clock,
            session=self._session,
            local_server=kept,
        )
        if self._stop is not None:
            engine.request_stop(self._stop)
        return engine

    async def _stage(self, engine: Engine, on_stage: Callable[[Engine], None] | None) -> RunResult:
        self._engine = engine
        try:
            async with engine:
                if on_stage is not None:
                    on_stage(engine)
                return await engine.run()
        finally:
            self._engine = None

    def _say(self, stage: int, engine: Engine, start_from: str | None) -> None:
        """The console line that starts a stage."""
        if self._console is None:
            return
        cfg = engine.config
        fields: dict[str, Any] = {
            "stage": stage,
            "objective": cfg.training.objective,
            "task": cfg.task.spec,
            "steps": cfg.pipeline.steps,
        }
        if start_from is not None:
            fields["init_from"] = start_from
            fields["run_dir"] = str(cfg.logging.run_dir)
        if cfg.logging.log_format == "json":
            line = json.dumps({"event": "stage", **fields})
        else:
            where = f" in {cfg.logging.run_dir}, from {start_from}" if start_from else ""
            gap = "\n" if stage > 1 else ""  # after the first stage's Saved: line
            line = (
                f"{gap}Stage {stage} of 2: {fields['objective']} on {fields['task']}, "
                f"{fields['steps']} steps{where}"
            )
        self._console.write(line + "\n")
        self._console.flush()


def _finished(run_dir: Path) -> bool:
    """Whether the run in ``run_dir`` saved its ``final`` checkpoint."""
    latest = CheckpointLog(run_dir, log=QUIET).latest()
    return latest is not None and latest.reason == "final"


def _stopped_between(root: Path) -> RunResult:
    """A stop asked for after the first stage ended, before the second started."""
    latest = CheckpointLog(root, log=QUIET).latest()
    assert latest is not None
    return RunResult(latest.sampler_path, root, latest.step, (), stopped=True)


def _check_then_unchanged(root: Path, config: EngineConfig) -> None:
    """A finished first stage is not run again, so its resume check of the second
    stage's settings is made here: ResumeError (exit 2) when one that may not change
    does."""
    source = str(root / CONFIG_FILE)
    stored = stored_settings(read_run_config(root), source).get("then", {})
    for field in _THEN_FIELDS:
        if field.marker.resume != "fixed":
            continue
        before, now = stored.get(field.name, field.default), getattr(config.then, field.name)
        if before != now:
            raise ResumeError(
                f"cannot resume {root}: then.{field.name} is {before!r} in its {CONFIG_FILE} "
                f"but {now!r} now (use the same settings, or a new run dir)"
            )


def check_not_a_second_stage(run_dir: Path) -> None:
    """ConfigError when ``--resume`` names the second stage's directory: its server
    state lives in the first stage's run dir, so the command resumes from there."""
    parent = run_dir.parent
    if not (parent / CONFIG_FILE).is_file():
        return
    try:
        then = read_run_config(parent).get("then")
    except ResumeError:
        return
    if isinstance(then, dict) and then.get("objective") == run_dir.name:
        raise ConfigError(
            f"{run_dir} is the second stage of {parent}: resume both stages with --resume {parent}"
        )
