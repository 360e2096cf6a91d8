"""The REST management API (the SDK's RestClient): training runs, checkpoints, sessions.

Answers follow the SDK's types (``tinker.types.TrainingRun``, ``Checkpoint``,
``CheckpointsListResponse``, ``TrainingRunsResponse``, ``GetSessionResponse``,
``ListSessionsResponse``). This is a single-user server: every run is owned by the
caller, so ``access_scope`` "owned" and "accessible" list the same runs.
"""

from __future__ import annotations

from typing import Any

from engine.local.models.storage import KINDS, BadPath, TinkerPath
from engine.local.operations.checkpoints import CheckpointStore, StoredCheckpoint, iso, valid_time
from engine.local.operations.core import Core, HttpError

MAX_PAGE = 1000
OWNER = "local"


class ManagementApi:
    def __init__(self, core: Core, checkpoints: CheckpointStore) -> None:
        self.core = core
        self.checkpoints = checkpoints

    # ---- training runs ------------------------------------------------------------------

    def training_run(self, run_id: str, access_scope: str = "owned") -> dict[str, Any]:
        _check_scope(access_scope)
        run = self._run(run_id)
        if run is None:
            raise HttpError(404, f"training run {run_id!r} not found")
        return run

    def training_runs(self, limit: str | None, offset: str | None, access_scope: str) -> Any:
        _check_scope(access_scope)
        first, count = _page(limit, offset, default_limit=20)
        runs = [r for r in (self._run(i) for i in self.checkpoints.run_ids()) if r is not None]
        runs.sort(key=lambda r: r["last_request_time"], reverse=True)
        return {
            "training_runs": runs[first : first + count],
            "cursor": {"offset": first, "limit": count, "total_count": len(runs)},
        }

    def _run(self, run_id: str) -> dict[str, Any] | None:
        record = self.checkpoints.run_record(run_id)
        if record is None:
            return None
        checkpoints = self.checkpoints.records(run_id)
        live = self.core.registry.models.get(run_id)
        times = [valid_time(record.get("created")) or 0.0] + [c.created for c in checkpoints]
        if live is not None:
            times.append(live.last_used)
        rank = record.get("lora_rank")
        return {
            "training_run_id": run_id,
            "base_model": str(record.get("base_model") or self.core.card.name),
            "model_owner": OWNER,
            "is_lora": True,
            "corrupted": False,
            "lora_rank": rank if isinstance(rank, int) else None,
            "last_request_time": iso(max(times)),
            "last_checkpoint": _latest(checkpoints, "weights"),
            "last_sampler_checkpoint": _latest(checkpoints, "sampler_weights"),
            "user_metadata": record.get("user_metadata"),
        }

    # ---- checkpoints --------------------------------------------------------------------

    def run_checkpoints(self, run_id: str) -> dict[str, Any]:
        if self.checkpoints.run_record(run_id) is None:
            raise HttpError(404, f"training run {run_id!r} not found")
        return {"checkpoints": [c.to_json() for c in self.checkpoints.records(run_id)]}

    def user_checkpoints(self, limit: str | None, offset: str | None) -> dict[str, Any]:
        first, count = _page(limit, offset, default_limit=100)
        records = [c for run in self.checkpoints.run_ids() for c in self.checkpoints.records(run)]
        records.sort(key=lambda c: (c.created, str(c.path)), reverse=True)
        return {
            "checkpoints": [c.to_json() for c in records[first : first + count]],
            "cursor": {"offset": first, "limit": count, "total_count": len(records)},
        }

    def path_of(self, run_id: str, kind: str, name: str) -> TinkerPath:
        """The checkpoint a REST path names (as strict as a tinker:// path)."""
        if kind not in KINDS:
            raise HttpError(
                400, f"checkpoint id {kind}/{name!r} must start with weights/ or sampler_weights/"
            )
        try:
            return TinkerPath.parse(f"tinker://{run_id}/{kind}/{name}")
        except BadPath as exc:
            raise HttpError(400, str(exc)) from None

    # ---- sessions -----------------------------------------------------------------------

    def session(self, session_id: str, access_scope: str = "owned") -> dict[str, Any]:
        _check_scope(access_scope)
        record = self.core.registry.sessions.get(session_id)
        if record is None:
            raise HttpError(
                404,
                f"session {session_id!r} not found (sessions live in memory: they end when "
                "their heartbeats stop or the server restarts)",
            )
        return {"training_run_ids": list(record.model_ids), "sampler_ids": list(record.sampler_ids)}

    def sessions(self, limit: str | None, offset: str | None, access_scope: str) -> dict[str, Any]:
        _check_scope(access_scope)
        first, count = _page(limit, offset, default_limit=20)
        newest_first = sorted(
            self.core.registry.sessions.values(), key=lambda s: s.created, reverse=True
        )
        return {"sessions": [s.session_id for s in newest_first[first : first + count]]}


def _latest(records: list[StoredCheckpoint], kind: str) -> dict[str, Any] | None:
    of_kind = [r for r in records if r.path.kind == kind]
    return of_kind[-1].to_json() if of_kind else None


def _check_scope(access_scope: str) -> None:
    if access_scope not in ("owned", "accessible"):
        raise HttpError(400, f"access_scope must be 'owned' or 'accessible', got {access_scope!r}")


def _page(limit: str | None, offset: str | None, *, default_limit: int) -> tuple[int, int]:
    """(offset, limit) from query parameters, each checked."""
    values = []
    for name, text, default, low in (
        ("offset", offset, 0, 0),
        ("limit", limit, default_limit, 1),
    ):
        if text is None:
            values.append(default)
            continue
        try:
            value = int(text)
        except ValueError:
            raise HttpError(400, f"{name} must be an integer, got {text!r}") from None
        if not low <= value <= (MAX_PAGE if name == "limit" else 10**9):
            bound = f"{low}..{MAX_PAGE}" if name == "limit" else ">= 0"
            raise HttpError(400, f"{name} must be {bound}, got {value}")
        values.append(value)
    return values[0], values[1]
