"""Per-model ordering and exactly-once for training operations.

The client numbers each model's operations with ``seq_id`` (1, 2, 3, ...) and POSTs the
next one as soon as the previous SUBMIT returned, not its result; its retries reuse the
seq_id with a new idempotency key. So the server must (1) apply a model's operations
strictly in seq_id order, holding n until n-1 has been applied, and (2) answer a
resubmitted (model_id, seq_id) with the ORIGINAL future instead of applying it again:
otherwise a retry after a lost answer doubles a gradient or an optimizer step.

A seq_id that never arrives (its client gave up) would block the model forever, so after
``gap_timeout`` the missing numbers are declared abandoned and later operations proceed;
an abandoned seq_id that arrives afterwards is refused.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio


class SeqRejected(Exception):
    """This seq_id cannot be applied any more; the message says why."""


class ModelSequencer:
    """Order and dedupe for one model. Event-loop only (no locking)."""

    def __init__(self, *, gap_timeout: float, dedupe_window: int) -> None:
        self._gap_timeout = gap_timeout
        self._window = dedupe_window
        self.next_seq = 1
        """The seq_id whose turn it is."""
        self._claimed: OrderedDict[int, tuple[str, str]] = OrderedDict()
        """seq_id -> (request_id, body digest) of accepted submissions (bounded window)."""
        self._open: set[int] = set()
        """Accepted seq_ids whose turn has not finished yet."""
        self._turn_changed = anyio.Event()
        self.gaps_skipped = 0
        """seq_ids declared abandoned after gap_timeout."""

    @property
    def queued(self) -> int:
        return len(self._open)

    def lookup(self, seq_id: int) -> tuple[str, str] | None:
        """(request_id, digest) of the submission that already holds ``seq_id``, if any.
        Equal digests mean a resubmission; different ones, a different request."""
        return self._claimed.get(seq_id)

    def claim(self, seq_id: int, request_id: str, digest: str = "") -> None:
        """Register a new submission for ``seq_id`` (check ``lookup`` first); raise
        ``SeqRejected`` when its turn has already passed without it."""
        if seq_id in self._claimed:
            raise SeqRejected(f"seq_id {seq_id} was already submitted for this model")
        if seq_id < self.next_seq:
            raise SeqRejected(
                f"seq_id {seq_id} arrived after this model already moved on to seq_id "
                f"{self.next_seq} (it was abandoned after waiting {self._gap_timeout:g} s, "
                "or is older than the dedupe window); applying it now would reorder training"
            )
        self._claimed[seq_id] = (request_id, digest)
        self._open.add(seq_id)
        while len(self._claimed) > self._window:
            oldest = next(iter(self._claimed))
            if oldest in self._open:
                break
            self._claimed.popitem(last=False)

    @asynccontextmanager
    async def turn(self, seq_id: int) -> AsyncIterator[None]:
        """Hold until every earlier seq_id of this model has been applied (or abandoned);
        on exit the next seq_id may run. Use only for claimed seq_ids."""
        try:
            await self._wait_turn(seq_id)
            yield
        finally:
            self._open.discard(seq_id)
            if self.next_seq == seq_id:
                self._advance(seq_id + 1)

    async def _wait_turn(self, seq_id: int) -> None:
        while self.next_seq < seq_id:
            changed = self._turn_changed
            with anyio.move_on_after(self._gap_timeout) as scope:
                await changed.wait()
            if scope.cancelled_caught and self.next_seq < seq_id:
                self._skip_abandoned(seq_id)

    def _skip_abandoned(self, waiting: int) -> None:
        """Called when ``waiting`` has waited gap_timeout: if the seq_id whose turn it is
        was never submitted, jump to the lowest submitted one."""
        if self.next_seq in self._open:
            return  # the current turn is merely slow, not missing
        target = min(s for s in self._open if s >= self.next_seq)
        target = min(target, waiting)
        self.gaps_skipped += target - self.next_seq
        self._advance(target)

    def _advance(self, seq_id: int) -> None:
        self.next_seq = seq_id
        changed, self._turn_changed = self._turn_changed, anyio.Event()
        changed.set()
        # A skipped seq_id that is already queued may now be next; nothing else to do:
        # waiters re-check next_seq when woken.
