"""Bounded resources: what the server releases, and when.

- A session without a heartbeat for ``session_timeout_s`` loses its training clients
  and sampling sessions (the SDK heartbeats every 10 s while its ServiceClient lives).
- At most ``limits.max_models`` training clients are held (a new one beyond it is
  refused, see ``TrainingOps``) and at most ``limits.max_named_samplers`` checkpoint
  snapshots (beyond it one is evicted). A later use of an evicted id fails with a
  message saying why.
"""

from __future__ import annotations

import math
from typing import Any

from engine.local.service.core import Core, HttpError


class Resources:
    def __init__(self, core: Core) -> None:
        self.core = core
        self.evicted = {"models": 0, "named_samplers": 0, "silent_sessions": 0}
        self.creating_models = 0
        """Training clients accepted and not created yet (they count against
        ``limits.max_models``)."""

    def limit_snapshots(self, *, room: int = 0, protect: frozenset[str] = frozenset()) -> None:
        """Evict checkpoint snapshots until at most ``limits.max_named_samplers - room``
        are held: ones no sampling session uses first (oldest first), then the least
        recently used; keys in ``protect`` stay."""
        registry, limit = self.core.registry, self.core.config.limits.max_named_samplers
        held = len(set(registry.sampler_keys.values()))
        for key in self._snapshots_by_use(protect):
            if held <= limit - room:
                return
            self._evict_snapshot(
                key,
                f"its snapshot was evicted as the least recently used of the {limit} "
                "checkpoint snapshots the local server holds (--max-samplers); create a new "
                "sampling client for its model_path",
            )
            held -= 1

    def _snapshots_by_use(self, protect: frozenset[str]) -> list[str]:
        """Checkpoint snapshot keys, those no sampling session uses first (oldest
        first), then by when a sampling session last used them."""
        registry = self.core.registry
        used: dict[str, float] = {}
        for sampler in registry.samplers.values():
            if sampler.key is not None:
                used[sampler.key] = max(used.get(sampler.key, -math.inf), sampler.last_used)
        keys = [k for k in dict.fromkeys(registry.sampler_keys.values()) if k not in protect]
        return sorted(keys, key=lambda k: used.get(k, -math.inf))

    def _evict_snapshot(self, key: str, reason: str) -> None:
        registry = self.core.registry
        self.evicted["named_samplers"] += 1
        for sampler in [s for s in registry.samplers.values() if s.key == key]:
            registry.release_sampler(sampler.sampler_id, reason)
        for path in [p for p, k in registry.sampler_keys.items() if k == key]:
            del registry.sampler_keys[path]
        self.core.spawn(self._release_snapshot, key)

    async def enforce_memory(self, protect: frozenset[str] = frozenset()) -> None:
        """Evict until training clients and snapshots fit ``limits.max_adapter_bytes``:
        checkpoint snapshots first, then in-memory snapshots, then idle training
        clients, least recently used first; ids / keys in ``protect`` stay."""
        limit = self.core.config.limits.max_adapter_bytes
        backend, registry = self.core.backend, self.core.registry
        model_bytes, snapshot_bytes = await self.core.compute.run(backend.held_bytes)
        total = sum(model_bytes.values()) + sum(snapshot_bytes.values())
        if total <= limit:
            return
        reason = (
            f"evicted to keep the local server's training clients and snapshots within "
            f"{limit} bytes (--max-adapter-memory)"
        )
        named = self._snapshots_by_use(protect)
        ephemeral = sorted(
            (s for s in registry.samplers.values() if s.ephemeral and s.key not in protect),
            key=lambda s: s.last_used,
        )
        idle = sorted(
            (m for m in registry.models.values() if m.seq.queued == 0),
            key=lambda m: m.last_used,
        )
        for key in named:
            if total <= limit:
                return
            self._evict_snapshot(key, reason)
            total -= snapshot_bytes.get(key, 0)
        for sampler in ephemeral:
            if total <= limit:
                return
            if sampler.sampler_id in registry.samplers:
                self.release_sampler(sampler.sampler_id, reason)
                total -= snapshot_bytes.get(sampler.key or "", 0)
        for model in idle:
            if total <= limit:
                return
            if model.model_id not in protect:
                self.evicted["models"] += 1
                self.release_model(model.model_id, reason)
                total -= model_bytes.get(model.model_id, 0)

    def check_model_budget(self) -> None:
        """HTTP 429 when ``limits.max_models`` training clients are held or being
        created: a new client never evicts a live one of another run."""
        core = self.core
        limit = core.config.limits.max_models
        if len(core.registry.models) + self.creating_models < limit:
            return
        raise HttpError(
            429,
            f"the local server already holds {limit} training clients (--max-models); a "
            "client is released once its session stops sending heartbeats "
            f"(--session-timeout {core.config.session_timeout_s:g} s): end another run, or "
            "restart the server with a larger --max-models",
            category="server",
            headers={"Retry-After": str(math.ceil(core.config.housekeeping_interval_s))},
        )

    def release_model(self, model_id: str, reason: str) -> None:
        if self.core.registry.release_model(model_id, reason) is not None:
            self.core.spawn(self._delete_model, model_id)

    def release_sampler(self, sampler_id: str, reason: str) -> None:
        registry = self.core.registry
        sampler = registry.release_sampler(sampler_id, reason)
        if sampler is None or sampler.key is None:
            return
        shared = registry.key_in_use(sampler.key) or sampler.key in registry.sampler_keys.values()
        if not shared:
            self.core.spawn(self._release_snapshot, sampler.key)

    def expire_silent_sessions(self) -> int:
        """Release what sessions without recent heartbeats hold; return how many."""
        timeout = self.core.config.session_timeout_s
        silent = self.core.registry.silent_sessions(timeout)
        reason = (
            f"its session sent no heartbeat for {timeout:g} s (--session-timeout), so the "
            "local server released what it held"
        )
        for session in silent:
            for model_id in session.model_ids:
                self.release_model(model_id, reason)
            for sampler_id in session.sampler_ids:
                self.release_sampler(sampler_id, reason)
            self.core.registry.close_session(session.session_id)
        self.evicted["silent_sessions"] += len(silent)
        return len(silent)

    def held(self) -> dict[str, Any]:
        registry = self.core.registry
        return {
            "sessions": len(registry.sessions),
            "models": sorted(registry.models),
            "sampling_sessions": len(registry.samplers),
            "checkpoint_snapshots": len(set(registry.sampler_keys.values())),
            "released": dict(self.evicted),
        }

    async def _delete_model(self, model_id: str) -> None:
        backend = self.core.backend
        await self.core.compute.run(lambda: backend.delete_model(model_id))

    async def _release_snapshot(self, key: str) -> None:
        backend = self.core.backend
        await self.core.compute.run(lambda: backend.release_sampler(key))
