"""The OpenAI wire format the endpoint speaks: request bodies (pydantic, validated on
arrival: a body that does not fit is a 400) and the error body.

Only what the engine can honour is modelled; other fields of OpenAI's requests are
accepted and ignored (agent frameworks send vendor extras), except those whose silent
loss would change the answer, which are refused by the callers with a 400 naming them.
Responses are built as plain JSON by :mod:`engine.agents.endpoint`; the tests validate
them against the ``openai`` package's own types.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from engine.common.protocol import MAX_SEED

__all__ = [
    "ChatRequest",
    "CompletionRequest",
    "EndpointError",
    "FunctionCallWire",
    "MessageWire",
    "ToolCallWire",
    "ToolWire",
    "error_body",
]

MAX_STOP = 4
"""Stop strings a request may give (OpenAI's bound)."""
MAX_STOP_CHARS = 1024
"""The longest stop string a request may give, in characters."""


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class FunctionCallWire(_Lenient):
    name: str
    arguments: str = "{}"
    """A JSON object as a string (OpenAI's form)."""


class ToolCallWire(_Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallWire


class ContentPart(_Lenient):
    type: str
    text: str | None = None


class MessageWire(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallWire] | None = None
    tool_call_id: str | None = None


class FunctionWire(_Lenient):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolWire(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionWire


class StreamOptions(_Lenient):
    include_usage: bool = False


class _Sampling(_Lenient):
    model: str
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=64)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stream: bool = False
    stream_options: StreamOptions | None = None

    @field_validator("stop")
    @classmethod
    def _bounded(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings, got {len(stops)}")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop string must be at most {MAX_STOP_CHARS} characters")
        return stop

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        return tuple(s for s in stops if s)


class ChatRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[MessageWire] = Field(min_length=1)
    tools: list[ToolWire] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: one prompt, as text or token ids."""

    prompt: str | list[int]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False


class EndpointError(Exception):
    """An error the endpoint answers with ``status`` and OpenAI's error body."""

    TYPES: ClassVar[dict[int, str]] = {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        408: "timeout_error",
        409: "conflict_error",
        405: "invalid_request_error",
        413: "invalid_request_error",
        429: "rate_limit_error",
        503: "service_unavailable_error",
    }

    def __init__(self, status: int, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.TYPES.get(self.status, "api_error"), self.param)


def error_body(message: str, kind: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}
