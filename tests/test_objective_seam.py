"""A new objective is its module, its tests and one registry line (issue 42).

``Echo`` below is a whole objective written outside the engine: it trains each problem's
prompt to echo itself with ``cross_entropy``, samples nothing, checks its own settings
and reports its own metrics. Registered with one line (``OBJECTIVES["echo"] = ECHO``,
here through ``monkeypatch``), it is found by name, loads its data task, and trains
through the real pipeline (the SFT stage, the submitter, the finisher) on a fake
session, and as ``--objective echo`` through the engine itself (the config holds the
name; its checks run before the run), resuming from a checkpoint; no engine file knows
its name."""

from __future__ import annotations

import io
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest
from fake_session import FakeSession
from test_engine_fake_session import fake_config
from test_engine_fake_session import run as run_engine
from test_pipeline_stages import ToyTask, config
from tqdm import tqdm

from engine.catalog import load_task
from engine.config import EngineConfig
from engine.core.datums import Datum
from engine.core.problems import Problem, Task
from engine.core.state import LoopState, ScoredGroup
from engine.core.trajectory import Trajectory, Turn
from engine.engine import Engine, prepare_run
from engine.envs.types import AnyTask
from engine.errors import ConfigError
from engine.loop.groups import NotSampled
from engine.loop.pipeline import Pipeline
from engine.loop.recipe import FinishedStep, HeldOut, StageContext
from engine.loop.results import StepResult
from engine.loop.step_metrics import supervised_step_metrics
from engine.loop.stopping import StopGate
from engine.objectives import (
    OBJECTIVES,
    Headline,
    RunContext,
    StageRole,
    checked_objective,
    objective_named,
)
from engine.objectives.sft import ReadySteps
from engine.run import _run as run_cli
from engine.run import main
from engine.session.api import LossSpec, SamplerHandle, Session, StepTicket
from engine.session.capabilities import Need, loss_need
from engine.stages import check_stages
from engine.tasks.dataset import DataFormat, DatasetTask

pytestmark = pytest.mark.anyio


class EchoSteps(ReadySteps):
    """Each problem's group: one turn whose context and reply are its prompt."""

    def __init__(self, config: EngineConfig, session: Session) -> None:
        super().__init__(config)
        self._tokenizer = session.tokenizer

    async def group(self, problem: Problem, step: int) -> tuple[Trajectory, ...] | NotSampled:
        tokens = tuple(self._tokenizer.encode(problem.question))
        return (Trajectory((Turn(tokens, tokens, None, step, "stop"),)),)

    async def forward_backward(
        self,
        session: Session,
        ticket: StepTicket,
        groups: Sequence[ScoredGroup],
        datums: Sequence[Datum],
    ) -> None:
        await session.submit_forward_backward(ticket, datums, ECHO.loss(self._config))

    def step_metrics(self, step: FinishedStep) -> tuple[dict[str, Any], str]:
        # A step's own values on top of those every step of ready groups has (what the
        # run dir's summary and report read: time/step, off_policy/staleness...).
        tokens = sum(len(t.turns[0].action) for g in step.groups for t in g.trajectories)
        cfg = self._config
        common = supervised_step_metrics(
            *(step.done, cfg.pipeline.steps, step.groups, step.assembled, step.result),
            step.timing,
            lr=cfg.training.learning_rate or 0.0,
        )
        metrics = {**common, "echo/tokens": tokens, "echo/groups": len(step.groups)}
        return metrics, f"Step {step.done}: echo/tokens={tokens}"


class EchoRun:
    evaluator: HeldOut | None = None

    def __init__(self, context: RunContext) -> None:
        self._context = context

    async def start(self) -> None:
        """Nothing to open."""

    async def recipe(self, sampler: SamplerHandle, resumed: bool) -> EchoSteps:
        return EchoSteps(self._context.config, self._context.session)


