"""The engine's exceptions, and what an SDK/httpx failure means for the run.

Why here: every layer (retry, exactly-once steps, breaker, CLI) must agree on ONE answer
to "is this failure worth retrying?" and on ONE sentence to show the user, otherwise a
401 gets retried for five minutes or a dropped connection ends a run. :func:`classify`
is that answer; :func:`format_error` is the one line the CLI prints (``Error: ...``),
always redacted and never a traceback.

Transient (retrying may help): connection errors and timeouts, HTTP 408/409/429/5xx but
501 (:func:`transient_status`), an expired/broken future (tinker's
``RetryableException``, from HTTP 410), a ``RequestFailedError`` of category ``server``
or ``unknown``, and the engine's own :class:`OpTimeout`. Permanent (fail fast):
400/401/403/404/422 and other 4xx, 501 Not Implemented (a server that does not have this
API: retrying cannot add it), a ``RequestFailedError`` of category ``user``, a bad API
key, an unexpected response schema, and anything the engine does not recognise (a bug is
not cured by retrying).

Both SDK generations (tinker 0.22 under ``mint``, tinker >= 0.38) raise the same public
exception types, so one table serves both; they are looked up lazily and optionally (a
core install without an SDK imports this module, and then no SDK error can occur). An
``httpx.HTTPStatusError`` (the engine's own plain requests) is judged like the SDK's
``APIStatusError``. A body that is not JSON (an HTML error page) is shown as a short excerpt
(:func:`body_excerpt`), never in full.
"""

from __future__ import annotations

import email.utils
import functools
import html
import os
import re
import time
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, cast

import httpx

from engine.redact import redact_text

__all__ = [
    "CircuitOpen",
    "Classified",
    "ConfigError",
    "EngineError",
    "Interrupted",
    "NoCheckpointYet",
    "OpTimeout",
    "PermanentServiceError",
    "ResumeError",
    "RetriesExhausted",
    "RunFileError",
    "RunStopped",
    "ServerUnreachable",
    "ServiceError",
    "Stalled",
    "StepOutcomeUnknown",
    "StopReason",
    "StopRequested",
    "body_excerpt",
    "classify",
    "exit_code",
    "find_error",
    "format_error",
    "os_reason",
    "primary_error",
    "retry_after",
    "transient_status",
]

E = TypeVar("E", bound=BaseException)

StopReason = Literal["interrupt", "stop", "breaker", "watchdog"]
"""Why a run stopped, as its stop checkpoint is named (``<reason>-step-N``): ``interrupt``
a signal or a cancelled host task, ``stop`` the embedding code's own request."""


class EngineError(Exception):
    """Base of every error the engine raises on purpose; ``str()`` is one user sentence."""

    exit_code: int = 1


class ConfigError(EngineError):
    """Bad input from the user (flags, config file, run dir): one line, exit code 2."""

    exit_code = 2


class ResumeError(ConfigError):
    """The run dir cannot be resumed (not a run dir, no checkpoint, config mismatch)."""


class NoCheckpointYet(ResumeError):
    """The run dir holds only an unfinished start-up: nothing to resume, nothing lost."""


class RunFileError(EngineError):
    """A file of the run dir could not be written (full disk, permissions); names it."""

    def __init__(self, path: object, error: OSError) -> None:
        reason = (error.strerror or str(error) or type(error).__name__).lower()
        super().__init__(f"cannot write {path}: {reason}")
        self.path = path


class OpTimeout(EngineError, TimeoutError):
    """An await on the service took longer than its deadline. Transient."""

    def __init__(self, op: str, seconds: float) -> None:
        super().__init__(f"timed out after {seconds:g}s waiting for {op}")
        self.op = op
        self.seconds = seconds


class ServiceError(EngineError):
    """An SDK call failed and the engine will not retry it any more.

    ``kind`` is the operation kind (``sample``, ``save_state``...), ``attempts`` how many
    attempts the engine made, ``transient`` the classification of the last error (kept
    on ``__cause__``).
    """

    def __init__(self, message: str, *, kind: str, attempts: int, transient: bool) -> None:
        super().__init__(message)
        self.kind = kind
        self.attempts = attempts
        self.transient = transient


class PermanentServiceError(ServiceError):
    """Failed fast: retrying cannot help (bad key, bad request, unknown model...)."""


class RetriesExhausted(ServiceError):
    """Transient failures outlasted the retry policy (attempts or time budget)."""


