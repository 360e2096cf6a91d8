"""The protocol logic of the local server, independent of HTTP.

``LocalService`` owns the server state (sessions, models, sampling sessions, futures)
and turns each decoded request into backend work: training operations go through the
per-model sequencer (order + exactly-once) and the optional latency clock, sampling goes
through the batcher, and every backend call runs on the one compute thread. The HTTP
layer (``app.py``) only moves JSON in and out and maps ``HttpError`` to responses.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import TaskGroup, TaskStatus

from engine.local.backend import Backend, BackendError, LoraSpec, SampleJob
from engine.local.batcher import (
    PendingSample,
    SampleBatcher,
    SampleOutcome,
    SamplerQueueFull,
    generated_tokens,
)
from engine.local.compute import ComputeThread, ComputeThreadClosed
from engine.local.config import ServerConfig
from engine.local.faults import FaultInjector
from engine.local.futures import FutureEntry, FutureStore, TooManyPending
from engine.local.jobs import (
    Job,
    ModelLimits,
    forward_job,
    load_state_job,
    optim_job,
    save_sampler_job,
    save_state_job,
)
from engine.local.latency import TrainingClock
from engine.local.sequencer import ModelSequencer, SeqRejected
from engine.local.stats import OpCycle, Stats, StatsSnapshot
from engine.local.storage import BadPath, TinkerPath
from engine.local.wire import (
    CreateModelW,
    CreateSamplingSessionW,
    ForwardBackwardW,
    ForwardW,
    LoadWeightsW,
    ModelRefW,
    OptimStepW,
    RetrieveFutureW,
    SampleW,
    SaveForSamplerW,
    SaveWeightsW,
    WeightsInfoW,
    WireError,
    check_token_ids,
    parse,
    sample_json,
    tokens_of,
)

log = logging.getLogger("engine.local")

USER_ERRORS = (BackendError, WireError, BadPath, SeqRejected)
DEDUPE_KEYS_KEPT = 16384


class HttpError(Exception):
    """Answered as an HTTP error status with a JSON body {"error", "category"}."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        category: str = "user",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.category = category
        self.headers = headers or {}


@dataclass
class ModelState:
    model_id: str
    spec: LoraSpec
    seq: ModelSequencer


@dataclass
class SamplerSession:
    sampler_id: str
    key: str | None
    """Backend sampler key; None samples the bare base model."""
    model_path: str | None


@dataclass(frozen=True)
class ModelCard:
    """What the server says about the model it serves."""

    name: str
    directory: Path
    max_context: int
    arch: str | None
    vocab_size: int | None

    @classmethod
    def read(cls, backend: Backend) -> ModelCard:
        arch: str | None = None
        vocab: int | None = None
        config_file = Path(backend.model_dir) / "config.json"
        if config_file.is_file():
            config = json.loads(config_file.read_text())
            archs = config.get("architectures") or []
            arch = archs[0] if archs else config.get("model_type")
            vocab = config.get("vocab_size")
        vocab = getattr(backend, "vocab_size", None) or vocab
        return cls(
            backend.model_name, Path(backend.model_dir), backend.max_context_length, arch, vocab
        )


class _BoundedMap(OrderedDict[Any, str]):
    """Dedupe keys -> ids, forgetting the oldest beyond a fixed size."""

    def remember(self, key: Any, value: str) -> None:
        self[key] = value
        while len(self) > DEDUPE_KEYS_KEPT:
            self.popitem(last=False)


