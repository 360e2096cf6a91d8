"""Latency profile: make the local server feel like the hosted one, in scaled time.

The hosted service trains in discrete clock cycles (~10 s): requests queued when a cycle
starts run in it and their results arrive when it ends; a request that misses the start
waits for the next one. So awaiting forward_backward before submitting optim_step costs
three cycles per step where submitting both back to back costs one. Sampling has a
per-request and per-token cost, and freezing a sampler snapshot takes extra time.

The real model still computes every result; the profile only adds WAITING on the event
loop (never on the compute thread), measured from submission, so compute time is hidden
inside the simulated latency rather than added to it.

Grammar (``--latency PROFILE``)::

    PROFILE   := "off" | NAME [":" OVERRIDES] | OVERRIDES
    NAME      := "mint"
    OVERRIDES := KEY "=" SECONDS ("," KEY "=" SECONDS)*
    KEY       := cycle_s | gather_s | sample_request_s | sample_token_s | snapshot_s | scale

All durations are hosted-service seconds; each is multiplied by ``scale`` before use.
``mint`` = cycle_s=10, gather_s=2.5, sample_request_s=1, sample_token_s=0.02,
snapshot_s=3, scale=0.05 (a 10 s cycle lasts 0.5 s). Example: ``mint:scale=0.02``.

Cycle clock: cycles are numbered from 1 and tick on a fixed grid while there is work. An
operation is assigned at submission to the next cycle to start; it computes as soon as its
seq_id turn has come (possibly before its cycle starts) and its result is released when
the following cycle starts. Computing ahead is what keeps the simulation honest on one
compute thread: the hosted trainer and sampler are separate machines, so a cycle's
training never delays the sampling that runs right after the tick; here it would, by its
real (unscaled) compute time, if the cycle's training computed at the tick. (With the
small model, sampling also runs on a thread of its own: ``engine.local.operations.batcher``.)

The hosted clock ticks on whether or not a model has work; this one pauses when idle:
when a second cycle in a row starts with no work assigned to it or to the next one, the
clock stops, and the next submission restarts it at the first grid point at least
``gather_s`` away, so requests submitted back to back land in the same cycle. One empty
cycle does not stop it: a loop that trains every other cycle (two steps per cycle, then
none) must meet the same tick as one that trains every cycle, not a tick ``gather_s``
earlier (which is what made the engine's steps-in-pairs pattern stick).
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from dataclasses import dataclass, fields, replace

import anyio


class LatencyProfileError(ValueError):
    """The profile text does not parse or a value is out of range."""


@dataclass(frozen=True)
class LatencyProfile:
    """Simulated hosted-service latency, in hosted seconds times ``scale``."""

    name: str = "custom"
    cycle_s: float = 10.0
    """Length of one training clock cycle."""
    gather_s: float = 2.5
    """Minimum wait before the first cycle after an idle period starts."""
    sample_request_s: float = 1.0
    """Fixed cost of one asample request."""
    sample_token_s: float = 0.02
    """Cost per generated token (of the longest sequence in the request)."""
    snapshot_s: float = 3.0
    """Extra cost of save_weights_for_sampler (freezing a sampler snapshot)."""
    scale: float = 1.0
    """Time-scale factor applied to every duration above."""

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name == "name":
                continue
            value = getattr(self, f.name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise LatencyProfileError(f"latency {f.name} must be a number >= 0, got {value!r}")
        if self.cycle_s * self.scale <= 0:
            raise LatencyProfileError("latency cycle_s * scale must be > 0")

    @property
    def cycle(self) -> float:
        return self.cycle_s * self.scale

    @property
    def gather(self) -> float:
        return self.gather_s * self.scale

    @property
    def snapshot(self) -> float:
        return self.snapshot_s * self.scale

    def sample_time(self, generated_tokens: int) -> float:
        """Simulated wall time of one asample request, from submission to result."""
        return (self.sample_request_s + self.sample_token_s * generated_tokens) * self.scale

    @classmethod
    def parse(cls, text: str | None) -> LatencyProfile | None:
        """Parse the grammar in the module docstring; None for "off"/empty."""
        if text is None or text.strip() in ("", "off", "none"):
            return None
        text = "".join(text.split())
        name, sep, rest = text.partition(":")
        if "=" in name:
            base, overrides = cls(), text
        else:
            if name not in PROFILES:
                raise LatencyProfileError(
                    f"unknown latency profile {name!r} (known: off, {', '.join(PROFILES)})"
                )
            base, overrides = PROFILES[name], rest
            if sep and not rest:
                raise LatencyProfileError(f"latency profile {text!r}: nothing after ':'")
        values: dict[str, float] = {}
        keys = [f.name for f in fields(cls) if f.name != "name"]
        for item in overrides.split(",") if overrides else []:
            key, eq, value = item.partition("=")
            if not eq or key not in keys:
                raise LatencyProfileError(
                    f"latency override {item!r} must be KEY=SECONDS with KEY in {', '.join(keys)}"
                )
            try:
                values[key] = float(value)
            except ValueError:
                raise LatencyProfileError(f"latency override {item!r}: not a number") from None
        return replace(base, **values)  # type: ignore[arg-type]


PROFILES: dict[str, LatencyProfile] = {
    "mint": LatencyProfile(
        name="mint",
        cycle_s=10.0,
        gather_s=2.5,
        sample_request_s=1.0,
        sample_token_s=0.02,
        snapshot_s=3.0,
        scale=0.05,
    ),
}


TICKS_KEPT = 4096
IDLE_CYCLES_BEFORE_PAUSE = 2
"""Empty cycle starts in a row after which the clock pauses (see the module docstring)."""


class TrainingClock:
    """The simulated hosted training clock (see the module docstring).

    All methods run on the server's event loop; ``run`` is the ticker task.
    """

    def __init__(self, cycle: float, gather: float) -> None:
        self._cycle = cycle
        self._gather = gather
        self.started = 0
        """Index of the most recently started cycle (0: none yet)."""
        self._assigned: Counter[int] = Counter()
        self._running = False
        self._origin: float | None = None
        self._wake = anyio.Event()
        self._tick = anyio.Event()
        self.ticks: deque[tuple[int, float]] = deque(maxlen=TICKS_KEPT)
        """The most recent cycle starts as (cycle, ``time.monotonic`` seconds)."""

    def assign(self) -> int:
        """Assign a newly submitted operation to the next cycle to start."""
        cycle = self.started + 1
        self._assigned[cycle] += 1
        if not self._running:
            self._running = True
            self._wake.set()
        return cycle

    async def wait_start(self, cycle: int) -> None:
        while self.started < cycle:
            await self._tick.wait()

    async def wait_end(self, cycle: int) -> None:
        await self.wait_start(cycle + 1)

    async def run(self) -> None:
        """Tick while there is work; pause after IDLE_CYCLES_BEFORE_PAUSE empty cycles."""
        while True:
            await self._wake.wait()
            earliest = anyio.current_time() + self._gather
            if self._origin is None:
                self._origin = earliest
            steps = max(0, math.ceil((earliest - self._origin) / self._cycle))
            next_tick = self._origin + steps * self._cycle
            empty = 0
            while True:
                await anyio.sleep_until(next_tick)
                self.started += 1
                self.ticks.append((self.started, time.monotonic()))
                members = self._assigned.pop(self.started, 0)
                tick, self._tick = self._tick, anyio.Event()
                tick.set()
                empty = empty + 1 if members == 0 and self._assigned[self.started + 1] == 0 else 0
                if empty == IDLE_CYCLES_BEFORE_PAUSE:
                    self._running = False
                    self._wake = anyio.Event()
                    break
                next_tick += self._cycle
