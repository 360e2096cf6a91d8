"""Bounded resources: what the server releases, and when.

- A session without a heartbeat for ``session_timeout_s`` loses its training clients
  and sampling sessions (the SDK heartbeats every 10 s while its ServiceClient lives).
- At most ``limits.max_models`` training clients are held (a new one beyond it is
  refused, see ``TrainingOps``), at most ``limits.max_named_samplers`` checkpoint
  snapshots and ``limits.max_ephemeral_samplers`` in-memory ones: beyond a bound one no
  live client may still sample from is evicted (``Registry.in_use``); when none can be,
  the new snapshot is refused (429). A later use of an evicted id fails with a message
  saying why.
"""

from __future__ import annotations

import math
from typing import Any

from engine.local.operations.core import Core, HttpError


class Resources:
    def __init__(self, core: Core) -> None:
        self.core = core
        self.evicted = {"models": 0, "named_samplers": 0, "silent_sessions": 0}
        self.creating_models = 0
        """Training clients accepted and not created yet (they count against
        ``limits.max_models``)."""

    def limit_snapshots(self, *, room: int = 0, protect: frozenset[str] = frozenset()) -> bool:
        """Evict checkpoint snapshots until at most ``limits.max_named_samplers - room``
        are held, in ``Registry.eviction_order`` (never one a live client may still
        sample from; keys in ``protect`` stay). False when that many cannot be freed."""
        registry, limit = self.core.registry, self.core.config.limits.max_named_samplers
        keys = registry.named_snapshot_keys()
        held = len(keys)
        for key in registry.eviction_order(keys, protect):
            if held <= limit - room:
                break
            self._evict_snapshot(
                key,
                f"its snapshot was evicted as the least recently used of the {limit} "
                "checkpoint snapshots the local server holds (--max-samplers); create a new "
                "sampling client for its model_path",
            )
            held -= 1
        return held <= limit - room

    def limit_ephemeral(self) -> None:
        """Release in-memory snapshots (save_weights_and_get_sampling_client) beyond
        ``limits.max_ephemeral_samplers``, in ``Registry.eviction_order``."""
        registry, limit = self.core.registry, self.core.config.limits.max_ephemeral_samplers
        held = registry.in_memory_snapshots()
        excess = len(held) - limit
        for key in registry.eviction_order(list(held), frozenset())[: max(0, excess)]:
            self.release_sampler(
                held[key],
                f"the local server keeps at most {limit} save_weights_and_get_sampling_client "
                "snapshots in memory and released this older one (use "
                "save_weights_for_sampler for snapshots you sample from for longer)",
            )

    def check_snapshot_room(self, model_id: str, *, named: bool) -> None:
        """HTTP 429 when training client ``model_id`` saving a new sampler snapshot would
        need more room than the bound leaves: snapshots live clients may still sample
        from (``Registry.in_use``; its own newest is superseded by the new one) are never
        evicted to make it."""
        registry = self.core.registry
        keys = registry.named_snapshot_keys() if named else list(registry.in_memory_snapshots())
        in_use = sum(registry.in_use(k, superseded_by=model_id) for k in keys)
        if in_use >= self._snapshot_limit(named):
            raise self._snapshots_busy(named)

    def room_for_checkpoint_snapshot(self) -> None:
        """Make room for one more checkpoint snapshot (a sampling client's model_path to
        load), or HTTP 429 when every one held is in use."""
        if not self.limit_snapshots(room=1):
            raise self._snapshots_busy(named=True)

    def _snapshot_limit(self, named: bool) -> int:
        limits = self.core.config.limits
        return limits.max_named_samplers if named else limits.max_ephemeral_samplers

    def _snapshots_busy(self, named: bool) -> HttpError:
        core = self.core
        what = "checkpoint" if named else "save_weights_and_get_sampling_client"
        return HttpError(
            429,
            f"the local server holds {self._snapshot_limit(named)} {what} snapshots "
            "(--max-samplers) and live clients may still sample from every one (each "
            "training client's newest, and those being sampled); they are released when "
            "their run's session ends or stops sending heartbeats (--session-timeout "
            f"{core.config.session_timeout_s:g} s): end another run, or restart the server "
            "with a larger --max-samplers",
            category="server",
            headers={"Retry-After": str(math.ceil(core.config.housekeeping_interval_s))},
        )

    def sampling_ended(self, key: str) -> None:
        """A sample request on ``key`` finished: evict what its use kept beyond a bound."""
        if self.core.registry.sampling_ended(key):
            self.trim()

    def trim(self) -> None:
        """Bring the snapshot bounds back once snapshots in use were let go (a bound
        that could not be met without breaking a live client waited for this)."""
        self.limit_snapshots()
        self.limit_ephemeral()

    def _evict_snapshot(self, key: str, reason: str) -> None:
        registry = self.core.registry
        self.evicted["named_samplers"] += 1
        for sampler in [s for s in registry.samplers.values() if s.key == key]:
            registry.release_sampler(sampler.sampler_id, reason)
        for path in [p for p, k in registry.sampler_keys.items() if k == key]:
            del registry.sampler_keys[path]
        self._spawn_release(key)

    async def enforce_memory(self, protect: frozenset[str] = frozenset()) -> None:
        """Evict until training clients and snapshots fit ``limits.max_adapter_bytes``:
        checkpoint snapshots first, then in-memory snapshots (both in
        ``Registry.eviction_order``: none a live client may still sample from), then idle
        training clients, least recently used first; ids / keys in ``protect`` stay."""
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
        named = registry.eviction_order(registry.named_snapshot_keys(), protect)
        in_memory = registry.in_memory_snapshots()
        ephemeral = [in_memory[k] for k in registry.eviction_order(list(in_memory), protect)]
        idle = sorted(
            (m for m in registry.models.values() if m.seq.queued == 0),
            key=lambda m: m.last_used,
        )
        for key in named:
            if total <= limit:
                return
            self._evict_snapshot(key, reason)
            total -= snapshot_bytes.get(key, 0)
        for sampler_id in ephemeral:
            if total <= limit:
                return
            sampler = registry.samplers.get(sampler_id)
            if sampler is not None:
                self.release_sampler(sampler_id, reason)
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
            self.trim()  # its newest snapshot is no longer in use

    def release_sampler(self, sampler_id: str, reason: str) -> None:
        registry = self.core.registry
        sampler = registry.release_sampler(sampler_id, reason)
        if sampler is None or sampler.key is None:
            return
        shared = registry.key_in_use(sampler.key) or sampler.key in registry.sampler_keys.values()
        if not shared:
            self._spawn_release(sampler.key)

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
            "checkpoint_snapshots": len(registry.named_snapshot_keys()),
            "released": dict(self.evicted),
        }

    async def _delete_model(self, model_id: str) -> None:
        backend = self.core.backend
        await self.core.compute.run(lambda: backend.delete_model(model_id))

    def _spawn_release(self, key: str) -> None:
        self.core.registry.drop_snapshot(key)
        self.core.spawn(self._release_snapshot, key)

    async def _release_snapshot(self, key: str) -> None:
        backend = self.core.backend
        await self.core.compute.run(lambda: backend.release_sampler(key))