class StepOutcomeUnknown(EngineError):
    """A train step failed after submission: it may or may not have been applied.

    The engine must not guess; it restores the last checkpoint and redoes the steps
    after it (see :mod:`engine.supervision.recovery`).
    """

    def __init__(self, step: int, cause_message: str) -> None:
        super().__init__(
            f"the outcome of train step {step} is unknown ({cause_message}); "
            "restoring the last checkpoint"
        )
        self.step = step


class RunStopped(EngineError):
    """The run must stop now; ``reason`` is the checkpoint reason the engine records."""

    reason: StopReason = "breaker"


class Interrupted(RunStopped):
    """SIGINT/SIGTERM asked for a graceful stop."""

    reason: StopReason = "interrupt"
    exit_code = 130

    def __init__(self, signal_name: str = "SIGINT") -> None:
        super().__init__(f"interrupted by {signal_name}; stopping after a checkpoint")
        self.signal_name = signal_name


class StopRequested(RunStopped):
    """The embedding code asked the run to stop (``Engine.request_stop()``, or leaving
    ``steps()`` early): after the step in flight and a stop checkpoint, the run ends
    normally with a :class:`~engine.loop.results.RunResult` (``stopped`` True). Its
    checkpoint is a ``stop`` one (``stop-step-N``), not a signal's ``interrupt``."""

    reason: StopReason = "stop"

    def __init__(self, by: str) -> None:
        super().__init__(f"stop requested by {by}")
        self.by = by


class CircuitOpen(RunStopped):
    """Too many consecutive failures of one kind of operation: stop instead of hammering
    a broken server."""

    reason: StopReason = "breaker"

    def __init__(self, kind: str, failures: int, last_error: str) -> None:
        super().__init__(
            f"stopping the run: {failures} consecutive {kind} failures (last: {last_error})"
        )
        self.kind = kind
        self.failures = failures


class ServerUnreachable(RunStopped):
    """The server stopped accepting connections while the run waited on it (killed,
    crashed, network gone): stop with one line instead of waiting out every deadline."""

    reason: StopReason = "breaker"

    def __init__(self, base_url: str, seconds: float, cause: str) -> None:
        super().__init__(
            f"the MinT server at {base_url} is unreachable: no connection for {seconds:.0f}s "
            f"({cause}); check that it is running, then resume the run"
        )
        self.base_url = base_url
        self.seconds = seconds


class Stalled(RunStopped):
    """The watchdog saw no progress for too long: stop rather than hang silently."""

    reason: StopReason = "watchdog"

    def __init__(self, seconds: float, last_progress: str) -> None:
        super().__init__(
            f"stopping the run: no progress for {seconds:g}s (last progress: {last_progress})"
        )
        self.seconds = seconds
        self.last_progress = last_progress


# --------------------------------------------------------------------------- classify


@dataclass(frozen=True)
class Classified:
    """What a failure means: retry or not, one sentence for the user, server hint."""

    transient: bool
    message: str
    retry_after: float | None = None


class _NoSdk(Exception):
    """Stands in for the SDK's exception types when no SDK is installed: never raised."""


@dataclass(frozen=True)
class _SdkErrors:
    status: type[Exception] = _NoSdk
    timeout: type[Exception] = _NoSdk
    connection: type[Exception] = _NoSdk
    request_failed: type[Exception] = _NoSdk
    retryable: type[Exception] = _NoSdk
    validation: type[Exception] = _NoSdk
    base: type[Exception] = _NoSdk


@functools.cache
def _sdk_errors() -> _SdkErrors:
    """The installed SDK's exception types (tinker 0.22 and >= 0.38 share them)."""
    try:
        import tinker
        from tinker.lib.retryable_exception import RetryableException
    except ImportError:
        return _SdkErrors()
    return _SdkErrors(
        status=tinker.APIStatusError,
        timeout=tinker.APITimeoutError,
        connection=tinker.APIConnectionError,
        request_failed=tinker.RequestFailedError,
        retryable=RetryableException,
        validation=tinker.APIResponseValidationError,
        base=tinker.TinkerError,
    )


def _walk(exc: BaseException) -> list[BaseException]:
    """``exc`` then its causes/contexts (the SDK wraps HTTP errors in ValueError)."""
    seen: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and all(cur is not s for s in seen) and len(seen) < 16:
        seen.append(cur)
        cur = cur.__cause__ or (None if cur.__suppress_context__ else cur.__context__)
    return seen


def _parse_retry_after(headers: httpx.Headers) -> float | None:
    ms = headers.get("retry-after-ms")
    if ms is not None:
        try:
            return max(0.0, float(ms) / 1000.0)
        except ValueError:
            pass
    raw = headers.get("retry-after")
    if raw is None:
        return None
    try:
        return max(0.0, float(raw))
    except ValueError:
        parsed = email.utils.parsedate_tz(raw)
        if parsed is None:
            return None
        return max(0.0, float(email.utils.mktime_tz(parsed) - time.time()))