class LocalService:
    """State and request handling of one local server (event-loop only)."""

    def __init__(
        self, config: ServerConfig, backend: Backend, compute: ComputeThread, data_dir: Path
    ) -> None:
        self.config = config
        self.backend = backend
        self.compute = compute
        self.data_dir = data_dir
        self.card = ModelCard.read(backend)
        limits = config.limits
        self.futures = FutureStore(
            max_pending=limits.max_pending_futures, max_retained=limits.max_retained_results
        )
        self.faults = FaultInjector(config.faults)
        self.latency = config.latency
        self.clock = (
            TrainingClock(self.latency.cycle, self.latency.gather) if self.latency else None
        )
        self.batcher = SampleBatcher(
            compute,
            backend.sample,
            max_batch=limits.max_sample_batch,
            max_queued=limits.max_pending_futures,
            window_s=config.sample_batch_window_s,
        )
        self.stats = Stats()
        self.models: dict[str, ModelState] = {}
        self.sessions: _BoundedMap = _BoundedMap()
        self.samplers: dict[str, SamplerSession] = {}
        self._model_requests = _BoundedMap()
        self._sampler_sessions_by_seq = _BoundedMap()
        self._sample_requests = _BoundedMap()
        self._ephemeral: OrderedDict[str, str] = OrderedDict()
        """sampling_session_id -> key of in-memory-only snapshots, oldest first."""
        self._released: _BoundedMap = _BoundedMap()
        self._sampler_keys: dict[str, str] = {}
        """tinker path -> backend sampler key, for checkpoints loaded or saved here."""
        self._accepted_names = {
            self.card.name,
            str(self.card.directory),
            str(config.model_dir),
            *config.model_aliases,
        }
        self._tg: TaskGroup | None = None

    # ---- lifecycle ------------------------------------------------------------------

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Run the sampler loop, the latency clock and every queued operation until
        cancelled. Operations are tasks of this task group, so none outlives the server."""
        async with anyio.create_task_group() as tg:
            self._tg = tg
            tg.start_soon(self.batcher.run)
            if self.clock is not None:
                tg.start_soon(self.clock.run)
            task_status.started()
            await anyio.sleep_forever()

    def close(self) -> None:
        """Release held long-polls so the HTTP server can stop at once."""
        self.futures.close()

    def snapshot(self) -> StatsSnapshot:
        s = self.stats
        return StatsSnapshot(
            requests=dict(s.requests),
            applied=dict(s.applied),
            optimizer_steps=dict(s.optimizer_steps),
            dedupe_hits=dict(s.dedupe_hits),
            faults_injected=dict(self.faults.injected),
            sample_batches=self.batcher.batches,
            sample_requests=self.batcher.requests,
            largest_sample_batch=self.batcher.largest_batch,
            cycles_started=self.clock.started if self.clock else 0,
            op_cycles={m: list(ops) for m, ops in s.op_cycles.items()},
            seq_gap_timeouts=sum(m.seq.gap_timeouts for m in self.models.values()),
            futures_pending=self.futures.pending,
            futures_retained=self.futures.retained,
            polls_held=self.futures.held,
            compute_busy_s=self.compute.busy_s,
            models=len(self.models),
            sampling_sessions=len(self.samplers),
        )

    def _spawn(self, fn: Callable[..., Any], *args: Any) -> None:
        if self._tg is None:
            raise HttpError(503, "the local server is not running", category="server")
        self._tg.start_soon(fn, *args)

    # ---- session & discovery endpoints ------------------------------------------------

    def client_config(self) -> dict[str, Any]:
        return {
            "pjwt_auth_enabled": True,
            "credential_default_source": "api_key",
            "parallel_fwdbwd_chunks": False,
            "use_pyqwest_transport": False,
            "proto_write_fwdbwd": False,
            "sample_no_retries": False,
        }

    def create_session(self, body: Any) -> dict[str, Any]:
        session_id = f"session-{uuid.uuid4().hex}"
        self.sessions.remember(session_id, session_id)
        return {"type": "create_session", "session_id": session_id}

    def capabilities(self) -> dict[str, Any]:
        return {
            "supported_models": [
                {"model_name": self.card.name, "max_context_length": self.card.max_context}
            ]
        }

    def resolve_base_model(self, name: str) -> None:
        if name in self._accepted_names:
            return
        if name.startswith("/") and Path(name).resolve() == self.card.directory.resolve():
            return
        others = sorted(self.config.model_aliases)
        raise WireError(
            f"unknown base_model {name!r}: this local server serves {self.card.name!r}"
            + (f" (also accepted: {', '.join(repr(o) for o in others)})" if others else "")
        )

    def get_info(self, body: Any) -> dict[str, Any]:
        req = _sync_parse(ModelRefW, body, "get_info")
        model = self._model_or_404(req.model_id)
        return {
            "type": "get_info",
            "model_id": model.model_id,
            "model_data": {
                "arch": self.card.arch,
                "model_name": self.card.name,
                "tokenizer_id": str(self.card.directory),
            },
            "is_lora": True,
            "lora_rank": model.spec.rank,
            "model_name": self.card.name,
        }

    def _model_or_404(self, model_id: str) -> ModelState:
        model = self.models.get(model_id)
        if model is None:
            raise HttpError(404, _unknown_model(model_id))
        return model

    # ---- futures --------------------------------------------------------------------

    def _ref(self, entry: FutureEntry) -> dict[str, Any]:
        ref: dict[str, Any] = {"request_id": entry.request_id}
        if entry.model_id is not None:
            ref["model_id"] = entry.model_id
        return ref

    def _new_future(self, endpoint: str, model_id: str | None = None) -> FutureEntry:
        try:
            return self.futures.create(endpoint, model_id)
        except TooManyPending as exc:
            raise _busy(str(exc)) from None

    def failed_future(self, endpoint: str, message: str) -> dict[str, Any]:
        """A future that fails at once (for requests that can never succeed here)."""
        entry = self._new_future(endpoint)
        self.futures.fail(entry, message)
        return self._ref(entry)

    async def retrieve_future(self, body: Any) -> dict[str, Any]:
        req = _sync_parse(RetrieveFutureW, body, "retrieve_future")
        entry = self.futures.get(req.request_id)
        if entry is None:
            raise HttpError(
                410,
                f"request {req.request_id!r} is unknown or its result has expired (results "
                "are kept in memory only; a restarted server has none)",
                category="server",
            )
        if self.faults.poll_fault(entry.endpoint):
            raise HttpError(
                410, "injected fault: this future expired (fault injection)", category="server"
            )
        payload = await self.futures.wait(entry, self.config.long_poll_s)
        if payload is None:
            return {"type": "try_again", "request_id": entry.request_id, "queue_state": "active"}
        return payload

    async def _finish_job(self, entry: FutureEntry, job: Job) -> dict[str, Any] | None:
        """Run ``job`` on the compute thread; on failure fail the future, return None."""
        try:
            result = await self.compute.run(job.run)
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

    # ---- models -----------------------------------------------------------------------

    def create_model(self, body: Any) -> dict[str, Any]:
        session_id, model_seq_id = _raw(body, "session_id", str), _raw(body, "model_seq_id", int)
        dedupe_key = (session_id, model_seq_id)
        if session_id is not None and model_seq_id is not None:
            existing = self._model_requests.get(dedupe_key)
            if existing is not None and self.futures.get(existing) is not None:
                self.stats.dedupe_hits["create_model"] += 1
                return {"request_id": existing}
        entry = self._new_future("create_model")
        if session_id is not None and model_seq_id is not None:
            self._model_requests.remember(dedupe_key, entry.request_id)
        try:
            req = parse(CreateModelW, body, "create_model")
            self.resolve_base_model(req.base_model)
            lora = req.lora_config
            if lora is None:
                raise WireError("create_model needs a lora_config (the local server trains LoRA)")
            if not 1 <= lora.rank <= self.config.limits.max_lora_rank:
                raise WireError(
                    f"lora_config.rank must be in 1..{self.config.limits.max_lora_rank}, "
                    f"got {lora.rank}"
                )
            spec = LoraSpec(
                rank=lora.rank,
                seed=lora.seed,
                train_mlp=lora.train_mlp,
                train_attn=lora.train_attn,
                train_unembed=lora.train_unembed,
            )
        except USER_ERRORS as exc:
            self.futures.fail(entry, str(exc))
            return self._ref(entry)
        if self.faults.submit_fault("create_model"):
            self.futures.fail(entry, _INJECTED_FAIL, "server")
            return self._ref(entry)
        self._spawn(self._run_create_model, entry, spec)
        return self._ref(entry)

    async def _run_create_model(self, entry: FutureEntry, spec: LoraSpec) -> None:
        model_id = f"model-{uuid.uuid4().hex}"

        def finish(_: None) -> dict[str, Any]:
            seq = ModelSequencer(
                gap_timeout=self.config.seq_gap_timeout_s,
                dedupe_window=self.config.limits.dedupe_window,
                max_seq_gap=self.config.limits.max_seq_gap,
            )
            self.models[model_id] = ModelState(model_id, spec, seq)
            return {"model_id": model_id, "type": "create_model"}

        job = Job(run=lambda: self.backend.create_model(model_id, spec), finish=finish)
        payload = await self._finish_job(entry, job)
        if payload is not None:
            self.futures.resolve(entry, payload)

    # ---- training operations ----------------------------------------------------------

    def submit_training(self, endpoint: str, body: Any, digest: str = "") -> dict[str, Any]:
        """Accept one training operation: dedupe on (model_id, seq_id), build its job
        (bad input fails the future but still takes the seq_id's turn, so later
        operations of the model are not blocked), and queue it in seq order.

        ``digest`` fingerprints the request body: a resubmission carries the same one.
        The same seq_id with a different body is not a retry but a second client
        numbering from 1 again; it is refused rather than answered with a stale result."""
        model_id, seq_id = _raw(body, "model_id", str), _raw(body, "seq_id", int)
        if model_id is None:
            raise HttpError(400, f"invalid {endpoint} request: model_id (a string) is required")
        if isinstance(body, dict) and _RESUBMISSION_VOLATILE & body.keys():
            digest = _fingerprint(body)
        model = self.models.get(model_id)
        if model is None:
            return self.failed_future(endpoint, _unknown_model(model_id))
        if seq_id is None or seq_id < 1:
            return self.failed_future(
                endpoint,
                f"invalid {endpoint} request: seq_id (an integer >= 1) is required; it orders "
                "a model's operations",
            )
        existing = model.seq.lookup(seq_id)
        if existing is not None:
            request_id, earlier_digest = existing
            if earlier_digest != digest:
                return self.failed_future(
                    endpoint,
                    f"seq_id {seq_id} of model {model_id} was already used by a different "
                    "request; seq_ids number one training client's operations, so a second "
                    "client for the same model cannot start again at 1 (create a new training "
                    "client, e.g. with create_training_client_from_state)",
                )
            self.stats.dedupe_hits[endpoint] += 1
            return {"request_id": request_id, "model_id": model_id}
        if model.seq.queued >= self.config.limits.max_pending_per_model:
            raise HttpError(
                429,
                f"model {model_id} already has {model.seq.queued} queued operations; retry later",
                category="server",
                headers={"Retry-After": "1"},
            )
        entry = self._new_future(endpoint, model_id)
        try:
            model.seq.claim(seq_id, entry.request_id, digest)
        except SeqRejected as exc:
            self.futures.fail(entry, str(exc))
            return self._ref(entry)
        job: Job | None
        try:
            job = self._build_training_job(endpoint, model, body)
        except USER_ERRORS as exc:
            self.futures.fail(entry, str(exc))
            job = None
        if job is not None and self.faults.submit_fault(endpoint):
            self.futures.fail(entry, _INJECTED_FAIL, "server")
            job = None
        cycle = self.clock.assign() if (self.clock is not None and job is not None) else None
        self._spawn(self._run_training, model, seq_id, entry, job, cycle)
        return self._ref(entry)

    def _build_training_job(self, endpoint: str, model: ModelState, body: Any) -> Job:
        limits = ModelLimits(
            vocab_size=self.card.vocab_size,
            max_context=self.card.max_context,
            max_datums=self.config.limits.max_datums,
            max_tokens=self.config.limits.max_request_tokens,
        )
        mid = model.model_id
        if endpoint == "forward_backward":
            fb = parse(ForwardBackwardW, body, endpoint)
            return forward_job(self.backend, mid, fb.forward_backward_input, limits, backward=True)
        if endpoint == "forward":
            fw = parse(ForwardW, body, endpoint)
            return forward_job(self.backend, mid, fw.forward_input, limits, backward=False)
        if endpoint == "optim_step":
            opt = parse(OptimStepW, body, endpoint)

            def count_step() -> None:
                self.stats.optimizer_steps[mid] += 1

            return optim_job(self.backend, mid, opt.adam_params, count_step)
        if endpoint == "save_weights":
            sw = parse(SaveWeightsW, body, endpoint)
            return save_state_job(self.backend, mid, sw.path, self.data_dir, overwrite=sw.overwrite)
        if endpoint == "save_weights_for_sampler":
            ss = parse(SaveForSamplerW, body, endpoint)
            if ss.path is None and ss.sampling_session_seq_id is None:
                raise WireError(
                    "save_weights_for_sampler needs a name in 'path' or a sampling_session_seq_id"
                )
            return save_sampler_job(
                self.backend,
                mid,
                ss.path,
                self.data_dir,
                on_saved=self._on_sampler_saved,
                snapshot_delay=self.latency.snapshot if self.latency else 0.0,
            )
        if endpoint == "load_weights":
            lw = parse(LoadWeightsW, body, endpoint)
            return load_state_job(self.backend, mid, lw.path, self.data_dir, optimizer=lw.optimizer)
        raise AssertionError(f"not a training endpoint: {endpoint}")

    def _on_sampler_saved(self, key: str, path: TinkerPath | None) -> str | None:
        if path is not None:
            self._sampler_keys[str(path)] = key
            return None
        sampler_id = self._new_sampler_session(key, None)
        self._ephemeral[sampler_id] = key
        while len(self._ephemeral) > self.config.limits.max_ephemeral_samplers:
            old_id, old_key = self._ephemeral.popitem(last=False)
            self.samplers.pop(old_id, None)
            self._released.remember(old_id, old_key)
            self._spawn(self._release_sampler, old_key)
        return sampler_id

    async def _release_sampler(self, key: str) -> None:
        await self.compute.run(lambda: self.backend.release_sampler(key))

    async def _run_training(
        self,
        model: ModelState,
        seq_id: int,
        entry: FutureEntry,
        job: Job | None,
        cycle: int | None,
    ) -> None:
        payload: dict[str, Any] | None = None
        try:
            async with model.seq.turn(seq_id):
                if job is None:
                    return  # already failed; its turn only keeps the order
                if cycle is not None and self.clock is not None:
                    await self.clock.wait_start(cycle)
                    self.stats.record_cycle(model.model_id, OpCycle(seq_id, entry.endpoint, cycle))
                payload = await self._finish_job(entry, job)
        except SeqRejected as exc:
            self.futures.fail(entry, str(exc))
            return
        if payload is None:
            return
        if cycle is not None and self.clock is not None:
            await self.clock.wait_end(cycle)
        if job.extra_delay > 0:
            await anyio.sleep(job.extra_delay)
        self.futures.resolve(entry, payload)

    # ---- checkpoints & sampling sessions ------------------------------------------------

    def _checkpoint_dir(self, path: str) -> tuple[TinkerPath, Path]:
        try:
            parsed = TinkerPath.parse(path)
        except BadPath as exc:
            raise HttpError(400, str(exc)) from None
        directory = parsed.directory(self.data_dir)
        if not directory.is_dir():
            raise HttpError(404, f"checkpoint {parsed} not found (looked in {directory})")
        return parsed, directory

    async def weights_info(self, body: Any) -> dict[str, Any]:
        req = _sync_parse(WeightsInfoW, body, "weights_info")
        _, directory = self._checkpoint_dir(req.tinker_path)
        try:
            info = await self.compute.run(lambda: Backend.read_state_info(directory))
        except BackendError as exc:
            raise HttpError(400, str(exc)) from None
        answer = {"base_model": self.card.name, "is_lora": True}
        answer.update({k: v for k, v in info.items() if _is_json_scalar(v)})
        return answer

    async def create_sampling_session(self, body: Any) -> dict[str, Any]:
        req = _sync_parse(CreateSamplingSessionW, body, "create_sampling_session")
        dedupe_key = (req.session_id, req.sampling_session_seq_id)
        existing = self._sampler_sessions_by_seq.get(dedupe_key)
        if existing is None:
            key = await self._sampler_key(req.model_path, req.base_model)
            existing = self._sampler_sessions_by_seq.get(dedupe_key)  # a concurrent retry?
            if existing is None:
                existing = self._new_sampler_session(key, req.model_path)
                self._sampler_sessions_by_seq.remember(dedupe_key, existing)
        else:
            self.stats.dedupe_hits["create_sampling_session"] += 1
        return {"type": "create_sampling_session", "sampling_session_id": existing}

    async def _sampler_key(self, model_path: str | None, base_model: str | None) -> str | None:
        if model_path is None:
            if base_model is None:
                raise HttpError(400, "create_sampling_session needs a model_path or a base_model")
            try:
                self.resolve_base_model(base_model)
            except WireError as exc:
                raise HttpError(400, str(exc)) from None
            return None
        parsed, directory = self._checkpoint_dir(model_path)
        cached = self._sampler_keys.get(str(parsed))
        if cached is not None:
            return cached
        try:
            key = await self.compute.run(lambda: self.backend.load_sampler(directory))
        except BackendError as exc:
            raise HttpError(400, f"cannot load {parsed}: {exc}") from None
        self._sampler_keys[str(parsed)] = key
        return key

    def _new_sampler_session(self, key: str | None, model_path: str | None) -> str:
        sampler_id = f"sampler-{uuid.uuid4().hex}"
        self.samplers[sampler_id] = SamplerSession(sampler_id, key, model_path)
        return sampler_id

    def get_sampler(self, sampler_id: str) -> dict[str, Any]:
        session = self.samplers.get(sampler_id)
        if session is None:
            raise HttpError(
                404,
                f"unknown sampler {sampler_id!r} (sampling sessions do not survive a server "
                "restart; create a new sampling client)",
            )
        answer: dict[str, Any] = {
            "sampler_id": sampler_id,
            "base_model": sampler_base_model(self.card.directory),
        }
        if session.model_path is not None:
            answer["model_path"] = session.model_path
        return answer

    # ---- sampling -------------------------------------------------------------------

    def asample(self, body: Any, digest: str = "") -> dict[str, Any]:
        """Queue one sample request for the batcher. A resubmission (same session,
        seq_id and body) gets the original future; a different body under the same
        seq_id (another client object on the same session) is a new request."""
        session_id, seq_id = _raw(body, "sampling_session_id", str), _raw(body, "seq_id", int)
        dedupe_key = (session_id, seq_id, digest)
        if session_id is not None and seq_id is not None:
            existing = self._sample_requests.get(dedupe_key)
            if existing is not None and self.futures.get(existing) is not None:
                self.stats.dedupe_hits["asample"] += 1
                return {"request_id": existing}
        entry = self._new_future("asample")
        try:
            job = self._sample_job(parse(SampleW, body, "asample"))
        except USER_ERRORS as exc:
            self.futures.fail(entry, str(exc))
            return self._ref(entry)
        if self.faults.submit_fault("asample"):
            self.futures.fail(entry, _INJECTED_FAIL, "server")
            return self._ref(entry)
        deliver = functools.partial(self._deliver_sample, entry, anyio.current_time())
        try:
            self.batcher.submit(PendingSample(job, deliver))
        except SamplerQueueFull as exc:
            self.futures.discard(entry)
            raise _busy(str(exc)) from None
        if session_id is not None and seq_id is not None:
            self._sample_requests.remember(dedupe_key, entry.request_id)
        return self._ref(entry)

    def _sample_job(self, req: SampleW) -> SampleJob:
        if req.sampling_session_id is not None:
            session = self.samplers.get(req.sampling_session_id)
            if session is None and req.sampling_session_id in self._released:
                raise WireError(
                    f"sampling session {req.sampling_session_id!r} was released: the local "
                    f"server keeps only the {self.config.limits.max_ephemeral_samplers} most "
                    "recent save_weights_and_get_sampling_client snapshots in memory (use "
                    "save_weights_for_sampler for snapshots you sample from for longer)"
                )
            if session is None:
                raise WireError(
                    f"unknown sampling_session_id {req.sampling_session_id!r} (sampling "
                    "sessions do not survive a server restart; create a new sampling client)"
                )
            key = session.key
        elif req.model_path is not None:
            key = self._sampler_keys.get(req.model_path)
            if key is None:
                raise WireError(
                    f"model_path {req.model_path!r} is not loaded: create a sampling client "
                    "for it first"
                )
        elif req.base_model is not None:
            self.resolve_base_model(req.base_model)
            key = None
        else:
            raise WireError("asample needs a sampling_session_id, model_path or base_model")
        limits = self.config.limits
        prompt = tokens_of(req.prompt, "prompt")
        if not prompt:
            raise WireError("prompt must contain at least one token")
        check_token_ids(prompt, self.card.vocab_size, "prompt")
        params = req.sampling_params
        if params.max_tokens is None or params.max_tokens < 1:
            raise WireError("sampling_params.max_tokens must be set to an integer >= 1")
        if len(prompt) + params.max_tokens > self.card.max_context:
            raise WireError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"model's max_context_length {self.card.max_context}"
            )
        if not 1 <= req.num_samples <= limits.max_num_samples:
            raise WireError(
                f"num_samples must be in 1..{limits.max_num_samples}, got {req.num_samples}"
            )
        if not 0 <= req.topk_prompt_logprobs <= limits.max_topk_prompt_logprobs:
            raise WireError(
                f"topk_prompt_logprobs must be in 0..{limits.max_topk_prompt_logprobs}, "
                f"got {req.topk_prompt_logprobs}"
            )
        if params.temperature < 0:
            raise WireError(f"sampling_params.temperature must be >= 0, got {params.temperature}")
        if not 0 < params.top_p <= 1:
            raise WireError(f"sampling_params.top_p must be in (0, 1], got {params.top_p}")
        stop = params.stop
        stop_strings = [stop] if isinstance(stop, str) else []
        stop_ids: list[int] = []
        if isinstance(stop, list):
            stop_strings = [s for s in stop if isinstance(s, str)]
            stop_ids = [s for s in stop if isinstance(s, int)]
        return SampleJob(
            sampler=key,
            prompt=prompt,
            num_samples=req.num_samples,
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            seed=params.seed,
            stop_strings=stop_strings,
            stop_token_ids=stop_ids,
            prompt_logprobs=bool(req.prompt_logprobs) or req.topk_prompt_logprobs > 0,
            topk_prompt_logprobs=req.topk_prompt_logprobs,
        )

    def _deliver_sample(self, entry: FutureEntry, submitted: float, outcome: SampleOutcome) -> None:
        if isinstance(outcome, Exception):
            if isinstance(outcome, USER_ERRORS):
                self.futures.fail(entry, str(outcome), "user")
            else:
                if not isinstance(outcome, ComputeThreadClosed):
                    log.error("sampling failed", exc_info=outcome)
                self.futures.fail(
                    entry,
                    f"internal error in the local server while sampling: "
                    f"{type(outcome).__name__}: {outcome}",
                    "server",
                )
            return
        try:
            payload = sample_json(outcome)
        except ValueError as exc:
            self.futures.fail(entry, f"sampling produced an invalid result: {exc}", "server")
            return
        self.stats.applied["asample"] += 1
        if self.latency is not None:
            due = submitted + self.latency.sample_time(generated_tokens(outcome))
            if due > anyio.current_time():
                self._spawn(self._resolve_at, entry, payload, due)
                return
        self.futures.resolve(entry, payload)

    async def _resolve_at(self, entry: FutureEntry, payload: dict[str, Any], due: float) -> None:
        await anyio.sleep_until(due)
        self.futures.resolve(entry, payload)


_INJECTED_FAIL = "injected fault: the server failed this request (fault injection)"


def sampler_base_model(directory: Path) -> str:
    """The model directory as the base_model a SamplingClient turns into a tokenizer id:
    the client cuts a name with exactly two '/' to "org/model", so such a path gets a
    harmless "/./" to keep it intact (e.g. "/models/tiny" -> "/models/./tiny")."""
    text = str(directory)
    if text.count("/") == 2:
        text = f"{directory.parent}/./{directory.name}"
    return text


def _busy(message: str) -> HttpError:
    return HttpError(429, message, category="server", headers={"Retry-After": "1"})


def _unknown_model(model_id: str) -> str:
    return (
        f"unknown model_id {model_id!r} (training clients do not survive a server restart; "
        "create one again, e.g. with create_training_client_from_state)"
    )


def _raw(body: Any, key: str, kind: type) -> Any:
    """A field of the raw body if present with the right type, else None (for routing
    and dedupe before full validation)."""
    if not isinstance(body, dict):
        return None
    value = body.get(key)
    if isinstance(value, bool) or not isinstance(value, kind):
        return None
    return value


def _sync_parse(model: Any, body: Any, what: str) -> Any:
    try:
        return parse(model, body, what)
    except WireError as exc:
        raise HttpError(400, str(exc)) from None


def _is_json_scalar(value: Any) -> bool:
    return value is None or isinstance(value, str | int | float | bool)


# Fields the SDK draws anew when it resubmits one operation under the same seq_id (an
# ephemeral save_weights_for_sampler gets a fresh sampling_session_seq_id per attempt):
# they must not make a resubmission look like a different request.
_RESUBMISSION_VOLATILE = frozenset({"sampling_session_seq_id"})


def _fingerprint(body: dict[str, Any]) -> str:
    """A digest of ``body`` without its resubmission-volatile fields."""
    stable = {k: v for k, v in body.items() if k not in _RESUBMISSION_VOLATILE}
    canonical = json.dumps(stable, sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(canonical.encode(), digest_size=16).hexdigest()
