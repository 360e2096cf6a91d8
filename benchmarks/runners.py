"""Run a workload through the quickstart loop or the engine against a local server, and
reduce what happened to a :class:`~benchmarks.measure.RunRecord`.

Why the server is a subprocess (``spawn_local_server``): the benchmarks charge this
process's CPU time to the client, so the server's compute must not share the process;
and one server instance serves every configuration of a benchmark run, so they are
compared on the same weights-loading, the same clock and the same machine state.

Every configuration uses the settings the server recommends for its model (for the
packaged model: its learning rate, LoRA rank and two-digit addition; the engine resolves
them itself, the quickstart loop is given them), the quickstart's sampling settings, and
the same problem seed, so each loop draws the same problems.
"""

from __future__ import annotations

import contextlib
import cProfile
import gc
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx

from benchmarks.measure import (
    GcMeter,
    RunRecord,
    Span,
    StepRecord,
    peak_rss_mb,
    pid_cpu_seconds,
    process_cpu_seconds,
    rss_mb,
    steps_per_two_cycles,
    thread_cpu_delta,
    thread_cpu_seconds,
)
from benchmarks.quickstart_loop import run_quickstart_loop
from engine import Engine, EngineConfig, StepResult
from engine.catalog import load_task
from engine.config import Profile
from engine.local.latency import LatencyProfile
from engine.session.preflight import read_server_profile
from engine.tasks import ArithmeticTask, Problem, ProblemSource, RewardBreakdown

__all__ = [
    "API_KEY",
    "TEMPERATURE",
    "VARIANTS",
    "Target",
    "Variant",
    "Workload",
    "bench_server",
    "run_engine",
    "run_quickstart",
]

API_KEY = "tml-benchmarks"
"""Any key works against a local server started without one; the SDK wants the prefix."""

TEMPERATURE = 0.8
"""The quickstart's sampling temperature."""


@dataclass(frozen=True)
class Workload:
    """Problems per step x samples per problem x max tokens per sample."""

    batch: int
    group: int
    max_tokens: int

    @property
    def name(self) -> str:
        return f"{self.batch}x{self.group}x{self.max_tokens}"

    @classmethod
    def parse(cls, text: str) -> Workload:
        """``BATCHxGROUPxMAX_TOKENS``, e.g. ``8x6x16`` (the quickstart's defaults)."""
        parts = text.lower().split("x")
        try:
            values = [int(p) for p in parts]
        except ValueError:
            values = []
        if len(values) != 3 or min(values) < 1:
            raise ValueError(
                f"workload {text!r} must be BATCHxGROUPxMAX_TOKENS with positive integers, "
                "e.g. 8x6x16"
            )
        return cls(*values)


@dataclass(frozen=True)
class Variant:
    """One engine configuration: the off-policy bound K, its loss, how many train steps
    are submitted ahead, and streaming minibatches."""

    key: str
    label: str
    max_steps_off_policy: int
    loss: str = "ppo"
    submit_ahead: int = 1
    stream_minibatches: int | None = None


VARIANTS: Mapping[str, Variant] = {
    "k0": Variant("k0", "engine K=0", 0, "importance_sampling"),
    "k1": Variant("k1", "engine K=1 (default)", 1),
    "k1await": Variant("k1await", "engine K=1 no submit-ahead", 1, submit_ahead=0),
    "k2": Variant("k2", "engine K=2", 2),
    "stream": Variant("stream", "engine K=0 stream M=2", 0, "importance_sampling", 1, 2),
}
"""Engine configurations by CLI key. ``k0`` is the quickstart's algorithm (on-policy,
importance sampling); ``k1`` is the engine's default; ``k1await`` is the default without
submit-ahead (each step awaited before the next is submitted); ``stream`` sends
forward_backward per 2 arrived groups, on-policy."""


