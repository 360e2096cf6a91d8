"""Raw protocol calls to a running local server, for tests that must see every status as
the server sent it (no SDK, so no SDK retries). Test files extend :class:`RawClient` with
the calls they need."""

from __future__ import annotations

from typing import Any

import httpx

from engine.local import RunningServer


class RawClient:
    """A session, a training client, its numbered operations, and their futures."""

    def __init__(self, server: RunningServer, http: httpx.AsyncClient) -> None:
        self.server = server
        self.http = http
        self.seq: dict[str, int] = {}

    async def result(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST ``path`` (it must be accepted) and wait for its future's payload."""
        answer = await self.http.post(f"/api/v1/{path}", json=body)
        assert answer.status_code == 200, answer.text
        return await self.wait(answer.json()["request_id"])

    async def wait(self, request_id: str) -> dict[str, Any]:
        while True:
            polled = await self.http.post(
                "/api/v1/retrieve_future", json={"request_id": request_id}
            )
            payload: dict[str, Any] = polled.json()
            if payload.get("type") != "try_again":
                return payload

    async def session(self) -> str:
        answer = await self.http.post("/api/v1/create_session", json={})
        session_id: str = answer.json()["session_id"]
        return session_id

    async def model(self, session_id: str | None = None) -> str:
        """A new rank-2 training client (in a new session unless one is given)."""
        created = await self.result(
            "create_model",
            {
                "session_id": session_id or await self.session(),
                "model_seq_id": 0,
                "base_model": self.server.model_name,
                "lora_config": {"rank": 2},
            },
        )
        model_id: str = created["model_id"]
        return model_id

    def op_body(self, model_id: str, **body: Any) -> dict[str, Any]:
        """``body`` for the training client's next operation (its next seq_id)."""
        self.seq[model_id] = self.seq.get(model_id, 0) + 1
        return {"model_id": model_id, "seq_id": self.seq[model_id], **body}

    async def op(self, endpoint: str, model_id: str, **body: Any) -> dict[str, Any]:
        return await self.result(endpoint, self.op_body(model_id, **body))
