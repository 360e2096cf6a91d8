"""Who holds what: sessions, their training clients (models) and sampling sessions.

The registry is the one place that knows which session owns which model and sampler,
when a session last sent a heartbeat and when a model or sampler was last used, so it
can say what to release when a session goes silent or a budget is exceeded, and why an
id that was released is gone.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.local.compute.backend_types import AdapterSpec
from engine.local.compute.rollout_correction import RolloutCorrection
from engine.local.operations.sequencer import ModelSequencer

RELEASED_KEPT = 16384
EMPTY_SESSIONS_KEPT = 16384
"""Sessions that hold nothing are forgotten oldest first beyond this many (sessions that
hold models or samplers end only when their heartbeats stop)."""


@dataclass
class ModelState:
    model_id: str
    spec: AdapterSpec
    seq: ModelSequencer
    session_id: str | None
    base_model: str
    """The base_model name the client asked for."""
    last_used: float
    rollout_correction: RolloutCorrection | None = None
    """MinT's session-level correction from create_model, applied in every later
    importance_sampling forward_backward of this model."""


@dataclass
class SamplerSession:
    sampler_id: str
    key: str | None
    """Backend sampler key; None samples the bare base model."""
    model_path: str | None
    base_model: str
    """The base_model name the client used (directly, or for the model it came from)."""
    session_id: str | None
    ephemeral: bool
    """From save_weights_and_get_sampling_client: held in memory only."""
    last_used: float


@dataclass
class Snapshot:
    """A sampler snapshot the backend holds, by its key."""

    model_id: str
    """The training run it holds weights of (the client that saved it, or the run of
    the checkpoint it was loaded from)."""
    last_used: float
    """When it was saved or loaded, or last sampled from."""
    sampling: int = 0
    """Sample requests on it that are queued or running."""


@dataclass
class SessionRecord:
    session_id: str
    created: float
    last_heartbeat: float
    model_ids: list[str] = field(default_factory=list)
    sampler_ids: list[str] = field(default_factory=list)


class Registry:
    """Sessions, models and sampling sessions by id (event-loop only)."""

    def __init__(self, now: Callable[[], float]) -> None:
        self._now = now
        self.sessions: OrderedDict[str, SessionRecord] = OrderedDict()
        self.models: dict[str, ModelState] = {}
        self.samplers: dict[str, SamplerSession] = {}
        self.sampler_keys: dict[str, str] = {}
        """tinker path -> backend sampler key, for named snapshots loaded or saved here."""
        self.snapshots: dict[str, Snapshot] = {}
        """Backend sampler key -> what the registry knows of that snapshot."""
        self.newest: dict[str, str] = {}
        """model_id -> the key of the newest snapshot that training client saved."""
        self._released: OrderedDict[str, str] = OrderedDict()
        """Released model / sampler ids -> why (for the error a later use gets)."""

    # ---- sessions -------------------------------------------------------------------

    def open_session(self, session_id: str) -> SessionRecord:
        now = self._now()
        record = SessionRecord(session_id, now, now)
        self.sessions[session_id] = record
        empty = [s for s in self.sessions.values() if not (s.model_ids or s.sampler_ids)]
        for old in empty[: max(0, len(empty) - EMPTY_SESSIONS_KEPT)]:
            del self.sessions[old.session_id]
        return record

    def heartbeat(self, session_id: str) -> bool:
        """Note a heartbeat; False for a session this server does not know."""
        record = self.sessions.get(session_id)
        if record is None:
            return False
        record.last_heartbeat = self._now()
        return True

    def _session_for(self, session_id: str | None) -> SessionRecord | None:
        """The session a new model/sampler joins (one the server forgot is reopened, so
        its heartbeats keep what it creates alive)."""
        if session_id is None:
            return None
        return self.sessions.get(session_id) or self.open_session(session_id)

    def silent_sessions(self, timeout_s: float) -> list[SessionRecord]:
        """Sessions without a heartbeat for longer than ``timeout_s``."""
        deadline = self._now() - timeout_s
        return [s for s in self.sessions.values() if s.last_heartbeat < deadline]

    def close_session(self, session_id: str) -> None:
        self.sessions.pop(session_id, None)

    # ---- models and samplers ----------------------------------------------------------

    def add_model(self, model: ModelState) -> None:
        self.models[model.model_id] = model
        session = self._session_for(model.session_id)
        if session is not None:
            session.model_ids.append(model.model_id)

    def add_sampler(self, sampler: SamplerSession) -> None:
        self.samplers[sampler.sampler_id] = sampler
        session = self._session_for(sampler.session_id)
        if session is not None:
            session.sampler_ids.append(sampler.sampler_id)

    def touch(self, item: ModelState | SamplerSession) -> None:
        item.last_used = self._now()

    def release_model(self, model_id: str, reason: str) -> ModelState | None:
        model = self.models.pop(model_id, None)
        if model is not None:
            self._remember(model_id, reason)
            self.newest.pop(model_id, None)
        return model

    def release_sampler(self, sampler_id: str, reason: str) -> SamplerSession | None:
        sampler = self.samplers.pop(sampler_id, None)
        if sampler is not None:
            self._remember(sampler_id, reason)
        return sampler

    def why_released(self, item_id: str) -> str | None:
        return self._released.get(item_id)

    def _remember(self, item_id: str, reason: str) -> None:
        self._released[item_id] = reason
        while len(self._released) > RELEASED_KEPT:
            self._released.popitem(last=False)

    def key_in_use(self, key: str) -> bool:
        return any(s.key == key for s in self.samplers.values())

    def paths_in_use(self) -> set[str]:
        """Checkpoint paths live sampling sessions sample from."""
        return {s.model_path for s in self.samplers.values() if s.model_path is not None}

    # ---- snapshots -------------------------------------------------------------------

    def named_snapshot_keys(self) -> list[str]:
        """Keys of the checkpoint snapshots (loaded or saved under a tinker path)."""
        return list(dict.fromkeys(self.sampler_keys.values()))

    def in_memory_snapshots(self) -> dict[str, str]:
        """Key -> sampling session id of the save_weights_and_get_sampling_client
        snapshots (one session each)."""
        return {s.key: s.sampler_id for s in self.samplers.values() if s.ephemeral and s.key}

    def add_snapshot(self, key: str, model_id: str, *, saved: bool) -> None:
        """Note a snapshot the backend now holds; ``saved``: the training client
        ``model_id`` just saved it (it is that client's newest)."""
        snapshot = self.snapshots.setdefault(key, Snapshot(model_id, self._now()))
        snapshot.last_used = self._now()
        if saved:
            self.newest[model_id] = key

    def drop_snapshot(self, key: str) -> None:
        self.snapshots.pop(key, None)

    def sampling_started(self, key: str) -> None:
        snapshot = self.snapshots.get(key)
        if snapshot is not None:
            snapshot.sampling += 1
            snapshot.last_used = self._now()

    def sampling_ended(self, key: str) -> bool:
        """Note that a sample request on ``key`` finished; True when none is left."""
        snapshot = self.snapshots.get(key)
        if snapshot is None:
            return False
        snapshot.sampling -= 1
        return snapshot.sampling == 0

    def in_use(self, key: str, superseded_by: str | None = None) -> bool:
        """Whether a live client may still sample from snapshot ``key``: sample requests
        on it are queued or running, or it is the newest snapshot of a training client
        the server holds. ``superseded_by``: a model about to save a newer one (its
        current newest then no longer counts as its newest)."""
        snapshot = self.snapshots.get(key)
        if snapshot is None:
            return False
        if snapshot.sampling > 0:
            return True
        owner = snapshot.model_id
        return owner != superseded_by and owner in self.models and self.newest.get(owner) == key

    def eviction_order(self, keys: list[str], protect: frozenset[str]) -> list[str]:
        """Of ``keys``, those no live client may still sample from (``in_use``), in the
        order to evict them: snapshots of released training clients first, then the
        least recently used first."""
        free = [k for k in keys if k not in protect and not self.in_use(k)]

        def rank(key: str) -> tuple[bool, float]:
            snapshot = self.snapshots.get(key)
            if snapshot is None:
                return (False, -math.inf)
            return (snapshot.model_id in self.models, snapshot.last_used)

        return sorted(free, key=rank)
