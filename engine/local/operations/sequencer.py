"""Per-model ordering and exactly-once for training operations.

The client numbers each model's operations with ``seq_id`` (1, 2, 3, ...) and POSTs the
next one as soon as the previous SUBMIT returned, not its result; its retries reuse the
seq_id with a new idempotency key. So the server must (1) apply a model's operations
strictly in seq_id order, holding n until n-1 has been applied, and (2) answer a
resubmitted (model_id, seq_id) with the ORIGINAL future instead of applying it again:
otherwise a retry after a lost answer doubles a gradient or an optimizer step.

A gap in the numbers is never skipped: skipping would apply later operations without
the missing one, and a stray far-ahead seq_id would make the server jump past the real
client's next operations. Instead a new seq_id may run at most ``max_seq_gap`` past the
first missing one (anything further is refused at once), and an operation that has
waited ``gap_timeout`` for a missing seq_id fails and is forgotten, as if it had never
arrived: the real client's own operation with that number is still accepted later.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio

from engine.common.clock import LOOP_CLOCK, Clock


class SeqRejected(Exception):
    """This seq_id cannot be applied; the message says why."""


class ModelSequencer:
    """Order and dedupe for one model. Event-loop only (no locking)."""

    def __init__(
        self,
        *,
        gap_timeout: float,
        dedupe_window: int,
        max_seq_gap: int,
        clock: Clock | None = None,
    ) -> None:
        self._gap_timeout = gap_timeout
        self._window = dedupe_window
        self._max_gap = max_seq_gap
        self._clock = clock or LOOP_CLOCK
        self.next_seq = 1
        """The seq_id whose turn it is."""
        self._claimed: OrderedDict[int, tuple[str, str]] = OrderedDict()
        """seq_id -> (request_id, body digest) of accepted submissions (bounded window)."""
        self._open: set[int] = set()
        """Accepted seq_ids whose turn has not finished yet."""
        self._turn_changed = anyio.Event()
        self.gap_timeouts = 0
        """Operations refused after waiting gap_timeout for a missing seq_id."""

    @property
    def queued(self) -> int:
        return len(self._open)

    def first_missing(self) -> int:
        """The lowest seq_id at or after the current turn that nobody has submitted:
        the next one a well-behaved client sends."""
        seq = self.next_seq
        while seq in self._open:
            seq += 1
        return seq

    def lookup(self, seq_id: int) -> tuple[str, str] | None:
        """(request_id, digest) of the submission that already holds ``seq_id``, if any.
        Equal digests mean a resubmission; different ones, a different request."""
        return self._claimed.get(seq_id)

    def claim(self, seq_id: int, request_id: str, digest: str = "") -> None:
        """Register a new submission for ``seq_id`` (check ``lookup`` first); raise
        ``SeqRejected`` when its turn has already passed or it is implausibly far ahead."""
        if seq_id in self._claimed:
            raise SeqRejected(f"seq_id {seq_id} was already submitted for this model")
        if seq_id < self.next_seq:
            raise SeqRejected(
                f"seq_id {seq_id} arrived after this model already moved on to seq_id "
                f"{self.next_seq} (or is older than the dedupe window); applying it now "
                "would reorder training"
            )
        expected = self.first_missing()
        if seq_id > expected + self._max_gap:
            raise SeqRejected(
                f"seq_id {seq_id} is implausible: this model expects seq_id {expected} next "
                f"and accepts at most {self._max_gap} seq_ids beyond it (--max-seq-gap); "
                "seq_ids number one training client's operations from 1"
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
        """Hold until every earlier seq_id of this model has been applied; on exit the
        next seq_id may run. Use only for claimed seq_ids. Raises ``SeqRejected`` (and
        forgets ``seq_id``) when a missing earlier seq_id does not arrive in time."""
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
            if self.next_seq in self._open:  # the current turn is running: no gap
                await changed.wait()
                continue
            deadline = self._clock.now() + self._gap_timeout
            if await self._set_before(changed, deadline):
                continue
            if self.next_seq < seq_id and self.next_seq not in self._open:
                raise self._give_up(seq_id)

    async def _set_before(self, event: anyio.Event, deadline: float) -> bool:
        """Wait for ``event`` until ``deadline`` (on the injected clock); True if set."""
        async with anyio.create_task_group() as tg:

            async def expire() -> None:
                await self._clock.sleep(deadline - self._clock.now())
                tg.cancel_scope.cancel()

            tg.start_soon(expire)
            await event.wait()
            tg.cancel_scope.cancel()
        return event.is_set()

    def _give_up(self, seq_id: int) -> SeqRejected:
        missing = self.next_seq
        self._claimed.pop(seq_id, None)
        self.gap_timeouts += 1
        return SeqRejected(
            f"seq_id {seq_id} waited {self._gap_timeout:g} s for seq_id {missing} of this "
            "model, which never arrived; operations apply strictly in seq_id order and a "
            "missing one is never skipped, so this one was refused (a training client that "
            "lost a submission cannot continue: create a new one, e.g. from a checkpoint)"
        )

    def _advance(self, seq_id: int) -> None:
        self.next_seq = seq_id
        changed, self._turn_changed = self._turn_changed, anyio.Event()
        changed.set()
