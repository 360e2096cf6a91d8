"""Who holds what: sessions, their training clients (models) and sampling sessions.

The registry is the one place that knows which session owns which model and sampler,
when a session last sent a heartbeat and when a model or sampler was last used, so it
can say what to release when a session goes silent or a budget is exceeded, and why an
id that was released is gone.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.local.backend import AdapterSpec
from engine.local.sequencer import ModelSequencer

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

    def least_recently_used_model(self, idle: Callable[[ModelState], bool]) -> ModelState | None:
        candidates = [m for m in self.models.values() if idle(m)]
        return min(candidates, key=lambda m: m.last_used, default=None)

    def least_recently_used_named_sampler(self) -> SamplerSession | None:
        candidates = [s for s in self.samplers.values() if not s.ephemeral and s.key is not None]
        return min(candidates, key=lambda s: s.last_used, default=None)