@dataclass(frozen=True)
class Target:
    """A running local server and the settings it recommends for its model."""

    base_url: str
    api_key: str
    profile: Profile
    server_pid: int | None
    latency: str

    @property
    def cycle_s(self) -> float | None:
        """The latency clock cycle in seconds (None without a latency profile)."""
        profile = LatencyProfile.parse(self.latency)
        return profile.cycle if profile is not None else None

    @property
    def model_name(self) -> str:
        assert self.profile.base_model is not None
        return self.profile.base_model

    def task(self) -> ArithmeticTask:
        """The arithmetic task with the server's recommended arguments."""
        task = load_task("arithmetic", self.profile.task_args["arithmetic"])
        assert isinstance(task, ArithmeticTask)
        return task


@contextlib.contextmanager
def bench_server(latency: str | None, *, model_dir: Path | None = None) -> Iterator[Target]:
    """A local server in a child process for the duration of the block; ``latency`` is
    a ``--latency`` profile (``None``/``"off"``: the bare model). Its stderr goes to a
    log file whose tail is shown if it fails to start."""
    from engine.local import spawn_local_server  # imports torch: only when serving

    profile = None if latency in (None, "", "off", "none") else latency
    with tempfile.TemporaryDirectory(prefix="engine-bench-") as tmp:
        log_path = Path(tmp) / "server.log"
        with log_path.open("w") as log:
            try:
                server = spawn_local_server(
                    model_dir, data_dir=Path(tmp) / "data", latency=profile, stderr=log.fileno()
                )
            except RuntimeError as exc:
                tail = log_path.read_text().strip().splitlines()[-5:]
                raise RuntimeError(f"{exc}; server log: {' | '.join(tail)}") from None
            with server:
                yield Target(
                    base_url=server.base_url,
                    api_key=API_KEY,
                    profile=anyio.run(read_server_profile, server.base_url, API_KEY),
                    server_pid=server.process.pid,
                    latency=profile or "off",
                )


# ----------------------------------------------------------------------------- the runs


def run_quickstart(target: Target, workload: Workload, *, steps: int, seed: int) -> RunRecord:
    """The quickstart's sequential loop (``benchmarks.quickstart_loop``) on ``workload``,
    with the server's recommended settings."""
    p, task = target.profile, target.task()
    assert p.lora_rank is not None and p.learning_rate is not None
    server0 = _server_cpu(target)
    counters0 = server_counters(target)
    run = run_quickstart_loop(
        base_url=target.base_url,
        api_key=target.api_key,
        base_model=target.model_name,
        rank=p.lora_rank,
        steps=steps,
        batch=workload.batch,
        group=workload.group,
        lr=p.learning_rate,
        max_tokens=workload.max_tokens,
        temperature=TEMPERATURE,
        seed=seed,
        op=task.op,
        min_operand=task.min_operand,
        max_operand=task.max_operand,
    )
    records = [
        StepRecord(
            step=s.step,
            end=s.end,
            sample_s=s.sample_s,
            score_s=s.score_s,
            train_s=s.snapshot_s + s.train_s,
            samples=s.samples,
            tokens=s.tokens,
            datums=s.datums,
        )
        for s in run.steps
    ]
    spans = [
        Span(sp.step, "train" if sp.stage == "snapshot" else sp.stage, sp.start, sp.end)
        for s in run.steps
        for sp in s.spans
    ]
    return RunRecord(
        name="quickstart",
        started=run.started,
        finished=run.finished,
        steps=records,
        spans=spans,
        client_cpu_s=run.cpu_s,
        server_cpu_s=_delta(server0, _server_cpu(target)),
        server=_counters_delta(counters0, server_counters(target)),
        server_timeline=server_timeline(target, run.started, run.finished),
        cycle_s=target.cycle_s,
    )


