"""What every part of the local server's protocol logic shares.

``Core`` holds the server state that training, sampling, checkpoints and the REST API
all touch (config, backend, compute thread, futures, registry, stats, clocks) and the
helpers to answer a request with a future and run a job on the compute thread. It is
event-loop only: nothing here needs a lock.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from anyio.abc import TaskGroup

from engine.basemodels.recommended import model_entry
from engine.local.compute.backend import Backend
from engine.local.compute.backend_types import BackendError
from engine.local.compute.stability import StabilityRecords
from engine.local.compute.thread import ComputeThread, ComputeThreadClosed
from engine.local.config import ServerConfig
from engine.local.faults import FaultInjector
from engine.local.http.wire import WireError, parse
from engine.local.latency import TrainingClock
from engine.local.models.storage import BadPath
from engine.local.operations.futures import FutureEntry, FutureStore, TooManyPending
from engine.local.operations.jobs import Job
from engine.local.operations.registry import Registry
from engine.local.operations.sequencer import SeqRejected
from engine.local.stats import Stats

log = logging.getLogger("engine.local")

USER_ERRORS = (BackendError, WireError, BadPath, SeqRejected)
INJECTED_FAIL = "injected fault: the server failed this request (fault injection)"


class HttpError(Exception):
    """Answered as an HTTP error status with a JSON body {"error", "category"}."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        category: str = "user",
        headers: dict[str, str] | None = None,
        body: dict[str, Any] | None = None,
    ) -> None:
        """``body``: more fields of the JSON answer besides "error" and "category"."""
        super().__init__(message)
        self.status = status
        self.message = message
        self.category = category
        self.headers = headers or {}
        self.body = body or {}


@dataclass(frozen=True)
class ModelCard:
    """What the server says about the model it serves."""

    name: str
    directory: Path
    max_context: int
    arch: str | None
    vocab_size: int | None
    entry: dict[str, Any]
    """Its ``get_server_capabilities`` entry (with the recommended RL settings)."""
    tokenizer_dir: Path
    """What ``get_info`` gives clients as the ``tokenizer_id`` to load."""

    @classmethod
    def read(
        cls,
        backend: Backend,
        tokenizer_dir: Path | None = None,
        *,
        tempered_logprobs: bool = True,
        service: str = "local",
    ) -> ModelCard:
        arch: str | None = None
        vocab: int | None = None
        config_file = Path(backend.model_dir) / "config.json"
        if config_file.is_file():
            config = json.loads(config_file.read_text())
            archs = config.get("architectures") or []
            arch = archs[0] if archs else config.get("model_type")
            vocab = config.get("vocab_size")
        vocab = getattr(backend, "vocab_size", None) or vocab
        entry = model_entry(
            backend.model_dir,
            name=backend.model_name,
            max_context=backend.max_context_length,
            tempered_logprobs=tempered_logprobs,
            service=service,
        )
        return cls(
            backend.model_name,
            Path(backend.model_dir),
            backend.max_context_length,
            arch,
            vocab,
            entry,
            tokenizer_dir or Path(backend.model_dir),
        )


class BoundedMap(OrderedDict[Any, str]):
    """Dedupe keys -> ids, forgetting the oldest beyond a fixed size."""

    KEPT = 16384

    def remember(self, key: Any, value: str) -> None:
        self[key] = value
        while len(self) > self.KEPT:
            self.popitem(last=False)


class Core:
    """Shared state and request plumbing of one local server (event-loop only)."""

    def __init__(
        self,
        config: ServerConfig,
        backend: Backend,
        compute: ComputeThread,
        data_dir: Path,
        now: Callable[[], float],
        tokenizer_dir: Path | None = None,
    ) -> None:
        self.config = config
        self.backend = backend
        self.compute = compute
        self.data_dir = data_dir
        self.now = now
        """Wall clock (epoch seconds) for TTLs, heartbeats and timestamps; injectable."""
        self.card = ModelCard.read(
            backend,
            tokenizer_dir,
            tempered_logprobs=config.sampling_logprobs == "tempered",
            service=config.service,
        )
        limits = config.limits
        self.futures = FutureStore(
            max_pending=limits.max_pending_futures, max_retained=limits.max_retained_results
        )
        self.faults = FaultInjector(config.faults)
        self.latency = config.latency
        self.clock = (
            TrainingClock(self.latency.cycle, self.latency.gather) if self.latency else None
        )
        self.stats = Stats()
        self.registry = Registry(now)
        self.stability = StabilityRecords(now, max_records=limits.max_stability_records)
        self.tg: TaskGroup | None = None

    def spawn(self, fn: Callable[..., Any], *args: Any) -> None:
        if self.tg is None:
            raise HttpError(503, "the local server is not running", category="server")
        self.tg.start_soon(fn, *args)

    def ref(self, entry: FutureEntry) -> dict[str, Any]:
        ref: dict[str, Any] = {"request_id": entry.request_id}
        if entry.model_id is not None:
            ref["model_id"] = entry.model_id
        return ref

    def new_future(self, endpoint: str, model_id: str | None = None) -> FutureEntry:
        try:
            return self.futures.create(endpoint, model_id)
        except TooManyPending as exc:
            raise busy(str(exc)) from None

    def failed_future(self, endpoint: str, message: str) -> dict[str, Any]:
        """A future that fails at once (for requests that can never succeed here)."""
        entry = self.new_future(endpoint)
        self.futures.fail(entry, message)
        return self.ref(entry)

    async def finish_job(self, entry: FutureEntry, job: Job) -> dict[str, Any] | None:
        """Run ``job`` on the compute thread; on failure fail the future, return None."""
        try:
            result = await self.compute.run(job.run, entry.endpoint)
            payload = job.finish(result)
        except USER_ERRORS as exc:
            self.futures.fail(entry, str(exc), "user")
            return None
        except ComputeThreadClosed as exc:
            self.futures.fail(entry, str(exc), "server")
            return None
        except Exception as exc:
            log.exception("internal error in %s", entry.endpoint)
            self.futures.fail(
                entry,
                f"internal error in the local server while running {entry.endpoint}: "
                f"{type(exc).__name__}: {exc}",
                "server",
            )
            return None
        self.stats.applied[entry.endpoint] += 1
        return payload

    def resolve_base_model(self, name: str) -> None:
        """Accept the served model's name, its directory and its aliases."""
        accepted = self.accepted_names
        if name in accepted:
            return
        if name.startswith("/") and Path(name).resolve() == self.card.directory.resolve():
            return
        others = sorted(self.config.model_aliases)
        raise WireError(
            f"unknown base_model {name!r}: this local server serves {self.card.name!r}"
            + (f" (also accepted: {', '.join(repr(o) for o in others)})" if others else "")
        )

    @property
    def accepted_names(self) -> set[str]:
        return {
            self.card.name,
            str(self.card.directory),
            str(self.config.model_dir),
            *self.config.model_aliases,
        }


def busy(message: str) -> HttpError:
    return HttpError(429, message, category="server", headers={"Retry-After": "1"})


def raw_field(body: Any, key: str, kind: type) -> Any:
    """A field of the raw body if present with the right type, else None (for routing
    and dedupe before full validation)."""
    if not isinstance(body, dict):
        return None
    value = body.get(key)
    if isinstance(value, bool) or not isinstance(value, kind):
        return None
    return value


def sync_parse(model: Any, body: Any, what: str) -> Any:
    """``parse`` for endpoints that answer directly: a bad body is an HTTP 400."""
    try:
        return parse(model, body, what)
    except WireError as exc:
        raise HttpError(400, str(exc)) from None
