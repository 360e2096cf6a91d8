"""Reading request bodies within the server's bounds: a byte limit (checked against
Content-Length before anything is read, and while streaming) and ``--body-timeout``
for the whole body. Both JSON bodies and checkpoint uploads are read here."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio
from starlette.requests import ClientDisconnect, Request

from engine.local.operations import HttpError

CLOSE = {"Connection": "close"}
"""Ends the connection after an answer sent before the whole body was read."""


async def receive_body(
    request: Request,
    sink: Callable[[bytes], Awaitable[object]],
    *,
    limit: int,
    timeout_s: float,
    too_large: Callable[[int], str],
) -> int:
    """Pass the body's chunks to ``sink``; return its size. HTTP 413 beyond ``limit``
    bytes (``too_large(size)`` says why), 408 after ``timeout_s``."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise HttpError(413, too_large(int(declared)), headers=CLOSE)
    size = 0
    try:
        with anyio.fail_after(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise HttpError(413, too_large(size), headers=CLOSE)
                await sink(chunk)
    except ClientDisconnect:
        # Nobody will read the answer; a plain error keeps it out of the error log.
        raise HttpError(400, "the client disconnected before sending the whole body") from None
    except TimeoutError:
        raise HttpError(
            408,
            f"the request body did not arrive within {timeout_s:g} s (the local server's "
            "--body-timeout)",
            category="server",
            headers=CLOSE,
        ) from None
    return size
