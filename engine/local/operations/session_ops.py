"""Session-level calls that newer tinker SDKs (0.38) make and 0.22 never does:
``client/dynamic_config``, ``join_sampling_session``, ``cancel_future`` and
``sessions/{id}/finish``."""

from __future__ import annotations

from typing import Any

from engine.local.operations.core import Core, HttpError, raw_field
from engine.local.operations.resources import Resources

FINISHED_KEPT = 16384


class SessionOps:
    def __init__(self, core: Core, resources: Resources) -> None:
        self.core = core
        self.resources = resources
        self._clones: dict[str, int] = {}
        """sampling_session_id -> the last clone id handed out (0 is the original client)."""
        self._finished: dict[str, str] = {}
        """session_id -> its finish status (first wins), oldest first."""

    def dynamic_config(self, body: Any) -> dict[str, Any]:
        """The periodically refreshed flags: no explicit sample cancellation (the local
        sampler runs each batch to completion; an abandoned result is simply dropped)."""
        return {
            "refresh_interval_sec": 300,
            "sample_cancel_enabled": False,
            "sample_cancel_max_batch_size": 64,
        }

    def join_sampling_session(self, body: Any) -> dict[str, Any]:
        """A clone id, unique within the sampling session, for an unpickled or handle-built
        SamplingClient (it numbers its sample seq_ids from ``clone id * 1e9``)."""
        sampler_id = raw_field(body, "sampling_session_id", str)
        if sampler_id is None:
            raise HttpError(400, "join_sampling_session needs a sampling_session_id (a string)")
        if sampler_id not in self.core.registry.samplers:
            why = self.core.registry.why_released(sampler_id)
            raise HttpError(
                404,
                f"sampling session {sampler_id!r} was released: {why}"
                if why
                else f"unknown sampling_session_id {sampler_id!r}",
            )
        counter = self._clones.get(sampler_id, 0) + 1
        self._clones[sampler_id] = counter
        return {"type": "join_sampling_session", "client_counter": counter}

    def cancel_future(self, body: Any) -> dict[str, Any]:
        """Accepted and ignored: a queued or running sample still completes, and its
        result is kept like any other until it is fetched or forgotten."""
        request_id = raw_field(body, "request_id", str)
        if request_id is None:
            raise HttpError(400, "cancel_future needs a request_id (a string)")
        if self.core.futures.get(request_id) is None:
            raise HttpError(404, f"request {request_id!r} is unknown or its result has expired")
        return {}

    def finish(self, session_id: str, body: Any) -> dict[str, Any]:
        """``ServiceClient.close(status)``: release what the session holds (its training
        clients and sampling sessions); the first finish wins, later ones are no-ops."""
        if session_id in self._finished:
            return {}
        reason = body.get("reason") if isinstance(body, dict) else None
        status = reason.get("type") if isinstance(reason, dict) else None
        self._finished[session_id] = status if isinstance(status, str) else "unknown"
        while len(self._finished) > FINISHED_KEPT:
            self._finished.pop(next(iter(self._finished)))
        record = self.core.registry.sessions.get(session_id)
        if record is None:
            return {}
        why = f"its session was finished by the client (ServiceClient.close, status {status!r})"
        for model_id in list(record.model_ids):
            self.resources.release_model(model_id, why)
        for sampler_id in list(record.sampler_ids):
            self.resources.release_sampler(sampler_id, why)
        self.core.registry.close_session(session_id)
        return {}
