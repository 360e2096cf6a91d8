"""Futures: every mutating call answers a request_id at once; results are long-polled.

The client polls ``retrieve_future`` immediately and re-polls a ``try_again`` with no
sleep, so a poll must be HELD until the result is ready (or a deadline passes) rather than
answered at once. Results stay available after they were fetched, because the client
polls the same id again after a lost answer; the store is bounded, and the oldest
finished results are forgotten first.
"""

from __future__ import annotations

import itertools
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio

ErrorCategory = Literal["user", "server", "unknown"]


# Why a future fails once the server closes: its result will never come, and a try_again
# would have the client re-poll at once, in a loop, until the port closes.
_STOPPED = "the local server stopped before this request finished"


class TooManyPending(Exception):
    """The server holds as many unfinished futures as it allows; the client should retry
    later (answered as 429)."""


@dataclass
class FutureEntry:
    request_id: str
    endpoint: str
    """The endpoint that created it (fault rules for futures filter on this)."""
    model_id: str | None = None
    payload: dict[str, Any] | None = None
    """The JSON answer once finished: a result, or {"error", "category"}."""
    done: anyio.Event = field(default_factory=anyio.Event)
    expires: bool = False
    """An injected "410" fault chose this future: it answers 410 once finished."""

    @property
    def finished(self) -> bool:
        return self.payload is not None


class FutureStore:
    """Pending and finished futures, by request_id. Event-loop only (no locking)."""

    def __init__(self, *, max_pending: int, max_retained: int) -> None:
        self._max_pending = max_pending
        self._max_retained = max_retained
        self._entries: dict[str, FutureEntry] = {}
        self._finished: OrderedDict[str, None] = OrderedDict()
        self._closing = False
        self.held = 0
        """retrieve_future polls currently held open."""
        self._hold_started = anyio.Event()
        # Request ids: this store's random prefix, then a count. One uuid4 per request
        # read os.urandom, a system call that gives the GIL away on the event loop.
        self._ids = (f"req-{uuid.uuid4().hex[:16]}-{n}" for n in itertools.count(1))

    @property
    def pending(self) -> int:
        return len(self._entries) - len(self._finished)

    @property
    def retained(self) -> int:
        return len(self._finished)

    def create(self, endpoint: str, model_id: str | None = None) -> FutureEntry:
        if self.pending >= self._max_pending:
            raise TooManyPending(
                f"the local server already holds {self.pending} unfinished requests "
                f"(limit {self._max_pending}); retry after some of them complete"
            )
        entry = FutureEntry(next(self._ids), endpoint, model_id)
        self._entries[entry.request_id] = entry
        return entry

    def discard(self, entry: FutureEntry) -> None:
        """Forget a future that was never handed to the client (its submit was refused)."""
        if not entry.finished:
            self._entries.pop(entry.request_id, None)

    def get(self, request_id: str) -> FutureEntry | None:
        return self._entries.get(request_id)

    def resolve(self, entry: FutureEntry, payload: dict[str, Any]) -> None:
        """Finish a future with a successful result payload (never with an "error" key)."""
        if entry.finished:
            return
        if "error" in payload:
            raise ValueError("a successful future payload must not carry an 'error' key")
        self._finish(entry, payload)

    def fail(self, entry: FutureEntry, message: str, category: ErrorCategory = "user") -> None:
        """Finish a future with a failure: the client raises RequestFailedError(message)."""
        if entry.finished:
            return
        self._finish(entry, {"error": message, "category": category})

    def _finish(self, entry: FutureEntry, payload: dict[str, Any]) -> None:
        entry.payload = payload
        entry.done.set()
        if entry.request_id in self._entries:
            self._finished[entry.request_id] = None
        while len(self._finished) > self._max_retained:
            old, _ = self._finished.popitem(last=False)
            self._entries.pop(old, None)

    async def wait(self, entry: FutureEntry, hold_s: float) -> dict[str, Any] | None:
        """The payload once finished, or None when ``hold_s`` passes first: the caller
        answers try_again. Once the server is closing, an unfinished future fails."""
        if self._closing:
            self.fail(entry, _STOPPED, "server")
        elif not entry.finished:
            self.held += 1
            started, self._hold_started = self._hold_started, anyio.Event()
            started.set()
            try:
                with anyio.move_on_after(hold_s):
                    await entry.done.wait()
            finally:
                self.held -= 1
        return entry.payload

    async def next_hold(self) -> None:
        """Return once a poll starts being held (after this call)."""
        await self._hold_started.wait()

    def close(self) -> None:
        """Fail every unfinished future, releasing the polls held on it (shutdown never
        waits on a long-poll), and each one polled from now on."""
        self._closing = True
        for entry in list(self._entries.values()):
            self.fail(entry, _STOPPED, "server")
