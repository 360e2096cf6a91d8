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
import anyio.lowlevel

__all__ = ["StopGate"]


class StopGate:
    """Step-boundary stops for one run. Owned by one event loop; no locking."""

    def __init__(self) -> None:
        self.reason: Exception | None = None
        """The first stop request (a RunStopped, or the error that ends the run)."""
        self.requested = anyio.Event()
        self._scope: anyio.CancelScope | None = None
        self._in_step: int | None = None
        self._tainted = False

    @property
    def in_step(self) -> int | None:
        """The 1-based number of the step in flight, or None between steps."""
        return self._in_step

    @property
    def clean(self) -> bool:
        """True when the server-side state holds exactly the completed steps: no step in
        flight and no step of unknown outcome since the last restore."""
        return self._in_step is None and not self._tainted

    def attach(self, scope: anyio.CancelScope) -> None:
        """The scope a stop cancels (the run's pipeline and recoveries)."""
        self._scope = scope
        if self.reason is not None and self._in_step is None:
            scope.cancel()

    def request(self, reason: Exception) -> None:
        """Ask the run to stop; the first reason wins. Cancels now when no step is in
        flight, else when the step in flight ends."""
        if self.reason is None:
            self.reason = reason
            self.requested.set()
        if self._in_step is None:
            self._cancel()

    def force(self) -> None:
        """Stop now even mid-step (the grace period is over); a step in flight makes the
        state untrusted."""
        if self._in_step is not None:
            self._tainted = True
        self._cancel()

    async def begin_step(self, step: int) -> None:
        """Mark step ``step`` in flight before its first submission. If a stop was
        requested the run's scope is cancelled instead, so nothing is submitted."""
        if self._in_step == step:
            return
        if self.reason is not None:
            self._cancel()
            await anyio.lowlevel.checkpoint()  # the cancellation takes effect here
        self._in_step = step

    def end_step(self) -> None:
        """The step in flight is trained and recorded; a pending stop happens now."""
        self._in_step = None
        if self.reason is not None:
            self._cancel()

    def step_failed(self) -> None:
        """The step in flight failed after submission: the state is untrusted."""
        self._in_step = None
        self._tainted = True

    def restored(self) -> None:
        """A checkpoint was restored: the state is trusted again."""
        self._in_step = None
        self._tainted = False

    def _cancel(self) -> None:
        if self._scope is not None:
            self._scope.cancel()