class EchoObjective:
    name = "echo"
    samples = False
    logs_conversations = False
    held_out = ("greedy", "problems")
    held_out_values: tuple[str, ...] = ()
    stage: StageRole = None  # it runs alone, never in a --then command
    takes_teacher = False
    own_settings: str | None = None
    progress: tuple[str, str] | None = ("echo/tokens", "echoed")
    headlines = (Headline("echo/tokens", "tokens echoed"),)

    def data_task(self, path: str, args: Mapping[str, str], data_format: DataFormat) -> Task:
        return DatasetTask.from_args(path, args, data_format)

    def check_task(self, task: AnyTask) -> None:
        """Any task's prompts echo."""

    def check_config(self, config: EngineConfig, chosen: bool) -> None:
        if chosen and config.pipeline.batch > 8:
            raise ConfigError("--objective echo echoes at most 8 prompts a step")

    def open(self, context: RunContext) -> EchoRun:
        return EchoRun(context)

    def loss(self, config: EngineConfig) -> LossSpec:
        return LossSpec("cross_entropy")

    def needs(self, config: EngineConfig) -> list[Need]:
        return [loss_need(self.loss(config), "--objective echo")]

    def loss_name(self, config: EngineConfig) -> str:
        return "cross_entropy (echo)"

    def summary_table(self, metrics: Sequence[Mapping[str, Any]]) -> list[str]:
        return ["| step | echo/tokens |", "|---:|---:|"] + [
            f"| {m['step']} | {m['echo/tokens']} |" for m in metrics
        ]

    def step_detail(self, metrics: Mapping[str, Any]) -> str:
        return f"  echo/groups={metrics['echo/groups']} | train {metrics['time/train']:.2f}s"

    def summary_figures(self, metrics: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        return {"last_echo_tokens": metrics[-1].get("echo/tokens") if metrics else None}


ECHO = EchoObjective()


@pytest.fixture
def echo(monkeypatch: pytest.MonkeyPatch) -> EchoObjective:
    monkeypatch.setitem(OBJECTIVES, "echo", ECHO)  # its one registry line
    return ECHO


async def _train(
    cfg: EngineConfig, session: FakeSession, tmp_path: Path, state: LoopState | None = None
) -> list[StepResult]:
    task = ToyTask()
    objective = objective_named("echo")
    objective.check_task(task)
    run = objective.open(
        RunContext(
            cfg,
            task,
            session,
            renderer=None,  # type: ignore[arg-type]  # echo renders nothing
            run_dir=tmp_path,
            say=lambda line: None,
            warn=lambda line: None,
            track=lambda step, metrics: None,
            initial_sampler=session.open_base_sampler,
        )
    )
    await run.start()
    source = task.source(cfg.task.seed, None if state is None else state.source_state)
    state = state or LoopState(0, source.state(), 0)
    sampler = SamplerHandle(state.sampler_version, 0)
    steps: list[StepResult] = []

    async def record(result: StepResult) -> None:
        steps.append(result)

    gate = StopGate()
    pipeline = Pipeline(
        StageContext.start(cfg.pipeline, session, source, state, sampler, gate),
        await run.recipe(sampler, state.next_step > 0),
        record,
        learning_rate=cfg.training.learning_rate,
        checkpoint_due=cfg.checkpoint_due,
        evaluate=run.evaluator,
    )
    with anyio.CancelScope() as scope:
        gate.attach(scope)
        await pipeline.run()
    return steps


async def test_a_registered_objective_trains_through_the_pipeline_and_resumes(
    echo: EchoObjective, tmp_path: Path
) -> None:
    session = FakeSession()
    cfg = config(steps=2, batch=2)
    first = await _train(cfg, session, tmp_path)
    assert [s.step for s in first] == [1, 2]
    assert [s.line for s in first] == ["Step 1: echo/tokens=4", "Step 2: echo/tokens=4"]
    echoed = {k: v for k, v in first[1].metrics.items() if k == "step" or k.startswith("echo/")}
    assert echoed == {"step": 2, "echo/tokens": 4, "echo/groups": 2}
    assert {loss.name for loss in session.losses} == {"cross_entropy"}
    assert [e for e in session.log if e[0] in ("sample", "snapshot")] == []  # samples nothing
    assert [g.problem.id for s in first for g in s.groups] == [0, 1, 2, 3]
    # Each datum weights the echoed prompt: p0, p1, ... two tokens each.
    assert [sum(d.loss_fn_inputs["weights"]) for d in first[0].datums] == [2.0, 2.0]

    # A resume from the loop state a checkpoint keeps draws the next problems.
    kept = LoopState.from_dict(json.loads(json.dumps(first[-1].state.to_dict())))
    more = await _train(cfg.replace(pipeline={"steps": 3}), session, tmp_path, kept)
    assert [s.step for s in more] == [3]
    assert [g.problem.id for g in more[0].groups] == [4, 5]


def test_a_registered_objective_loads_its_data_task_by_name(
    echo: EchoObjective, tmp_path: Path
) -> None:
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"question": "q", "answer": "a"}) + "\n")
    task = load_task(f"jsonl:{data}", objective="echo")
    assert isinstance(task, DatasetTask)
    assert objective_named("echo") is echo


