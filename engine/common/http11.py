"""uvicorn's h11 protocol with a deadline for request headers, writing each response in
one piece.

uvicorn closes a kept-alive connection that stays idle after a response, but it has no
limit on how long a client may take to send a request's headers: a fresh connection
that sends nothing, or headers trickled a byte at a time (slowloris), holds a socket
forever. This protocol closes such a connection ``header_timeout`` seconds after it
opened or after the first byte of the next request, whichever applies. The body has its
own deadline in the app (``--body-timeout``), where a 408 can still be answered.

uvicorn writes a response's head and its body separately, and each write is a send
system call (Nagle's algorithm is off on these connections); every send releases the
GIL, which the event loop then waits to take back from the compute threads. The
protocol's transport gathers the writes made in one turn of the event loop into one.
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.config import Config
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState


class HeaderDeadlineH11(H11Protocol):
    """H11Protocol that closes connections whose request headers are late."""

    header_timeout: float = 10.0

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, object],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(GatheredWrites(transport, self.loop))  # type: ignore[arg-type]
        self._arm_header_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._arm_header_deadline()  # part of a request's headers is still missing
        else:
            self._disarm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)

    def _arm_header_deadline(self) -> None:
        if self._header_deadline is None:
            self._header_deadline = self.loop.call_later(self.header_timeout, self._headers_late)

    def _disarm_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _headers_late(self) -> None:
        self._header_deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


class GatheredWrites:
    """A transport that passes on, in one write at the end of the event loop's turn,
    everything written during it; every other call goes to the real transport (those
    that end or measure the stream after the gathered bytes are passed on)."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not data:
            return
        if not self._pending:
            self._loop.call_soon(self.flush)
        self._pending.append(data)

    def flush(self) -> None:
        if self._pending:
            data = b"".join(self._pending)
            self._pending.clear()
            if not self._transport.is_closing():
                self._transport.write(data)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(map(len, self._pending))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def with_header_timeout(seconds: float) -> type[HeaderDeadlineH11]:
    """The protocol class to pass as uvicorn's ``http`` setting."""
    return type("HeaderDeadlineH11", (HeaderDeadlineH11,), {"header_timeout": seconds})