def retry_after(exc: BaseException) -> float | None:
    """Seconds the server asked us to wait (``Retry-After`` / ``Retry-After-Ms``), if any.

    Looks through the cause chain, so the ValueError the SDK raises around a failed
    future still yields the hint of the HTTP answer under it.
    """
    status = _sdk_errors().status
    for e in _walk(exc):
        if isinstance(e, status | httpx.HTTPStatusError):
            return _parse_retry_after(cast(Any, e).response.headers)
    return None


def _origin(request: httpx.Request | None) -> str:
    if request is None:
        return "the configured URL"
    url = request.url
    port = f":{url.port}" if url.port else ""
    return f"{url.scheme}://{url.host}{port}"


def _one_line(text: str, limit: int = 300) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


# A page's head (its title repeats its heading), scripts, styles and comments.
_HIDDEN_MARKUP = re.compile(
    r"<(head|script|style)\b.*?</\1\s*>|<!--.*?-->", re.DOTALL | re.IGNORECASE
)
_TAG = re.compile(r"<[^>]*>")


def body_excerpt(text: str, limit: int = 200) -> str:
    """A response body as one short line: markup stripped (an HTML error page becomes its
    text), whitespace collapsed, at most ``limit`` characters."""
    plain = html.unescape(_TAG.sub(" ", _HIDDEN_MARKUP.sub(" ", text)))
    return _one_line(plain, limit)


def transient_status(code: int) -> bool:
    """Whether an HTTP answer with status ``code`` may succeed when retried: 408, 409, 429
    and 5xx, but not 501 Not Implemented (the server lacks the method or the API)."""
    return code in (408, 409, 429) or (code >= 500 and code != 501)


def _detail(err: Any) -> str:
    """The server's explanation in an SDK ``APIStatusError`` or an httpx status error."""
    if isinstance(err, httpx.HTTPStatusError):
        try:
            body: object = err.response.json()
        except ValueError:
            body = err.response.text
    else:
        body = err.body
    if isinstance(body, dict):
        for key in ("detail", "error", "message"):
            value = body.get(key)
            if isinstance(value, str) and value:
                return _one_line(value)
            if value:
                return _one_line(str(value))
    if isinstance(body, str) and body.strip():
        return body_excerpt(body)
    return _one_line(str(getattr(err, "message", err)))


def _connection_reason(exc: BaseException) -> str:
    for e in _walk(exc)[1:]:
        if isinstance(e, OSError) and e.strerror:
            return e.strerror.lower()
        text = str(e).strip()
        if text:
            match = re.search(r"\[Errno -?\d+\] ([^\]]+)$", text)
            return (match.group(1) if match else text).strip().lower()
    message = getattr(exc, "message", "") or str(exc)
    return message.rstrip(".").lower() or "connection error"


def os_reason(exc: BaseException) -> str:
    """Why a connection failed, from the OS error under ``exc`` (``connection refused``,
    ``name or service not known``), else the error's first line."""
    cur: BaseException | None = exc
    while cur is not None:
        if isinstance(cur, OSError) and cur.errno:
            return os.strerror(cur.errno).lower()
        if isinstance(cur, OSError) and cur.strerror:
            return cur.strerror.lower()
        cur = cur.__cause__ or cur.__context__
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


_REQUEST_FAILED = re.compile(r"^Request failed: (?P<msg>.*?) for self\.request_id=", re.DOTALL)


def _request_failed_text(err: Any) -> str:
    match = _REQUEST_FAILED.match(err.message)
    return _one_line(match.group("msg") if match else err.message)


def _classify_status(err: Any) -> Classified:
    """An HTTP error answer: an SDK ``APIStatusError`` or an ``httpx.HTTPStatusError``."""
    code: int = err.response.status_code
    where = _origin(err.request)
    path = err.request.url.path
    detail = _detail(err)
    hint = _parse_retry_after(err.response.headers)
    if code == 401:
        return Classified(
            False,
            f"the MinT server at {where} rejected the API key (401 Unauthorized); "
            "check MINT_API_KEY",
        )
    if code == 402:
        return Classified(False, f"the account cannot be billed (402 Payment Required): {detail}")
    if code == 403:
        return Classified(False, f"the API key may not do this (403 Forbidden): {detail}")
    if code == 404:
        return Classified(False, f"the server answered 404 Not Found for {path}: {detail}")
    if code in (400, 422):
        return Classified(False, f"the server rejected the request to {path} ({code}): {detail}")
    if code == 429:
        return Classified(True, f"the server is rate-limiting requests (429): {detail}", hint)
    if code == 501:
        return Classified(
            False,
            f"the server at {where} does not implement {path} (501 Not Implemented): {detail}",
        )
    if transient_status(code):
        return Classified(True, f"the server answered {code} for {path}: {detail}", hint)
    return Classified(False, f"the server answered {code} for {path}: {detail}")


