"""What a benchmark run measured, and the figures derived from it.

Why one record type for every loop: the quickstart loop and each engine configuration
are compared side by side, so each is reduced to the same :class:`RunRecord` -- per step
its end instant, each stage's busy seconds and its volumes, plus the client's CPU time --
and every figure (steps/s, speedup, pipeline efficiency, CPU share) is computed here by
one definition.

Definitions:

* **steps/s** (end to end): steps / (last step end - run start). The run starts before
  the first sampler snapshot, for the quickstart and the engine alike, so pipeline
  fill-up is charged to the pipelined runs.
* **pace** (steady step time): (t_last - t_first) / (n - 1) over the step ends after the
  first ``WARMUP_STEPS`` (pipeline fill). Never a median of intervals: steps that finish
  in pairs (0.05 s apart, then a long gap) have a meaningless median.
* **cycles/step**: pace / the latency profile's clock cycle.
* **clock floor**: the shortest pace the latency profile's clock allows the loop (see
  :func:`clock_floor`): the ideal step time of a run on a clocked server.
* **pipeline efficiency**: clock floor / pace; never above 1 (asserted). Without a
  latency profile there is no floor and no efficiency.
* **stage time alone** (information, not an ideal): what a stage costs per step when it
  runs by itself, back to back. The quickstart runs every stage alone by construction: its
  medians over steps 2..n of sample (the sample calls), score (decoding + scoring) and
  train (snapshot + forward_backward + optim_step) are its stage times. For the engine,
  the sample and score times come from its on-policy run (K=0) of the same workload on
  the same server, and the train time from the trainer running alone back to back
  (``benchmarks.train_stage``). These are not lower bounds of a pipelined step (a train
  step awaited alone waits for the clock; submitted ahead it does not), so they are
  never divided into a pace.
* **client CPU**: this process's CPU seconds (user + system) during the run; the server
  runs in another process, so none of its work is included.
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

__all__ = [
    "WARMUP_STEPS",
    "GcMeter",
    "RunRecord",
    "Span",
    "StepRecord",
    "clock_floor",
    "pace",
    "peak_rss_mb",
    "pid_cpu_seconds",
    "process_cpu_seconds",
    "rss_mb",
    "stages_alone",
    "steady",
    "steps_per_two_cycles",
    "summarize",
    "thread_cpu_delta",
    "thread_cpu_seconds",
]

T = TypeVar("T")


@dataclass(frozen=True)
class Span:
    """A stage's activity for one step (``perf_counter`` instants)."""

    step: int
    stage: str
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class StepRecord:
    """One trained step: when it ended, its stages' busy seconds, its volumes."""

    step: int
    end: float
    sample_s: float
    score_s: float
    train_s: float
    samples: int
    tokens: int
    datums: int


@dataclass
class RunRecord:
    """One loop's run of one workload against one server."""

    name: str
    started: float
    finished: float
    steps: list[StepRecord]
    spans: list[Span] = field(default_factory=list)
    client_cpu_s: float = 0.0
    server_cpu_s: float | None = None
    threads_cpu_s: dict[str, float] = field(default_factory=dict)
    rss_start_mb: float | None = None
    """Resident memory when the run started (after connecting and loading the tokenizer)."""
    rss_peak_mb: float | None = None
    """The process's peak resident memory when the run ended."""
    gc: dict[str, float] = field(default_factory=dict)
    """Garbage-collector passes and CPU seconds during the run (see :class:`GcMeter`)."""
    server: dict[str, float] = field(default_factory=dict)
    """The local server's counters over the run: compute-thread busy seconds, sample
    batches and requests, clock cycles, HTTP requests."""
    server_timeline: dict[str, list[Any]] = field(default_factory=dict)
    """The server's cycle starts and compute jobs during the run, in seconds since its
    start (``benchmarks.runners.server_timeline``)."""
    cycle_s: float | None = None
    """The server's latency clock cycle in seconds (None: no latency profile)."""
    per_two_cycles: int | None = None
    """Steps the loop can fit in two clock cycles (None: the quickstart's discipline,
    see :func:`clock_floor`)."""

    def to_json(
        self, *, spans: bool = False, alone: dict[str, float] | None = None
    ) -> dict[str, Any]:
        data: dict[str, Any] = {
            "name": self.name,
            "wall_s": self.finished - self.started,
            "client_cpu_s": self.client_cpu_s,
            "server_cpu_s": self.server_cpu_s,
            "threads_cpu_s": self.threads_cpu_s,
            "rss_start_mb": self.rss_start_mb,
            "rss_peak_mb": self.rss_peak_mb,
            "gc": self.gc,
            "server": self.server,
            "steps": [{**asdict(s), "end": s.end - self.started} for s in self.steps],
            "summary": summarize(self, alone),
        }
        if spans:
            data["server_timeline"] = self.server_timeline
            data["spans"] = [
                {**asdict(s), "start": s.start - self.started, "end": s.end - self.started}
                for s in self.spans
            ]
        return data


