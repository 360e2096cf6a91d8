"""The HTTP transport of agent functions' clients: each request answered by an
endpoint's :attr:`~engine.agents.endpoint.Endpoint.dispatch` -- the same routes, checks
and limits as over HTTP, without a socket, HTTP parsing or the ASGI stack on either
side (the SDK's documented custom transport). In process it calls the group's
endpoint directly; in an agent worker process
(:class:`~engine.agents.workers.AgentWorkers`) it sends the request to the engine over
the worker's pipe."""

from __future__ import annotations

import httpx2

from engine.agents.endpoint import Dispatch, bearer_key

__all__ = ["DispatchTransport"]


class DispatchTransport(httpx2.AsyncBaseTransport):
    """An ``httpx`` transport whose requests ``dispatch`` answers."""

    def __init__(self, dispatch: Dispatch) -> None:
        self._dispatch = dispatch

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        body = await request.aread()
        api_key = bearer_key(request.headers.get("authorization", ""))
        reply = await self._dispatch(request.method, request.url.path, api_key, body)
        return httpx2.Response(
            reply.status, headers={"content-type": reply.media_type}, content=reply.content
        )
