"""Real tinker exceptions, built the way the pinned SDK builds them (for unit tests).

HTTP status errors come from the SDK client's own ``_make_status_error_from_response``
applied to a real ``httpx.Response``; connection errors carry the httpx error as their
cause, as ``_base_client`` raises them; future failures use the SDK's own message shape.
"""

from __future__ import annotations

from typing import Any

import httpx
import tinker
from tinker._client import AsyncTinker
from tinker.lib.retryable_exception import RetryableException
from tinker.types import RequestErrorCategory

BASE = "http://127.0.0.1:8765"
_client = AsyncTinker(api_key="tml-unit-test-key-000000", base_url=BASE)


def request(path: str = "create_model", method: str = "POST") -> httpx.Request:
    return httpx.Request(method, f"{BASE}/api/v1/{path}")


def status_error(
    code: int,
    body: Any = None,
    *,
    path: str = "create_model",
    headers: dict[str, str] | None = None,
) -> tinker.APIStatusError:
    """The exception the SDK raises for an HTTP ``code`` answer."""
    req = request(path)
    payload = {"detail": f"detail for {code}"} if body is None else body
    response = (
        httpx.Response(code, json=payload, headers=headers, request=req)
        if not isinstance(payload, str)
        else httpx.Response(code, text=payload, headers=headers, request=req)
    )
    return _client._make_status_error_from_response(response)


def connection_refused(path: str = "create_session") -> tinker.APIConnectionError:
    req = request(path)
    try:
        try:
            raise httpx.ConnectError("[Errno 111] Connection refused", request=req)
        except httpx.ConnectError as cause:
            raise tinker.APIConnectionError(request=req) from cause
    except tinker.APIConnectionError as exc:
        return exc


def timeout_error(path: str = "asample") -> tinker.APITimeoutError:
    req = request(path)
    try:
        try:
            raise httpx.ReadTimeout("timed out", request=req)
        except httpx.ReadTimeout as cause:
            raise tinker.APITimeoutError(request=req) from cause
    except tinker.APITimeoutError as exc:
        return exc


def request_failed(message: str, category: str) -> tinker.RequestFailedError:
    """A future that completed in a failed state (``{"error", "category"}`` answer)."""
    return tinker.RequestFailedError(
        f"Request failed: {message} for self.request_id='req-1' and expected type "
        "self.model_cls=<class 'tinker.types.SampleResponse'>",
        request_id="req-1",
        category=RequestErrorCategory(category),
    )


def future_fatal(code: int) -> ValueError:
    """The ValueError a future raises for a fatal HTTP answer on retrieve_future."""
    cause = status_error(code, path="retrieve_future")
    try:
        try:
            raise cause
        except tinker.APIStatusError as err:
            raise ValueError(
                f"Error retrieving result: {err} with status {code} for "
                "self.request_id='req-1' and expected type x"
            ) from err
    except ValueError as exc:
        return exc


def expired_future() -> RetryableException:
    """What a future raises on HTTP 410 (promise expired)."""
    cause = status_error(410, path="retrieve_future")
    try:
        try:
            raise cause
        except tinker.APIStatusError as err:
            raise RetryableException("Promise expired/broken for request req-1") from err
    except RetryableException as exc:
        return exc