WARMUP_STEPS = 2
"""Steps left out of the pace: the pipeline fills (K=1 samples two steps at once)."""


def pace(ends: Sequence[float]) -> float:
    """Seconds per step over step ends ``ends`` (in order): (last - first) / (n - 1)."""
    if len(ends) < 2:
        raise ValueError("a pace needs at least two step ends")
    return (ends[-1] - ends[0]) / (len(ends) - 1)


def steady(steps: Sequence[T]) -> Sequence[T]:
    """The steps (or step ends, in order) a pace is measured over: after the warm-up
    steps, when at least two are left (else every step)."""
    return steps[WARMUP_STEPS:] if len(steps) - WARMUP_STEPS >= 2 else steps


def steps_per_two_cycles(*, off_policy: int, submit_ahead: int) -> int:
    """How many engine steps the latency clock can fit in two cycles: the engine submits
    step ``j + m`` (``m = min(K, submit_ahead) + 1``) only once step ``j`` came back (its
    sampler version for K, its place in flight for submit-ahead), so it lands two cycles
    after step ``j`` at the earliest."""
    return min(off_policy, submit_ahead) + 1


def clock_floor(
    n: int, cycle: float, per_two_cycles: int | None, *, trained: int | None = None
) -> float:
    """The shortest pace ``n`` consecutive step ends can have on the latency clock: a
    step's calls land in one cycle and come back when it ends; at most
    ``per_two_cycles`` steps fit in two cycles (:func:`steps_per_two_cycles`), and the
    quickstart (``None``) awaits its snapshot, forward_backward and optim_step in turn,
    three cycles per step. The span of ``n`` ends is at least that many cycles, less one
    cycle for the client's own delay in recording the first step. Only the ``trained``
    steps among the ``n`` (default: all) wait on the clock: a step whose rewards left
    nothing to train sends no training call and ends as soon as it is scored."""
    if n < 2:
        raise ValueError("a floor needs at least two steps")
    clocked = n if trained is None else trained
    if not 0 <= clocked <= n:
        raise ValueError(f"trained steps must be between 0 and {n}, got {clocked}")
    if clocked < 2:
        return 0.0
    gaps = clocked - 1
    cycles = 3 * gaps if per_two_cycles is None else 2 * (gaps // per_two_cycles)
    return max(0, cycles - 1) * cycle / (n - 1)


def stages_alone(record: RunRecord) -> dict[str, float]:
    """Median busy seconds per stage over steps 2..n (all steps when there is one)."""
    later = record.steps[1:] or record.steps
    return {
        "sample": statistics.median(s.sample_s for s in later),
        "score": statistics.median(s.score_s for s in later),
        "train": statistics.median(s.train_s for s in later),
    }


def summarize(
    record: RunRecord, alone: dict[str, float] | None = None
) -> dict[str, float | int | None]:
    """The headline figures of one run (see the module docstring for definitions);
    ``alone``: each stage's time alone, by stage (default: this run's own medians)."""
    steps = record.steps
    wall = max(record.finished - record.started, 1e-9)
    steady_steps = steady(steps)
    ends = [s.end for s in steady_steps]
    trained = sum(s.datums > 0 for s in steady_steps)
    step_time = pace(ends) if len(ends) >= 2 else wall
    cycle = record.cycle_s
    floor = (
        clock_floor(len(ends), cycle, record.per_two_cycles, trained=trained)
        if cycle is not None and len(ends) >= 2
        else None
    )
    if alone is None:
        alone = stages_alone(record) if steps else {}
    efficiency = floor / step_time if floor is not None and step_time > 0 else None
    assert efficiency is None or efficiency <= 1.0, (
        f"{record.name}: pace {step_time:.3f} s/step beats the clock floor {floor:.3f} s: "
        "the floor or the pace is wrong"
    )
    samples = sum(s.samples for s in steps)
    tokens = sum(s.tokens for s in steps)
    return {
        "steps": len(steps),
        "steady_steps": len(ends),
        "wall_s": wall,
        "steps_per_s": len(steps) / wall,
        "samples_per_s": samples / wall,
        "tokens_per_s": tokens / wall,
        "step_time_s": step_time,
        "cycles_per_step": step_time / cycle if cycle else None,
        "first_step_s": steps[0].end - record.started if steps else None,
        "sample_alone_s": alone.get("sample"),
        "score_alone_s": alone.get("score"),
        "train_alone_s": alone.get("train"),
        "ideal_step_time_s": floor,
        "efficiency": efficiency,
        "mean_sample_s": _mean([s.sample_s for s in steps]),
        "mean_score_s": _mean([s.score_s for s in steps]),
        "mean_train_s": _mean([s.train_s for s in steps]),
        "datums": sum(s.datums for s in steps),
        "samples": samples,
        "client_cpu_s": record.client_cpu_s,
        "client_cpu_share": record.client_cpu_s / wall,
        "client_cpu_ms_per_step": 1000 * record.client_cpu_s / len(steps) if steps else None,
        "client_cpu_ms_per_1k_samples": (1e6 * record.client_cpu_s / samples if samples else None),
        "server_compute_share": (
            record.server["compute_busy_s"] / wall if "compute_busy_s" in record.server else None
        ),
    }


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def positive_int(text: str) -> int:
    """An argparse type: a positive integer."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


# ------------------------------------------------------------------------------ CPU time


def process_cpu_seconds() -> float:
    """User + system CPU seconds of this process, all threads (live and exited)."""
    t = os.times()
    return t.user + t.system


class GcMeter:
    """CPU time the garbage collector takes, by generation, while installed.

    Why: the client imports torch and transformers (through the SDK and the tokenizer),
    which leaves some 300k long-lived objects; every full (generation 2) collection walks
    all of them, and a run that keeps many objects alive triggers such collections.
    """

    def __init__(self) -> None:
        self._started: dict[int, float] = {}
        self.seconds = [0.0, 0.0, 0.0]
        self.passes = [0, 0, 0]

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        ident = threading.get_ident()
        if phase == "start":
            self._started[ident] = time.thread_time()
        elif ident in self._started:
            generation = info.get("generation", 2)
            self.seconds[generation] += time.thread_time() - self._started.pop(ident)
            self.passes[generation] += 1

    def __enter__(self) -> GcMeter:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def to_json(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for g in range(3):
            out[f"gen{g}_passes"] = self.passes[g]
            out[f"gen{g}_s"] = self.seconds[g]
        out["total_s"] = sum(self.seconds)
        return out


def rss_mb() -> float | None:
    """This process's resident memory now, in MB (Linux; None elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes vs KiB


def _stat_cpu(path: str) -> float | None:
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()  # after "pid (comm)"
    ticks = int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def pid_cpu_seconds(pid: int) -> float | None:
    """CPU seconds of another process (e.g. the server); None where /proc is missing."""
    return _stat_cpu(f"/proc/{pid}/stat")


def thread_cpu_seconds() -> dict[str, float]:
    """CPU seconds of this process's live threads, summed by thread role: the event loop
    running the engine ("main"), the SDK's background I/O thread ("sdk"), worker threads
    ("workers": scoring, blocking SDK calls) and anything else ("other"). Linux only;
    empty elsewhere."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    main = threading.main_thread().native_id
    out: dict[str, float] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        cpu = _stat_cpu(f"/proc/self/task/{tid}/stat")
        if cpu is None:
            continue
        role = _role(int(tid), main, names.get(int(tid), ""))
        out[role] = out.get(role, 0.0) + cpu
    return out


def _role(tid: int, main: int | None, name: str) -> str:
    if tid == main:
        return "main"
    if "_background_thread_func" in name:
        return "sdk"
    if "worker" in name.lower():
        return "workers"
    return "other"


def thread_cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Per-role CPU between two :func:`thread_cpu_seconds` readings (threads that exited
    in between are missing from both: their time shows up only in the process total)."""
    return {k: after[k] - before.get(k, 0.0) for k in after if after[k] - before.get(k, 0.0) > 0}
