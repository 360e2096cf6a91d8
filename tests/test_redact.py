"""API keys never reach logs, config.json or error lines."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import jwt
import pytest
import structlog

from engine.errors import format_error
from engine.redact import (
    REDACTED,
    clear_registered_secrets,
    install_stdlib_redaction,
    redact,
    redact_config,
    redact_processor,
    redact_text,
    register_secret,
)
from tests import sdk_errors as sdk

SK = "sk-0123456789abcdefABCDEF_xyz"
TML = "tml-QwErTy0123456789-abcdef"
JWT = jwt.encode({"sub": "user-1", "exp": 4102444800}, "s" * 32, algorithm="HS256")
ODD = "p@ss:w0rd/with~odd#chars"  # a registered secret of no known shape


@pytest.fixture(autouse=True)
def _registry() -> Iterator[None]:
    clear_registered_secrets()
    yield
    clear_registered_secrets()


def test_key_shapes_are_hidden_and_prefix_kept() -> None:
    text = f"key={SK} other {TML} bearer {JWT}."
    cleaned = redact_text(text)
    for secret in (SK, TML, JWT):
        assert secret not in cleaned
    assert cleaned == f"key=sk-{REDACTED} other tml-{REDACTED} bearer eyJ{REDACTED}."


def test_ordinary_words_are_left_alone() -> None:
    text = "use sk-learn and tml-tools; task-sk-0123456789abc is a slug; max_tokens=16"
    assert redact_text(text) == text


def test_registered_secrets_of_any_shape() -> None:
    assert redact_text(f"pw={ODD}") == f"pw={ODD}"
    register_secret(ODD)
    register_secret(None)
    register_secret("")
    assert redact_text(f"pw={ODD}!") == f"pw={REDACTED}!"


def test_redact_config_replaces_secret_fields_and_keeps_the_rest() -> None:
    config = {
        "api_key": "whatever-format",
        "base_url": f"http://127.0.0.1:8000/?key={SK}",
        "lora_rank": 16,
        "max_tokens": 16,
        "nested": {"auth_token": "abc", "tokens": [1, 2, 3], "note": None},
        "steps": [TML, 3.5, True],
        "empty_api_key": "",
    }
    safe = redact_config(config)
    assert safe == {
        "api_key": REDACTED,
        "base_url": f"http://127.0.0.1:8000/?key=sk-{REDACTED}",
        "lora_rank": 16,
        "max_tokens": 16,
        "nested": {"auth_token": REDACTED, "tokens": [1, 2, 3], "note": None},
        "steps": [f"tml-{REDACTED}", 3.5, True],
        "empty_api_key": "",
    }
    assert config["api_key"] == "whatever-format"  # input untouched


def test_redact_hides_secrets_in_arbitrary_objects() -> None:
    class Holder:
        def __str__(self) -> str:
            return f"Holder({SK})"

    plain = object()
    assert redact(plain) is plain
    assert redact(Holder()) == f"Holder(sk-{REDACTED})"
    assert redact((SK, 1)) == (f"sk-{REDACTED}", 1)


def test_structlog_processor_scrubs_every_field_and_tracebacks() -> None:
    register_secret(ODD)
    out = io.StringIO()
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.format_exc_info,
            redact_processor,
            structlog.processors.JSONRenderer(),
        ],
        logger_factory=structlog.PrintLoggerFactory(file=out),
        cache_logger_on_first_use=False,
    )
    try:
        log = structlog.get_logger("test")
        log.info(f"connecting with {SK}", api_key=TML, headers={"X-API-Key": JWT}, pw=ODD)
        try:
            raise RuntimeError(f"server echoed {TML} and {ODD}")
        except RuntimeError:
            log.exception("failed")
    finally:
        structlog.reset_defaults()
    text = out.getvalue()
    for secret in (SK, TML, JWT, ODD):
        assert secret not in text
    first, second = (json.loads(line) for line in text.splitlines())
    assert first["api_key"] == REDACTED
    assert first["headers"] == {"X-API-Key": REDACTED}
    assert "RuntimeError: server echoed" in second["exception"]


def test_stdlib_logging_filter_scrubs_sdk_records() -> None:
    out = io.StringIO()
    logger = logging.getLogger("test_redact_stdlib")
    logger.propagate = False
    handler = logging.StreamHandler(out)
    logger.addHandler(handler)
    try:
        install_stdlib_redaction(logger)
        child = logging.getLogger("test_redact_stdlib.tinker")  # records propagate up
        child.warning("Request options: %s", {"headers": {"X-API-Key": TML}})
        try:
            raise ValueError(f"bad key {SK}")
        except ValueError:
            child.exception("failed")
    finally:
        logger.removeHandler(handler)
    text = out.getvalue()
    assert TML not in text and SK not in text
    assert f"tml-{REDACTED}" in text and "ValueError: bad key" in text


def test_error_lines_never_show_a_key() -> None:
    register_secret(ODD)
    err = sdk.status_error(401, {"detail": f"invalid key {SK} (also {ODD})"})
    assert SK not in format_error(err) and ODD not in format_error(err)
    wrapped = RuntimeError(f"could not start: {TML}")
    assert format_error(wrapped) == f"Error: RuntimeError: could not start: tml-{REDACTED}"
    failed = sdk.request_failed(f"token {JWT} expired", "user")
    assert JWT not in format_error(failed)
