"""``python -m engine.run``: the MinT quickstart's custom-reward RL run, pipelined.

With no flags it behaves like ``quickstart/custom_reward.py`` (same environment
variables, same per-step line, ``Saved: <path>`` at the end); without MINT_API_KEY it
starts the local server and trains its small model on two-digit addition. Every knob is
a flag (``--help`` shows them by group, each with its environment variable and default).

``--resume <run dir>`` continues a run from its latest checkpoint with the settings in
its config.json (flags may extend ``--steps`` or change timeouts/retries; changing what
is trained is refused); a run dir whose start-up never finished (no checkpoint yet) is
started over from step 0. SIGINT/SIGTERM stop the run after the step in flight with an
``interrupt`` checkpoint (a second signal exits at once).

Exit codes: 0 done; 2 invalid configuration (one line on stderr); 1 runtime failure
(``Error: ...``, one line); 130 interrupted.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final, NoReturn, TextIO

import anyio
from tqdm import tqdm

from engine.common.cli import OneLineErrorParser, add_version_flag, program_name
from engine.config import (
    EngineConfig,
    add_setting_arguments,
    check_installed,
    config_from_sources,
    read_config_file,
)
from engine.config.models import setting_at
from engine.config.sources import env_text
from engine.engine import Engine
from engine.errors import ConfigError, exit_code, format_error
from engine.loop.results import RunResult, StepResult
from engine.objectives import checked_objective, objective_named
from engine.redact import install_stdlib_redaction, redact_text
from engine.rundir.events import QUIET
from engine.rundir.resume import resumed_config
from engine.stages import Stages, check_not_a_second_stage, check_stages
from engine.supervision.loop_monitor import LoopMonitor
from engine.supervision.watchdog import SignalInterrupt

__all__ = ["build_parser", "exit_process", "main"]

_RESUME: Final = setting_at("checkpoints.resume")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog=program_name("engine.run", "engine-run"),
        description=(
            "Pipelined RL fine-tuning on MinT (the quickstart's custom-reward loop). "
            "Without MINT_API_KEY the local MinT-compatible server is started."
        ),
    )
    add_setting_arguments(parser)
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="a TOML file of settings: a table per group ([sampling] temperature = 1.0), "
        "or flat keys named like the flags; flags and the environment override it",
    )
    add_version_flag(parser)
    return parser


def parse_config(argv: Sequence[str] | None, environ: Mapping[str, str]) -> EngineConfig:
    """The config from the command line and the environment (ConfigError, exit 2)."""
    args = vars(build_parser().parse_args(argv))
    config_file = args.pop("config")
    from_file = read_config_file(Path(config_file).expanduser()) if config_file else {}
    assert _RESUME is not None
    resume_env = env_text(_RESUME, environ)
    resume = (
        args.get("resume")
        or (resume_env[1] if resume_env else None)
        or from_file.get("checkpoints", {}).get("resume")
    )
    config = config_from_sources(args, environ, defaults=from_file)
    if resume is not None:
        # A resumed run keeps its settings unless given anew (the engine's rule, applied
        # here too so that --help-level errors and the progress bar see them): ResumeError,
        # exit 2.
        run_dir = Path(resume).expanduser()
        check_not_a_second_stage(run_dir)
        config = resumed_config(config, run_dir)
    check_stages(config)  # after the stored settings: --resume RUN --then-steps N
    checked_objective(config)
    check_installed(config)
    return config


class _TqdmSafeStream:
    """stdout that writes around an active tqdm bar instead of through it."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        with tqdm.external_write_mode(file=self._stream):
            self._stream.write(text)
        return len(text)

    def flush(self) -> None:
        self._stream.flush()


async def _run(runner: Engine | Stages, bar: tqdm[Any] | None) -> RunResult:
    shown: list[tuple[str, str]] = []  # the running stage's objective's progress metric

    def advance(step: StepResult) -> None:
        if bar is not None:
            bar.n = step.step  # a recovery redoes steps: show where the run stands
            for metric, label in shown:
                if step.metrics.get(metric) is not None:
                    bar.set_postfix({label: f"{step.metrics[metric]:.3f}"})

    def entered(engine: Engine) -> None:
        # Everything alive now (SDK, tokenizer, a local server's model) lives for the
        # whole run: keep it out of the collector's full passes.
        gc.freeze()
        if bar is not None:
            bar.reset(total=engine.config.pipeline.steps)
        progress = objective_named(engine.config.training.objective).progress
        shown[:] = [] if progress is None else [progress]

    runner.add_step_hook(advance)
    # The engine reports the stop itself (console + events.jsonl).
    interrupt = SignalInterrupt(on_interrupt=runner.request_stop, log=QUIET)
    monitor = LoopMonitor(blocked_limit=runner.config.pipeline.stall_timeout)
    result: RunResult | None = None
    async with anyio.create_task_group() as tg:
        await tg.start(interrupt.watch)
        tg.start_soon(monitor.beat)
        monitor.start((signal.SIGINT, signal.SIGTERM))
        try:
            if isinstance(runner, Stages):
                result = await runner.run(on_stage=entered)
            else:
                async with runner:
                    entered(runner)
                    result = await runner.run()
        finally:
            monitor.stop()
            tg.cancel_scope.cancel()
    assert result is not None
    return result


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    # A console script (engine-run) starts with its own directory on sys.path, not the
    # current one: find --task modules in the current directory as `python -m` does.
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    install_stdlib_redaction()
    try:
        config = parse_config(argv, os.environ)
        show_bar = config.logging.progress and sys.stderr.isatty()
        console: TextIO = _TqdmSafeStream(sys.stdout) if show_bar else sys.stdout  # type: ignore[assignment]
        runner = (
            Stages(config, console=console)
            if config.then.objective is not None
            else Engine(config, console=console)
        )
    except ConfigError as exc:
        print(f"Error: {redact_text(str(exc))}", file=sys.stderr)
        return 2
    bar = (
        tqdm(total=config.pipeline.steps, desc="steps", unit="step", file=sys.stderr, leave=False)
        if show_bar
        else None
    )
    try:
        result = anyio.run(_run, runner, bar)
    except (Exception, KeyboardInterrupt) as exc:
        if bar is not None:
            bar.close()
        print(format_error(exc), file=sys.stderr)
        return exit_code(exc)
    if bar is not None:
        bar.close()
    if config.logging.log_format == "json":
        print(f"Saved: {result.final_path}", file=sys.stderr)
    return 0


def exit_process(code: int) -> NoReturn:
    """Exit with ``code``, also while a worker thread still blocks in an SDK call the run
    abandoned (a snapshot against a dead server): the interpreter would otherwise wait
    for that thread until the SDK gives up, minutes after the error was printed."""
    lingering = [
        t
        for t in threading.enumerate()
        if t is not threading.main_thread() and t.is_alive() and not t.daemon
    ]
    if not lingering:
        raise SystemExit(code)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_process(main())