def classify(exc: BaseException) -> Classified:
    """Decide whether ``exc`` is transient and say in one sentence what went wrong.

    Never raises; unknown exceptions are permanent (fail fast, show the error text).
    The message is redacted.
    """
    c = _classify(exc)
    return Classified(c.transient, redact_text(c.message), c.retry_after)


def _classify(exc: BaseException) -> Classified:
    if isinstance(exc, ServiceError):
        return Classified(exc.transient, str(exc))
    if isinstance(exc, OpTimeout):
        return Classified(True, str(exc))
    if isinstance(exc, EngineError):
        return Classified(False, str(exc))
    sdk = _sdk_errors()
    for e in _walk(exc):
        if isinstance(e, sdk.status | httpx.HTTPStatusError):
            return _classify_status(e)
        if isinstance(e, sdk.timeout):
            return Classified(
                True, f"the MinT server at {_origin(cast(Any, e).request)} did not answer in time"
            )
        if isinstance(e, sdk.connection):
            if "No progress made" in str(e):
                return Classified(True, f"sampling made no progress: {_one_line(str(e))}")
            return Classified(
                True,
                f"cannot reach the MinT server at {_origin(cast(Any, e).request)}: "
                f"{_connection_reason(e)}",
            )
        if isinstance(e, sdk.request_failed):
            text = _request_failed_text(e)
            category = str(cast(Any, e).category)
            if category == "user":
                return Classified(False, f"the server refused the request: {text}")
            return Classified(True, f"the server failed the request ({category}): {text}")
        if isinstance(e, sdk.retryable):
            return Classified(True, "the server lost the result of a request (expired future)")
        if isinstance(e, sdk.validation):
            return Classified(False, f"unexpected answer from the server: {_one_line(str(e))}")
        if isinstance(e, httpx.TimeoutException):
            return Classified(True, f"an HTTP request timed out: {_one_line(str(e)) or 'timeout'}")
        if isinstance(e, httpx.TransportError | ConnectionError):
            return Classified(True, f"connection error: {_connection_reason(e)}")
        if isinstance(e, sdk.base) and "api_key" in str(e):
            return Classified(False, f"the API key is not usable: {_one_line(str(e))}")
    if isinstance(exc, TimeoutError):
        return Classified(True, f"timed out: {_one_line(str(exc)) or 'no answer in time'}")
    text = _one_line(str(exc))
    return Classified(False, f"{type(exc).__name__}: {text}" if text else type(exc).__name__)


# --------------------------------------------------------------------------- CLI helpers


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        out: list[BaseException] = []
        for sub in exc.exceptions:
            out.extend(_leaves(sub))
        return out
    return [exc]


def find_error(exc: BaseException, kind: type[E]) -> E | None:
    """The first ``kind`` exception inside ``exc`` (possibly nested in task-group
    ExceptionGroups), or None."""
    for leaf in _leaves(exc):
        if isinstance(leaf, kind):
            return leaf
    return None


def primary_error(exc: BaseException) -> BaseException:
    """The most telling exception of a (possibly grouped) failure: a RunStopped first,
    then any EngineError, then the first leaf."""
    leaves = _leaves(exc)
    for wanted in (RunStopped, EngineError):
        for leaf in leaves:
            if isinstance(leaf, wanted):
                return leaf
    return leaves[0] if leaves else exc


def format_error(exc: BaseException) -> str:
    """The single line the CLI prints for a failed run, e.g.
    ``Error: cannot reach the MinT server at http://127.0.0.1:8000: connection refused``.
    Unwraps task-group exception groups; always redacted."""
    primary = primary_error(exc)
    if isinstance(primary, KeyboardInterrupt):
        return "Error: interrupted"
    message = classify(primary).message if isinstance(primary, Exception) else str(primary)
    return "Error: " + redact_text(_one_line(message, limit=500))


def exit_code(exc: BaseException) -> int:
    """Process exit status for a failed run: 2 for bad input, 130 for an interrupt,
    1 otherwise."""
    primary = primary_error(exc)
    if isinstance(primary, EngineError):
        return primary.exit_code
    if isinstance(primary, KeyboardInterrupt):
        return 130
    return 1
