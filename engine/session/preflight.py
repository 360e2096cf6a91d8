"""What the engine asks of a server before any SDK is involved, over plain HTTP (httpx).

Why not through the SDK: an SDK retries a dead endpoint for minutes before saying
anything and hides a rejected key behind a generic error, and it drops the settings a
MinT server recommends. These requests are the same for every SDK generation
(tinker 0.22 under ``mint``, tinker >= 0.38): a reachability check
(:func:`check_reachable`), the server's recommended profile (:func:`read_server_profile`),
and the one sentence a failed setup call becomes (:func:`setup_call`,
:class:`PreflightError`, exit code 1).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

import httpx

from engine.basemodels.recommended import model_entry
from engine.common.protocol import RECOMMENDED_FIELD
from engine.config import HOSTED_PROFILE, EngineConfig, Profile, server_profile
from engine.errors import (
    ConfigError,
    EngineError,
    ServiceError,
    body_excerpt,
    classify,
    os_reason,
    transient_status,
)
from engine.session.retry import OpKind, ServiceGuard, service_guard

__all__ = [
    "PreflightError",
    "check_local_loss_options",
    "check_reachable",
    "local_server_profile",
    "local_service",
    "read_server_profile",
    "recommended_profile",
    "setup_call",
]

T = TypeVar("T")

_PREFLIGHT_TIMEOUT = httpx.Timeout(30.0, connect=10.0)


class PreflightError(EngineError):
    """The server cannot be used for this run (unreachable, key rejected, no such model)."""


async def setup_call(
    guard: ServiceGuard, base_url: str, what: str, fn: Callable[[], Awaitable[T]]
) -> T:
    """Await a setup call under the SESSION retry policy; a failure that outlasts it
    becomes one PreflightError sentence."""
    try:
        return await guard.call(OpKind.SESSION, what, fn)
    except ServiceError as exc:
        cause = exc.__cause__ if exc.__cause__ is not None else exc
        text = str(cause)
        if "api_key" in text:
            message = f"the API key is not usable with {base_url}: {text.splitlines()[0]}"
        else:
            message = f"could not {what} at {base_url}: {classify(cause).message}"
        raise PreflightError(message) from exc


async def check_reachable(
    base_url: str, api_key: str | None, guard: ServiceGuard, sdk_version: str
) -> None:
    """One plain HTTP request before the SDK takes over (the SDK's own first request,
    ``client/config``, as SDK ``sdk_version`` sends it)."""
    response = await _preflight_request(
        base_url, api_key, guard, "POST", "client/config", {"sdk_version": sdk_version}
    )
    if response.status_code in (401, 403):
        raise PreflightError(
            f"the MinT server at {base_url} rejected the API key (HTTP "
            f"{response.status_code}); check MINT_API_KEY"
        )
    if response.status_code >= 400 or _json(response) is None:
        raise _not_mint(base_url, response)


async def read_server_profile(
    base_url: str, api_key: str | None, guard: ServiceGuard | None = None
) -> Profile:
    """The defaults the server at ``base_url`` implies (:func:`engine.config.server_profile`
    of its ``get_server_capabilities`` answer, read as plain JSON: the SDK drops the
    recommended settings). Fails like the preflight (:class:`PreflightError`); calls
    are guarded as in a run with the default settings unless ``guard`` is given."""
    from engine.common.sdks import installed_tinker_version

    guard = guard or service_guard(EngineConfig())
    await check_reachable(base_url, api_key, guard, installed_tinker_version() or "0.22.0")
    return await recommended_profile(base_url, api_key, guard)


async def recommended_profile(base_url: str, api_key: str | None, guard: ServiceGuard) -> Profile:
    """The server's recommended settings (its ``get_server_capabilities`` as JSON)."""
    capabilities = await _capabilities(base_url, api_key, guard)
    if capabilities is None:
        return HOSTED_PROFILE
    try:
        return server_profile(capabilities, f"the MinT server at {base_url}")
    except ValueError as exc:
        raise PreflightError(str(exc)) from exc


async def check_local_loss_options(
    base_url: str, api_key: str | None, guard: ServiceGuard, options: Sequence[str]
) -> None:
    """ConfigError unless the server at ``base_url`` is the engine's local server (its
    capabilities carry :data:`RECOMMENDED_FIELD`), whose losses take ``options`` (the
    flags of :meth:`~engine.config.groups.TrainingSettings.local_loss_options`): a hosted
    server refuses loss_fn_config keys it does not know, which would fail the first step."""
    if await local_service(base_url, api_key, guard) is not None:
        return
    raise ConfigError(
        f"{', '.join(options)}: loss options of the engine's local server, and {base_url} is "
        "not one (a hosted server refuses loss_fn_config keys it does not know; docs/losses.md)"
    )