class _TimedTask:
    """The arithmetic task, recording when each response was scored (for the score
    spans of the timeline; the engine times the other stages itself)."""

    def __init__(self, inner: ArithmeticTask, batch: int) -> None:
        self.inner = inner
        self._batch = batch
        self.name = inner.name
        self.scored: list[tuple[int, float, float]] = []  # (0-based step, start, end)

    def source(self, seed: int, state: Mapping[str, Any] | None = None) -> ProblemSource:
        return self.inner.source(seed, state)

    def prompt(self, problem: Problem) -> str:
        return self.inner.prompt(problem)

    def score(self, response: str, problem: Problem) -> RewardBreakdown:
        start = time.perf_counter()
        reward = self.inner.score(response, problem)
        self.scored.append((problem.id // self._batch, start, time.perf_counter()))
        return reward


def engine_config(
    target: Target,
    workload: Workload,
    variant: Variant,
    *,
    steps: int,
    seed: int,
    run_dir: Path,
) -> EngineConfig:
    """The engine's configuration for ``workload``; the engine takes the model, learning
    rate, LoRA rank and task arguments from what the server recommends."""
    return EngineConfig(
        base_url=target.base_url,
        api_key=target.api_key,
        steps=steps,
        batch=workload.batch,
        group=workload.group,
        max_tokens=workload.max_tokens,
        temperature=TEMPERATURE,
        seed=seed,
        max_steps_off_policy=variant.max_steps_off_policy,
        loss=variant.loss,  # type: ignore[arg-type]
        submit_ahead=variant.submit_ahead,
        stream_minibatches=variant.stream_minibatches,
        run_dir=run_dir,
        progress=False,
    )


def run_engine(
    target: Target,
    workload: Workload,
    variant: Variant,
    *,
    steps: int,
    seed: int,
    time_scores: bool = True,
    profile_path: Path | None = None,
    freeze_gc: bool = False,
) -> RunRecord:
    """The engine in configuration ``variant`` on ``workload``. The clock starts after
    the session is open (connection, training client, tokenizer), right before the
    initial sampler snapshot, as the quickstart's does. ``time_scores`` wraps the task to
    record score spans (a few hundred ns per response). ``profile_path``: profile the
    event-loop thread's CPU time (cProfile with a thread-CPU clock) into that file.
    ``freeze_gc``: ``gc.freeze()`` once the session is open, as ``python -m engine.run``
    does, so full collections skip the objects left by importing the SDK, torch and the
    tokenizer (without it, one full collection stalls the event loop ~0.4 s).
    Each step is reduced to its record as it arrives; no StepResult is kept."""
    timed = _TimedTask(target.task(), workload.batch)
    records: list[StepRecord] = []
    spans: list[Span] = []
    marks: dict[str, Any] = {}

    def on_step(result: StepResult) -> None:
        records.append(_engine_step(result))
        spans.extend(_engine_spans(result))

    async def go() -> None:
        with tempfile.TemporaryDirectory(prefix="engine-bench-run-") as tmp:
            config = engine_config(
                target, workload, variant, steps=steps, seed=seed, run_dir=Path(tmp) / "run"
            )
            task = timed if time_scores else timed.inner
            async with Engine(config, task=task, on_step=on_step) as engine:
                if freeze_gc:
                    gc.collect()
                    gc.freeze()
                marks["rss0"] = rss_mb()
                marks["server0"] = _server_cpu(target)
                marks["counters0"] = server_counters(target)
                marks["threads0"] = thread_cpu_seconds()
                marks["cpu0"] = process_cpu_seconds()
                marks["started"] = time.perf_counter()
                with _profiled(profile_path), GcMeter() as gc_meter:
                    await engine.run()
                marks["gc"] = gc_meter.to_json()
                if freeze_gc:
                    gc.unfreeze()
                marks["cpu1"] = process_cpu_seconds()
                marks["threads1"] = thread_cpu_seconds()
                marks["server1"] = _server_cpu(target)
                marks["counters1"] = server_counters(target)

    anyio.run(go)
    spans += _score_spans(timed.scored)
    return RunRecord(
        name=variant.key,
        started=marks["started"],
        finished=records[-1].end if records else marks["started"],
        steps=records,
        spans=spans,
        client_cpu_s=marks["cpu1"] - marks["cpu0"],
        server_cpu_s=_delta(marks["server0"], marks["server1"]),
        threads_cpu_s=thread_cpu_delta(marks["threads0"], marks["threads1"]),
        rss_start_mb=marks["rss0"],
        rss_peak_mb=peak_rss_mb(),
        gc=marks["gc"],
        server=_counters_delta(marks["counters0"], marks["counters1"]),
        server_timeline=server_timeline(
            target, marks["started"], records[-1].end if records else marks["started"]
        ),
        cycle_s=target.cycle_s,
        per_two_cycles=steps_per_two_cycles(
            off_policy=variant.max_steps_off_policy, submit_ahead=variant.submit_ahead
        ),
    )


@contextlib.contextmanager
def _profiled(path: Path | None) -> Iterator[None]:
    if path is None:
        yield
        return
    profiler = cProfile.Profile(time.thread_time)
    profiler.enable()
    try:
        yield
    finally:
        profiler.disable()
        path.parent.mkdir(parents=True, exist_ok=True)
        profiler.dump_stats(str(path))


def _engine_step(result: StepResult) -> StepRecord:
    m = result.metrics
    return StepRecord(
        step=result.step,
        end=result.timeline.train_end,
        sample_s=float(m["time/sample"]),
        score_s=float(m["time/score"]),
        train_s=float(m["time/train"]),
        samples=sum(len(t.turns) for g in result.groups for t in g.trajectories),
        tokens=sum(t.action_tokens for g in result.groups for t in g.trajectories),
        datums=int(m["datums"]),
    )


def _engine_spans(result: StepResult) -> list[Span]:
    """The periods with at least one of the step's sample requests in flight, and its
    train span (the engine's own timestamps)."""
    sampling = [(g.sample_started, g.sample_finished) for g in result.groups]
    spans = [Span(result.step, "sample", a, b) for a, b in _merged(sampling)]
    t = result.timeline
    spans.append(Span(result.step, "train", t.train_start, t.train_end))
    return spans


def _score_spans(scored: list[tuple[int, float, float]]) -> list[Span]:
    """The periods with at least one of a step's responses being scored."""
    by_step: dict[int, list[tuple[float, float]]] = {}
    for step0, start, end in scored:
        by_step.setdefault(step0 + 1, []).append((start, end))
    return [Span(step, "score", a, b) for step, items in by_step.items() for a, b in _merged(items)]


def _merged(intervals: list[tuple[float, float]], gap: float = 1e-3) -> list[tuple[float, float]]:
    """Overlapping (or nearly touching) intervals joined into one."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1] + gap:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


_COUNTERS = ("compute_busy_s", "sample_batches", "sample_requests", "cycles_started")


def server_counters(target: Target) -> dict[str, float]:
    """The server's counters now (``GET /api/v1/local/stats``), flattened."""
    response = httpx.get(
        f"{target.base_url}/api/v1/local/stats", headers={"X-API-Key": target.api_key}, timeout=30
    )
    response.raise_for_status()
    stats = response.json()
    out = {k: float(stats[k]) for k in _COUNTERS if isinstance(stats.get(k), int | float)}
    out["http_requests"] = float(sum(stats.get("requests", {}).values()))
    return out


def server_timeline(target: Target, started: float, finished: float) -> dict[str, list[Any]]:
    """What the server did from ``started`` to ``finished`` (``perf_counter`` instants,
    the server's ``time.monotonic`` on Linux), in seconds since ``started``: its latency
    clock's cycle starts and its compute thread's jobs (endpoint, start, end)."""
    response = httpx.get(
        f"{target.base_url}/api/v1/local/stats", headers={"X-API-Key": target.api_key}, timeout=30
    )
    response.raise_for_status()
    stats = response.json()
    return {
        "cycle_starts": [
            t - started for _, t in stats.get("cycle_starts", []) if started <= t <= finished
        ],
        "compute": [
            [label, a - started, b - started]
            for label, a, b in stats.get("compute_jobs", [])
            if b >= started and a <= finished
        ],
    }


def _counters_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after if k in before}


def _server_cpu(target: Target) -> float | None:
    return pid_cpu_seconds(target.server_pid) if target.server_pid is not None else None


def _delta(before: float | None, after: float | None) -> float | None:
    return after - before if before is not None and after is not None else None