def test_an_unknown_objective_is_one_line_naming_the_registered_ones() -> None:
    with pytest.raises(
        ConfigError, match=r"^unknown objective 'kto': one of rl, sft, distill, dpo$"
    ):
        objective_named("kto")
    # The config holds the name; the check is the run's, before anything starts.
    for check in (checked_objective, lambda c: prepare_run(c, None)):
        with pytest.raises(ConfigError, match=r"^unknown objective 'kto': one of rl, sft,"):
            check(EngineConfig(objective="kto"))
    assert main(["--objective", "kto"]) == 2


async def test_a_registered_objective_runs_through_the_engine_by_its_name(
    echo: EchoObjective, tmp_path: Path
) -> None:
    """``--objective echo`` through the facade: the config takes its name, its checks run
    before the run, the run dir records and summarises it, and the run resumes."""
    with pytest.raises(ConfigError, match=r"^--objective echo echoes at most 8 prompts a step$"):
        checked_objective(fake_config(tmp_path / "big", objective="echo", batch=9))
    with pytest.raises(ConfigError, match=r"--refill-groups .* needs --objective rl \(not echo\)"):
        checked_objective(fake_config(tmp_path / "r", objective="echo", refill_groups=1))
    cfg = fake_config(tmp_path / "run", objective="echo", steps=2, group=1)
    assert checked_objective(cfg) is echo
    session = FakeSession()
    console = io.StringIO()
    steps = await run_engine(cfg, ToyTask(), session, console=console)
    assert [s.line for s in steps] == ["Step 1: echo/tokens=4", "Step 2: echo/tokens=4"]
    assert "Step 2: echo/tokens=4\n  echo/groups=2 | train " in console.getvalue()
    assert {loss.name for loss in session.losses} == {"cross_entropy"}
    recorded = json.loads((tmp_path / "run" / "config.json").read_text())
    assert recorded["training"]["objective"] == "echo"
    summary = (tmp_path / "run" / "summary.md").read_text()
    assert "cross_entropy (echo)" in summary and "| 2 | 4 |" in summary
    assert "- tokens echoed (echo/tokens), step 1 -> 2: 4.0000 -> 4.0000\n" in summary
    figures = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert figures["last_echo_tokens"] == 4
    # Every registered objective's keys, None where the run has none of its metrics.
    assert figures["last_dpo"] == {"loss": None, "accuracy": None, "margin": None}
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [m["echo/groups"] for m in metrics if "echo/groups" in m] == [2, 2]

    more = await run_engine(
        EngineConfig(resume=tmp_path / "run", steps=3, progress=False, local=True),
        ToyTask(),
        session,
    )
    assert [s.step for s in more] == [3]
    assert [g.problem.id for g in more[0].groups] == [4, 5]


def test_a_rollout_correction_needs_an_objective_that_samples() -> None:
    cfg = EngineConfig(objective="sft", loss="importance_sampling", rollout_correction="mis")
    with pytest.raises(ConfigError, match=r"needs --objective rl or distill \(not sft\)$"):
        checked_objective(cfg)


def test_an_objective_says_which_stage_of_a_then_command_it_takes(
    echo: EchoObjective, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--then`` asks each objective its stage: echo runs alone until it says it may
    be a second stage, and the refusals name the objectives that may."""
    with pytest.raises(
        ConfigError, match=r"^--then echo: a second stage is rl or distill, trained on the "
    ):
        check_stages(EngineConfig(objective="sft", then="echo"))
    with pytest.raises(ConfigError, match=r"^--then rl follows a first stage \(an --objective sft"):
        check_stages(EngineConfig(objective="echo", then="rl"))
    monkeypatch.setattr(echo, "stage", "second")
    check_stages(EngineConfig(objective="sft", then="echo"))
    with pytest.raises(ConfigError, match=r"add --then rl \(or --then distill or --then echo\)"):
        check_stages(EngineConfig(then_steps=3))
    with pytest.raises(ConfigError, match=r"and --then-teacher needs --then distill$"):
        check_stages(EngineConfig(objective="sft", then="echo", then_teacher="t"))


async def test_the_progress_bar_shows_the_objectives_metric(
    echo: EchoObjective, tmp_path: Path
) -> None:
    cfg = fake_config(tmp_path / "run", objective="echo", steps=2, group=1)
    bar = tqdm(total=1, file=io.StringIO())
    result = await run_cli(Engine(cfg, task=ToyTask(), session=FakeSession()), bar)
    assert result.steps_completed == 2
    assert (bar.n, bar.total, bar.postfix) == (2, 2, "echoed=4.000")
