"""Keep API keys out of everything the engine writes: log lines, config.json, error text.

Why a module of its own: a key can reach output by many roads (a config dump, an SDK
exception that echoes a header, a structlog field, a stdlib log record from the SDK), so
the same scrubber has to sit on each of them. Two mechanisms, applied together:

* **Patterns** for the key formats MinT/Tinker use: ``sk-...`` (MinT keys), ``tml-...``
  (Tinker keys) and ``eyJ...`` (JWTs, which the SDK exchanges ``sk-`` keys for). The
  prefix is kept (``sk-[REDACTED]``) so a reader can still tell which kind of key it was.
* **Registered values**: any secret the engine knows about (the configured API key, a
  token from the environment) is registered once with :func:`register_secret` and then
  replaced wherever it appears, whatever its shape.

Mapping keys that name a secret (``api_key``, ``token``, ``password``, ``authorization``,
``x-api-key``...) have their whole value replaced, so a secret in an unexpected format is
still hidden in configs and structured logs.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Mapping, MutableMapping
from typing import Any

__all__ = [
    "REDACTED",
    "RedactingFilter",
    "clear_registered_secrets",
    "install_stdlib_redaction",
    "redact",
    "redact_config",
    "redact_processor",
    "redact_text",
    "register_secret",
]

REDACTED = "[REDACTED]"

# Left boundary: not preceded by a key character, so "task-sk-..." style words and the
# middle of longer tokens are not touched; the key body must be long enough to be a key
# (8+ characters) so ordinary words such as "sk-learn" stay readable.
_KEY_PATTERN = re.compile(
    r"(?<![A-Za-z0-9_\-])"
    r"(?P<prefix>sk-|tml-)"
    r"[A-Za-z0-9_\-]{8,}"
)
# A JWT: base64url header starting "eyJ" ('{"'), payload, optional signature. A bare
# "eyJ..." API key (which tinker also accepts) matches the first alternative.
_JWT_PATTERN = re.compile(
    r"(?<![A-Za-z0-9_\-])"
    r"eyJ[A-Za-z0-9_\-]{8,}(?:\.[A-Za-z0-9_\-]*){0,2}"
)

_SECRET_KEY_NAMES = re.compile(
    r"(^|[_\-.])(api[_\-]?key|token|secret|password|passwd|authorization|credential|jwt)$",
    re.IGNORECASE,
)

_lock = threading.Lock()
_registered: tuple[str, ...] = ()


def register_secret(value: str | None) -> None:
    """Register a secret value so that every later redaction replaces it.

    Empty/None values are ignored (nothing to hide). Registering the same value twice is
    harmless. Longer values are matched first so a secret that contains another one is
    replaced whole.
    """
    global _registered
    if not value:
        return
    with _lock:
        if value in _registered:
            return
        _registered = tuple(sorted((*_registered, value), key=len, reverse=True))


def clear_registered_secrets() -> None:
    """Forget every registered secret (tests; a process that switches keys)."""
    global _registered
    with _lock:
        _registered = ()


def redact_text(text: str) -> str:
    """Return ``text`` with every registered secret and every key-shaped token hidden."""
    for secret in _registered:
        if secret in text:
            text = text.replace(secret, REDACTED)
    text = _KEY_PATTERN.sub(lambda m: f"{m.group('prefix')}{REDACTED}", text)
    return _JWT_PATTERN.sub(f"eyJ{REDACTED}", text)


def _is_secret_key(key: object) -> bool:
    return isinstance(key, str) and _SECRET_KEY_NAMES.search(key) is not None


def redact(value: Any) -> Any:
    """Redact a JSON-like value recursively (str, mappings, lists/tuples/sets, scalars).

    Non-empty string values under secret-named keys are replaced whole; numbers, booleans
    and None pass through; any other object is kept as is unless its ``str()`` contains a
    secret, in which case it becomes the redacted string (so a renderer cannot leak it).
    """
    if isinstance(value, str):
        return redact_text(value)
    if value is None or isinstance(value, bool | int | float):
        return value
    if isinstance(value, Mapping):
        return {
            k: (REDACTED if _is_secret_key(k) and isinstance(v, str) and v else redact(v))
            for k, v in value.items()
        }
    if isinstance(value, list | tuple | set | frozenset):
        items = [redact(v) for v in value]
        return items if isinstance(value, list) else type(value)(items)
    text = str(value)
    cleaned = redact_text(text)
    return value if cleaned == text else cleaned


def redact_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``config`` safe to write to ``config.json``: secret-named fields and
    key-shaped strings are replaced by ``[REDACTED]``; the input is not modified."""
    result = redact(config)
    assert isinstance(result, dict)
    return result


def redact_processor(
    logger: Any, method_name: str, event_dict: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """structlog processor: redact every field of the event.

    Place it AFTER ``structlog.processors.format_exc_info`` (so rendered tracebacks are
    scrubbed too) and immediately BEFORE the renderer.
    """
    for key in list(event_dict):
        value = event_dict[key]
        if _is_secret_key(key) and isinstance(value, str) and value:
            event_dict[key] = REDACTED
        else:
            event_dict[key] = redact(value)
    return event_dict


class RedactingFilter(logging.Filter):
    """stdlib logging filter that scrubs records in place (the SDK logs through stdlib
    ``logging``, e.g. request options at DEBUG level). Attach it to HANDLERS: a filter on
    a handler sees records propagated from every child logger, a filter on a logger does
    not."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        cleaned = redact_text(message)
        if cleaned != message:
            record.msg = cleaned
            record.args = None
        if record.exc_info and record.exc_info[1] is not None and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact_text(record.exc_text)
        return True


def install_stdlib_redaction(logger: logging.Logger | None = None) -> RedactingFilter:
    """Attach one :class:`RedactingFilter` to every handler of ``logger`` (default: the
    root logger) and return it. Call after the handlers are configured."""
    target = logger if logger is not None else logging.getLogger()
    filt = RedactingFilter()
    for handler in target.handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(filt)
    return filt
