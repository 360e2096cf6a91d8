"""Stopping a run between train steps, so that its stop checkpoint can be trusted.

Why a gate: a stop (SIGINT, the breaker, the watchdog, a failed sample) can arrive at any
moment, but ``save_state`` only means something when no train step is half-way: once a
step's ``forward_backward``/``optim_step`` are submitted, the server applies them whatever
the client does, so a state saved "now" would hold an unknown number of steps. The gate
tracks whether a step is in flight (from its first submission until its metrics are
logged) and turns a stop request into a cancellation of the run's scope only between
steps: at once when the trainer is idle, or as soon as the step in flight ends. A step
never starts once a stop was requested. If the step does not end within the grace period
the run is cancelled anyway and the gate reports the state as untrusted (no checkpoint;
the previous one stands).

A step whose outcome is unknown (failed or cancelled after submission) also makes the
state untrusted until the engine restores a checkpoint (:meth:`StopGate.restored`).
"""

from __future__ import annotations

import anyio

__all__ = ["StopGate"]


class StopGate:
    """Step-boundary stops for one run. Owned by one event loop; no locking.

    Several steps may be in flight at once (the trainer submits step ``s+1`` while step
    ``s``'s results are outstanding); a stop then waits until every one of them ended."""

    def __init__(self) -> None:
        self.reason: Exception | None = None
        """The first stop request (a RunStopped, or the error that ends the run)."""
        self.requested = anyio.Event()
        self._scope: anyio.CancelScope | None = None
        self._in_flight: set[int] = set()
        self._tainted = False

    @property
    def clean(self) -> bool:
        """True when the server-side state holds exactly the completed steps: no step in
        flight and no step of unknown outcome since the last restore."""
        return not self._in_flight and not self._tainted

    def attach(self, scope: anyio.CancelScope) -> None:
        """The scope a stop cancels (the run's pipeline and recoveries)."""
        self._scope = scope
        if self.reason is not None and not self._in_flight:
            scope.cancel()

    def request(self, reason: Exception) -> None:
        """Ask the run to stop; the first reason wins. Cancels now when no step is in
        flight, else when the last step in flight ends."""
        if self.reason is None:
            self.reason = reason
            self.requested.set()
        if not self._in_flight:
            self._cancel()

    def force(self) -> None:
        """Stop now even mid-step (the grace period is over); a step in flight makes the
        state untrusted."""
        if self._in_flight:
            self._tainted = True
        self._cancel()

    async def begin_step(self, step: int) -> None:
        """Mark step ``step`` in flight before its first submission. Once a stop was
        requested nothing new is submitted: the run's scope is cancelled now (no step in
        flight) or when the steps in flight end."""
        if step in self._in_flight:
            return
        if self.reason is not None:
            if not self._in_flight:
                self._cancel()
            await anyio.sleep_forever()  # cancelled now, or once the steps in flight end
        self._in_flight.add(step)

    def end_step(self, step: int) -> None:
        """Step ``step`` is trained and recorded; a pending stop happens once no step is
        in flight."""
        self._in_flight.discard(step)
        if self.reason is not None and not self._in_flight:
            self._cancel()

    def step_failed(self) -> None:
        """A step in flight failed after submission: the state is untrusted."""
        self._in_flight.clear()
        self._tainted = True

    def restored(self) -> None:
        """A checkpoint was restored: the state is trusted again."""
        self._in_flight.clear()
        self._tainted = False

    def _cancel(self) -> None:
        if self._scope is not None:
            self._scope.cancel()
