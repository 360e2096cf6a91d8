"""Server counters: what was asked, applied, deduplicated, injected and batched.

Chaos tests compare ``optimizer_steps`` with what the engine believes it applied; the
benchmark reads batching and cycle counts. ``snapshot()`` returns plain copies so readers
on other threads never see a dict change under them.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

OP_CYCLES_KEPT = 1024


@dataclass(frozen=True)
class OpCycle:
    """A training operation under the latency clock: which cycle it ran in."""

    seq_id: int
    endpoint: str
    cycle: int
    submitted: float = 0.0
    """When the operation was submitted (``time.monotonic`` seconds)."""


@dataclass(frozen=True)
class StatsSnapshot:
    requests: dict[str, int]
    """HTTP requests received, by endpoint (e.g. "forward_backward", "retrieve_future")."""
    applied: dict[str, int]
    """Backend operations completed successfully, by endpoint."""
    optimizer_steps: dict[str, int]
    """Applied optim_steps per model_id."""
    dedupe_hits: dict[str, int]
    """Resubmissions answered with the original future, by endpoint."""
    faults_injected: dict[str, int]
    """Injected faults by kind ("500", "drop", ...) and by "kind@endpoint"."""
    sample_batches: int
    sample_requests: int
    largest_sample_batch: int
    cycles_started: int
    """Latency clock cycles started (0 without a latency profile)."""
    op_cycles: dict[str, list[OpCycle]]
    """Per model_id, the cycle of each recent training operation (latency profile only)."""
    seq_gap_timeouts: int
    """Training operations refused after waiting seq_gap_timeout_s for a missing seq_id."""
    futures_pending: int
    futures_retained: int
    polls_held: int
    """retrieve_future polls currently held open (long-poll)."""
    compute_busy_s: float
    """Seconds spent computing, summed over the compute thread and the sampler thread
    (when sampling runs apart: then it can grow faster than the wall clock)."""
    compute_jobs: list[tuple[str, float, float]]
    """Recent compute-thread (and sampler-thread) jobs as (endpoint, start, end),
    ``time.monotonic`` seconds, by start."""
    cycle_starts: list[tuple[int, float]]
    """Recent latency clock cycle starts as (cycle, ``time.monotonic`` seconds)."""
    models: int
    sampling_sessions: int
    held: dict[str, Any] = field(default_factory=dict)
    """What the server holds in memory (sessions, model ids, snapshots) and how much it
    released (evictions, silent sessions)."""
    sampling_queue: dict[str, int] = field(default_factory=dict)
    """The sampling slots (``engine.local.operations.sampling_gate``): slots (0: no limit), requests
    running and waiting now, how many ever waited, 408s answered while they did."""

    def to_json(self) -> dict[str, Any]:
        data = dict(vars(self))
        data["op_cycles"] = {
            model: [vars(op) for op in ops] for model, ops in self.op_cycles.items()
        }
        return data


@dataclass
class Stats:
    """Mutable counters, owned by the service (event loop only)."""

    requests: Counter[str] = field(default_factory=Counter)
    applied: Counter[str] = field(default_factory=Counter)
    optimizer_steps: Counter[str] = field(default_factory=Counter)
    dedupe_hits: Counter[str] = field(default_factory=Counter)
    op_cycles: dict[str, deque[OpCycle]] = field(default_factory=dict)

    def record_cycle(self, model_id: str, op: OpCycle) -> None:
        self.op_cycles.setdefault(model_id, deque(maxlen=OP_CYCLES_KEPT)).append(op)
