"""FastAPI routes of the local MinT-compatible server (thin: JSON in, JSON out).

Every route reads a size-bounded JSON body, calls ``LocalService`` and maps its
``HttpError`` to a status with a JSON body; errors always carry a body, because the
client treats a bodiless 400 as a proxy glitch and retries it.

tinker 0.38 clients are served by the same routes: their protobuf ``forward_backward``
bodies (zstd where the client config asks) are decoded into the JSON shape, and their
polls that accept protobuf get protobuf results (``tinker_proto``), decided per request.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp

from engine.local.http.auth import Authenticator
from engine.local.http.bodies import receive_body
from engine.local.http.management_routes import add_management_routes
from engine.local.http.middleware import (
    AuthMiddleware,
    FaultMiddleware,
    hide_injected_drop_tracebacks,
)
from engine.local.http.rate_limit import RateLimitMiddleware, TokenBuckets
from engine.local.http.tinker_proto import (
    PROTO_CONTENT_TYPE,
    PROTO_RESULT_ENDPOINTS,
    ProtoError,
    decompress,
    encode_result,
    forward_backward_body,
    is_proto,
    training_endpoint,
    wants_proto,
)
from engine.local.models.storage import hide_data_dir
from engine.local.operations import HttpError, LocalService
from engine.local.operations.resume import is_resume
from engine.local.operations.sampling_gate import BACKPRESSURE_HEADER

log = logging.getLogger("engine.local")

TRAINING_ENDPOINTS = (
    "forward_backward",
    "forward",
    "optim_step",
    "save_weights",
    "save_weights_for_sampler",
    "load_weights",
)
UNSUPPORTED_FUTURES = {
    "unload_model": "unload_model is not supported by the local server (models live until "
    "the server stops)",
    "mint/forward_backward_reverse_kl": "forward_backward_reverse_kl (a MinT-only endpoint) is "
    "not supported by the local server",
    "mint/checkpoints/interpolate": "interpolate_checkpoints (a MinT-only endpoint) is not "
    "supported by the local server",
}
_PARSE_IN_THREAD_BYTES = 256 * 1024
ProtoDecoder = Callable[[bytes], tuple[Any, str]]
Responder = Callable[[Request, Any, Any], Response | None]


def build_app(service: LocalService, auth: Authenticator) -> ASGIApp:
    """The complete ASGI app: routes wrapped in auth, then fault injection (outermost,
    so faults hit before anything else, as a flaky network or proxy would)."""
    app = FastAPI(title="engine.local", docs_url=None, redoc_url=None, openapi_url=None)
    limit = service.config.limits.max_body_bytes

    def public(message: str) -> str:
        return hide_data_dir(message, service.data_dir)

    async def body_of(request: Request, proto: ProtoDecoder | None = None) -> tuple[Any, str]:
        """The parsed JSON body and a digest of its bytes (equal for resubmissions).
        Routes given a ``proto`` decoder also take ``application/x-protobuf`` bodies;
        a ``Content-Encoding: zstd`` body is inflated first (bounded by the limit)."""
        chunks: list[bytes] = []

        async def keep(chunk: bytes) -> None:
            chunks.append(chunk)

        size = await receive_body(
            request,
            keep,
            limit=limit,
            timeout_s=service.config.body_timeout_s,
            too_large=functools.partial(_too_large, limit=limit),
        )
        raw = b"".join(chunks)
        encoding = request.headers.get("content-encoding")
        protobuf = is_proto(request.headers.get("content-type"))
        if protobuf and proto is None:
            raise HttpError(
                415,
                f"{request.url.path} takes a JSON body; the local server accepts "
                f"{PROTO_CONTENT_TYPE} bodies on forward_backward only",
            )
        if not raw:
            return {}, ""
        parse = functools.partial(_parse_body, encoding, proto if protobuf else None, limit)
        try:
            if size > _PARSE_IN_THREAD_BYTES or encoding is not None:
                return await anyio.to_thread.run_sync(parse, raw)
            return parse(raw)
        except ProtoError as exc:
            raise HttpError(400, str(exc)) from None
        except ValueError:
            raise HttpError(400, "request body is not valid JSON") from None

    def post(
        path: str,
        handler: Callable[..., Awaitable[Any] | Any],
        *,
        digest: bool = False,
        proto: ProtoDecoder | None = None,
        respond: Responder | None = None,
        header: str | None = None,
    ) -> None:
        """``header``: the handler also gets that request header's value (or None)."""

        async def route(request: Request) -> Response:
            try:
                body, body_digest = await body_of(request, proto)
                args = (body, body_digest) if digest else (body,)
                if header is not None:
                    args = (*args, request.headers.get(header))
                result = handler(*args)
                if isinstance(result, Awaitable):
                    result = await result
                custom = respond(request, body, result) if respond is not None else None
                if custom is not None:
                    return custom
            except RecursionError:
                raise HttpError(
                    400, "request body is nested too deeply (JSON objects and arrays)"
                ) from None
            except HttpError:
                raise
            except Exception as exc:
                log.exception("internal error on %s", request.url.path)
                return _internal_error(exc, public)
            if isinstance(result, dict) and isinstance(result.get("error"), str):
                result = {**result, "error": public(result["error"])}
            return JSONResponse(result)

        app.add_api_route(f"/api/v1/{path}", route, methods=["POST"], name=path)

    post("client/config", service.client_config)
    post("auth/token", lambda body: {"jwt": auth.issue()})
    post("create_session", service.create_session)
    post("session_heartbeat", service.heartbeat)
    post("telemetry", lambda body: {"status": "accepted"})
    post("create_model", service.training.create_model)
    post("get_info", service.training.get_info)
    for endpoint in TRAINING_ENDPOINTS:
        if endpoint in ("forward_backward", "load_weights"):
            continue
        post(endpoint, functools.partial(service.training.submit, endpoint), digest=True)
    post(
        "forward_backward",
        lambda body, digest: service.training.submit(training_endpoint(body), body, digest),
        digest=True,
        proto=forward_backward_body,
    )
    post(
        "load_weights",
        lambda body, digest: (
            service.resume.load(body)
            if is_resume(body)
            else service.training.submit("load_weights", body, digest)
        ),
        digest=True,
    )
    post("weights_info", service.weights_info)
    post("create_sampling_session", service.sampling.create_session)
    post("asample", service.sampling.asample, digest=True, header=BACKPRESSURE_HEADER)

    def proto_result(request: Request, body: Any, result: Any) -> Response | None:
        """A finished forward/sample result as protobuf for a poll that accepts it."""
        if not (wants_proto(request.headers.get("accept")) and isinstance(result, dict)):
            return None
        entry = service.futures.get(str(body.get("request_id")))
        if entry is None or entry.endpoint not in PROTO_RESULT_ENDPOINTS:
            return None
        encoded = encode_result(entry.endpoint, result)
        if encoded is None:
            return None
        return Response(encoded, media_type=PROTO_CONTENT_TYPE)

    post("retrieve_future", service.retrieve_future, respond=proto_result)
    post("client/dynamic_config", service.session_ops.dynamic_config)
    post("join_sampling_session", service.session_ops.join_sampling_session)
    post("cancel_future", service.session_ops.cancel_future)

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish_session(session_id: str, request: Request) -> dict[str, Any]:
        body, _ = await body_of(request)
        return service.session_ops.finish(session_id, body)

    for endpoint, message in UNSUPPORTED_FUTURES.items():
        post(endpoint, functools.partial(_unsupported_future, service, endpoint, message))

    @app.get("/api/v1/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities() -> dict[str, Any]:
        return service.capabilities()

    @app.get("/api/v1/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str) -> dict[str, Any]:
        return service.sampling.get_sampler(sampler_id)

    @app.get("/api/v1/local/stats")
    async def stats() -> dict[str, Any]:
        return service.snapshot().to_json()

    add_management_routes(app, service, body_of)

    @app.api_route("/api/v1/{rest:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def unsupported(rest: str) -> JSONResponse:
        return JSONResponse(
            {
                "error": f"/api/v1/{rest} is not supported by the local server",
                "category": "user",
            },
            status_code=400,
        )

    @app.exception_handler(HttpError)
    async def http_error(request: Request, exc: HttpError) -> JSONResponse:
        return JSONResponse(
            {**exc.body, "error": public(exc.message), "category": exc.category},
            status_code=exc.status,
            headers=exc.headers,
        )

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        # Starlette re-raises the exception after this answer, and uvicorn logs it.
        return _internal_error(exc, public)

    hide_injected_drop_tracebacks()
    rate = service.config.rate_limit
    limited: ASGIApp = app if rate is None else RateLimitMiddleware(app, TokenBuckets(rate))
    return FaultMiddleware(AuthMiddleware(limited, auth), service.faults, service.stats)


def _internal_error(exc: Exception, public: Callable[[str], str]) -> JSONResponse:
    return JSONResponse(
        {
            "error": public(f"internal error in the local server: {type(exc).__name__}: {exc}"),
            "category": "server",
        },
        status_code=500,
    )


def _decode(raw: bytes) -> tuple[Any, str]:
    return json.loads(raw), hashlib.blake2b(raw, digest_size=16).hexdigest()


def _parse_body(
    encoding: str | None, proto: ProtoDecoder | None, limit: int, raw: bytes
) -> tuple[Any, str]:
    raw = decompress(raw, encoding, limit)
    return proto(raw) if proto is not None else _decode(raw)


def _unsupported_future(
    service: LocalService, endpoint: str, message: str, body: Any
) -> dict[str, Any]:
    return service.failed_future(endpoint, message)


def _too_large(size: int, limit: int) -> str:
    return (
        f"request body of {size} bytes exceeds the local server's limit of {limit} bytes; "
        "send fewer datums per request"
    )