async def local_service(base_url: str, api_key: str | None, guard: ServiceGuard) -> str | None:
    """The service profile of the engine's local server at ``base_url`` (``local``,
    ``mint``, ``tinker``: its capabilities carry :data:`RECOMMENDED_FIELD`; a server from
    before the profiles is ``local``); None for any other server."""
    capabilities = await _capabilities(base_url, api_key, guard)
    models = capabilities.get("supported_models") if isinstance(capabilities, Mapping) else None
    for model in models if isinstance(models, list) else ():
        recommended = model.get(RECOMMENDED_FIELD) if isinstance(model, Mapping) else None
        if isinstance(recommended, Mapping):
            service = recommended.get("service", "local")
            return service if isinstance(service, str) else "local"
    return None


async def _capabilities(base_url: str, api_key: str | None, guard: ServiceGuard) -> object:
    """The server's ``get_server_capabilities`` answer as plain JSON; None when the
    request needs the SDK's session token (hosted MinT in JWT mode)."""
    response = await _preflight_request(
        base_url, api_key, guard, "GET", "get_server_capabilities", None
    )
    if response.status_code in (401, 403):
        # The key passed client/config: this server wants the SDK's session token here
        # (hosted MinT in JWT mode). The local server takes the plain key everywhere,
        # so this is not one that recommends settings.
        return None
    answer = _json(response) if response.status_code < 400 else None
    if answer is None:
        raise _not_mint(base_url, response)
    return answer


def _json(response: httpx.Response) -> object:
    """The answer's JSON body; None when it has none (an HTML page, plain text)."""
    try:
        return response.json()
    except ValueError:
        return None


def _not_mint(base_url: str, response: httpx.Response) -> PreflightError:
    """A server that answers, but not as a MinT server would: a plain web server (501 to
    a POST, 404/405, an HTML page) or another service's API. One line with a short
    excerpt of the body, never the page."""
    request = response.request
    excerpt = body_excerpt(response.text) or "an empty body"
    kind = "" if _json(response) is not None else " (not JSON)"
    return PreflightError(
        f"{base_url} does not speak the MinT/Tinker API (check MINT_BASE_URL): {request.method} "
        f"{request.url.path} answered HTTP {response.status_code}{kind}: {excerpt}"
    )


def local_server_profile(model_dir: Path | None) -> Profile:
    """The defaults the local server would report for ``model_dir`` (a directory, a
    packaged or pretrained model's name; None: the packaged model), read before the engine
    starts it, from the model's metadata (a pretrained model is not converted for it): the
    same entry its ``get_server_capabilities`` answer carries."""
    try:
        entry = model_entry(model_dir)
        return server_profile({"supported_models": [entry]}, "the local server")
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


async def _preflight_request(
    base_url: str,
    api_key: str | None,
    guard: ServiceGuard,
    method: str,
    endpoint: str,
    body: object,
) -> httpx.Response:
    """One plain request to ``/api/v1/<endpoint>``. A busy server
    (:func:`~engine.errors.transient_status`) or a connection dropped mid-answer is retried
    under the SESSION policy, honouring Retry-After; no server to connect to or no answer in
    time fails at once with one sentence; other answers (501 Not Implemented included) are
    the caller's to judge."""
    url = base_url.rstrip("/") + "/api/v1/" + endpoint
    headers = {"X-API-Key": api_key} if api_key else {}

    async def once() -> httpx.Response:
        try:
            async with httpx.AsyncClient(timeout=_PREFLIGHT_TIMEOUT) as client:
                response = await client.request(method, url, json=body, headers=headers)
        except httpx.TimeoutException as exc:
            raise PreflightError(
                f"the MinT server at {base_url} did not answer in time; check MINT_BASE_URL "
                "and the server's status"
            ) from exc
        except (httpx.ConnectError, httpx.UnsupportedProtocol, ValueError) as exc:
            raise PreflightError(
                f"cannot reach the MinT server at {base_url} ({os_reason(exc)}); check "
                "MINT_BASE_URL, the network and the server's status"
            ) from exc
        # Other transport errors (a connection dropped mid-answer) are transient.
        if transient_status(response.status_code):
            # Transient for the retry layer, which reads the status and Retry-After.
            raise httpx.HTTPStatusError(
                f"HTTP {response.status_code}", request=response.request, response=response
            )
        return response

    try:
        return await guard.call(OpKind.SESSION, "reach the server", once)
    except ServiceError as exc:
        cause = exc.__cause__ if exc.__cause__ is not None else exc
        raise PreflightError(
            f"the MinT server at {base_url} is not ready: {classify(cause).message}"
        ) from exc
