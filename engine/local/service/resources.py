"""Bounded resources: what the server releases, and when.

- A session without a heartbeat for ``session_timeout_s`` loses its training clients
  and sampling sessions (the SDK heartbeats every 10 s while its ServiceClient lives).
- At most ``limits.max_models`` training clients and ``limits.max_named_samplers``
  checkpoint snapshots are held in memory; beyond that the least recently used idle
  one is evicted. A later use of an evicted id fails with a message saying why.
"""

from __future__ import annotations

from typing import Any

from engine.local.service.core import Core


class Resources:
    def __init__(self, core: Core) -> None:
        self.core = core
        self.evicted = {"models": 0, "named_samplers": 0, "silent_sessions": 0}

    async def make_room_for_model(self) -> bool:
        """Evict idle training clients until one more fits; False if all are busy."""
        registry, limit = self.core.registry, self.core.config.limits.max_models
        while len(registry.models) >= limit:
            victim = registry.least_recently_used_model(lambda m: m.seq.queued == 0)
            if victim is None:
                return False
            self.evicted["models"] += 1
            self.release_model(
                victim.model_id,
                f"evicted as the least recently used of the {limit} training clients the "
                "local server holds (--max-models); save_state regularly and resume with "
                "create_training_client_from_state",
            )
        return True

    async def make_room_for_sampler(self) -> None:
        """Evict loaded checkpoint snapshots until one more fits."""
        registry, limit = self.core.registry, self.core.config.limits.max_named_samplers
        while len(set(registry.sampler_keys.values())) >= limit:
            victim = registry.least_recently_used_named_sampler()
            key = victim.key if victim is not None else next(iter(registry.sampler_keys.values()))
            assert key is not None
            self.evicted["named_samplers"] += 1
            reason = (
                f"its snapshot was evicted as the least recently used of the {limit} "
                "checkpoint snapshots the local server holds (--max-samplers); create a new "
                "sampling client for its model_path"
            )
            for sampler in [s for s in registry.samplers.values() if s.key == key]:
                registry.release_sampler(sampler.sampler_id, reason)
            for path in [p for p, k in registry.sampler_keys.items() if k == key]:
                del registry.sampler_keys[path]
            self.core.spawn(self._release_snapshot, key)

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
