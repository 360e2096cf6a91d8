"""HTTP routes of the REST management API (thin: they map paths, query parameters and
bodies onto ``LocalService.management`` / ``.checkpoints``).

A checkpoint is addressed as ``/training_runs/<run_id>/checkpoints/<kind>/<name>``
(``checkpoint_id`` is ``weights/<name>`` or ``sampler_weights/<name>``). The archive
URL is a redirect to ``/archives/<token>``: an unguessable, expiring link outside
``/api/v1`` that needs no API key, like the hosted service's signed URLs.
"""

from __future__ import annotations

import errno
import functools
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response

from engine.local.http.bodies import receive_body
from engine.local.operations import HttpError, LocalService
from engine.local.operations.checkpoints import file_part, http_date

BodyReader = Callable[[Request], Awaitable[tuple[Any, str]]]
_MULTIPART_SLACK = 64 * 1024


def add_management_routes(app: FastAPI, service: LocalService, body_of: BodyReader) -> None:
    api = service.management
    store = service.checkpoints
    checkpoint = "/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}"

    def query(request: Request, name: str, default: str | None = None) -> str | None:
        return request.query_params.get(name, default)

    def access_scope(request: Request) -> str:
        return query(request, "access_scope", "owned") or "owned"

    @app.get("/api/v1/training_runs")
    async def training_runs(request: Request) -> dict[str, Any]:
        return api.training_runs(
            query(request, "limit"),
            query(request, "offset"),
            access_scope(request),
        )

    @app.get("/api/v1/training_runs/{run_id}")
    async def training_run(run_id: str, request: Request) -> dict[str, Any]:
        return api.training_run(run_id, access_scope(request))

    @app.get("/api/v1/training_runs/{run_id}/checkpoints")
    async def run_checkpoints(run_id: str) -> dict[str, Any]:
        return api.run_checkpoints(run_id)

    @app.get("/api/v1/checkpoints")
    async def user_checkpoints(request: Request) -> dict[str, Any]:
        return api.user_checkpoints(query(request, "limit"), query(request, "offset"))

    @app.delete(checkpoint)
    async def delete_checkpoint(run_id: str, kind: str, name: str) -> Response:
        store.delete(api.path_of(run_id, kind, name))
        return Response(status_code=204)

    @app.post(checkpoint + "/publish")
    async def publish(run_id: str, kind: str, name: str) -> Response:
        store.set_public(api.path_of(run_id, kind, name), True)
        return Response(status_code=204)

    @app.delete(checkpoint + "/publish")
    async def unpublish(run_id: str, kind: str, name: str) -> Response:
        store.set_public(api.path_of(run_id, kind, name), False)
        return Response(status_code=204)

    @app.put(checkpoint + "/ttl")
    async def set_ttl(run_id: str, kind: str, name: str, request: Request) -> Response:
        body, _ = await body_of(request)
        if not isinstance(body, dict) or "ttl_seconds" not in body:
            raise HttpError(400, 'set_checkpoint_ttl needs a JSON body {"ttl_seconds": N|null}')
        store.set_ttl(api.path_of(run_id, kind, name), body["ttl_seconds"])
        return Response(status_code=204)

    @app.get(checkpoint + "/archive")
    async def archive(run_id: str, kind: str, name: str, request: Request) -> Response:
        token, expires = await store.archive(api.path_of(run_id, kind, name))
        location = str(request.base_url).rstrip("/") + f"/archives/{token}"
        return Response(
            status_code=302, headers={"Location": location, "Expires": http_date(expires)}
        )

    @app.get("/archives/{token}")
    async def download(token: str) -> FileResponse:
        return FileResponse(
            store.archive_file(token), media_type="application/gzip", filename="checkpoint.tar.gz"
        )

    @app.post("/api/v1/checkpoints/upload")
    async def upload(request: Request) -> JSONResponse:
        limit = service.config.limits.max_upload_bytes
        try:
            with store.upload_dir() as work:
                body = work / "body"
                async with await anyio.open_file(body, "wb") as out:
                    size = await receive_body(
                        request,
                        out.write,
                        limit=limit + _MULTIPART_SLACK,
                        timeout_s=service.config.body_timeout_s,
                        too_large=functools.partial(_upload_too_large, limit=limit),
                    )
                if size == 0:
                    raise HttpError(400, "the upload is empty: send a .tar.gz checkpoint archive")
                archive = work / "archive"
                content_type = request.headers.get("content-type", "")
                filename = await anyio.to_thread.run_sync(file_part, body, content_type, archive)
                body.unlink()
                path = await store.upload(archive, filename, work)
        except OSError as exc:
            if exc.errno not in (errno.EMFILE, errno.ENFILE):
                raise
            raise HttpError(
                503,
                "the local server is out of file descriptors; retry shortly",
                category="server",
                headers={"Retry-After": "5"},
            ) from None
        return JSONResponse(
            {
                "checkpoint_id": f"{path.kind}/{path.name}",
                "training_run_id": path.model_id,
                "path": str(path),
                "tinker_path": str(path),
            }
        )

    @app.get("/api/v1/sessions")
    async def sessions(request: Request) -> dict[str, Any]:
        return api.sessions(
            query(request, "limit"),
            query(request, "offset"),
            access_scope(request),
        )

    @app.get("/api/v1/sessions/{session_id}")
    async def session(session_id: str, request: Request) -> dict[str, Any]:
        return api.session(session_id, access_scope(request))


def _upload_too_large(size: int, limit: int) -> str:
    return (
        f"the upload of {size} bytes exceeds the local server's limit of {limit} bytes "
        "(--max-upload-bytes)"
    )
