"""Sampling: sampling sessions (from a base model, a saved checkpoint or an in-memory
snapshot), asample through the batcher, and the one place sample requests are checked."""

from __future__ import annotations

import functools
import math
import uuid
from collections.abc import Callable
from typing import Any

import anyio

from engine.common.protocol import MAX_SEED
from engine.local.compute.backend_types import BackendError, SampledSequences, SampleJob
from engine.local.compute.thread import ComputeThreadClosed
from engine.local.config import Limits
from engine.local.http.wire import (
    CreateSamplingSessionW,
    SampleW,
    WireError,
    check_token_ids,
    parse,
    sample_json,
    tokens_of,
)
from engine.local.models.storage import TinkerPath
from engine.local.operations.batcher import (
    PendingSample,
    SampleBatcher,
    SampleOutcome,
    SamplerQueueFull,
    generated_tokens,
)
from engine.local.operations.checkpoints import CheckpointStore
from engine.local.operations.core import (
    INJECTED_FAIL,
    USER_ERRORS,
    BoundedMap,
    Core,
    HttpError,
    ModelCard,
    busy,
    log,
    raw_field,
    sync_parse,
)
from engine.local.operations.futures import FutureEntry
from engine.local.operations.registry import ModelState, SamplerSession
from engine.local.operations.resources import Resources
from engine.local.operations.sampling_gate import QueueFull, SamplingGate


class SamplingOps:
    def __init__(self, core: Core, checkpoints: CheckpointStore, resources: Resources) -> None:
        self.core = core
        self.checkpoints = checkpoints
        self.resources = resources
        config = core.config
        slots = config.slots
        self.batcher = SampleBatcher(
            core.compute,
            core.backend.sample,
            max_batch=config.limits.max_sample_batch,
            # with slots, only the requests holding one reach the batcher
            max_queued=config.limits.max_pending_futures if slots is None else slots,
            window_s=config.sample_batch_window_s,
            apart=core.backend.samples_apart,
        )
        self.gate = SamplingGate(
            slots, config.limits.max_queued_samples, max_retry_after_s=config.long_poll_s
        )
        self._sessions_by_seq = BoundedMap()
        self._sample_requests = BoundedMap()

    # ---- sampling sessions ----------------------------------------------------------------

    async def create_session(self, body: Any) -> dict[str, Any]:
        core = self.core
        req = sync_parse(CreateSamplingSessionW, body, "create_sampling_session")
        dedupe_key = (req.session_id, req.sampling_session_seq_id)
        existing = self._sessions_by_seq.get(dedupe_key)
        if existing is None:
            key, base_model = await self._sampler_key(req.model_path, req.base_model)
            existing = self._sessions_by_seq.get(dedupe_key)  # a concurrent retry?
            if existing is None:
                existing = self._new_session(
                    key, req.model_path, base_model, req.session_id, ephemeral=False
                )
                self._sessions_by_seq.remember(dedupe_key, existing)
        else:
            core.stats.dedupe_hits["create_sampling_session"] += 1
        return {"type": "create_sampling_session", "sampling_session_id": existing}

    async def _sampler_key(
        self, model_path: str | None, base_model: str | None
    ) -> tuple[str | None, str]:
        """The backend key to sample with and the base model name to report."""
        core = self.core
        if model_path is None:
            if base_model is None:
                raise HttpError(400, "create_sampling_session needs a model_path or a base_model")
            try:
                core.resolve_base_model(base_model)
            except WireError as exc:
                raise HttpError(400, str(exc)) from None
            return None, base_model
        parsed, _ = self.checkpoints.find(model_path)
        name = self._base_model_of(parsed)
        cached = core.registry.sampler_keys.get(str(parsed))
        if cached is not None:
            return cached, name
        self.resources.room_for_checkpoint_snapshot()
        directory = parsed.directory(core.data_dir)
        try:
            with self.checkpoints.reading(parsed):
                key = await core.compute.run(lambda: core.backend.load_sampler(directory))
        except BackendError as exc:
            raise HttpError(400, f"cannot load {parsed}: {exc}") from None
        core.registry.sampler_keys[str(parsed)] = key
        core.registry.add_snapshot(key, parsed.model_id, saved=False)
        await self.resources.enforce_memory(frozenset({key}))
        return key, name

    def _base_model_of(self, path: TinkerPath) -> str:
        """The base model name the checkpoint's training run was created with."""
        model = self.core.registry.models.get(path.model_id)
        if model is not None:
            return model.base_model
        record = self.checkpoints.run_record(path.model_id) or {}
        name = record.get("base_model")
        return name if isinstance(name, str) and name else self.core.card.name

    def _new_session(
        self,
        key: str | None,
        model_path: str | None,
        base_model: str,
        session_id: str | None,
        *,
        ephemeral: bool,
    ) -> str:
        sampler_id = f"sampler-{uuid.uuid4().hex}"
        self.core.registry.add_sampler(
            SamplerSession(
                sampler_id, key, model_path, base_model, session_id, ephemeral, self.core.now()
            )
        )
        return sampler_id

    def on_sampler_saved(self, key: str, path: TinkerPath | None, model: ModelState) -> str | None:
        """A training client saved a sampler snapshot (now its newest): a named one is
        cached by path; an ephemeral one becomes a new sampling session. Beyond a bound,
        older snapshots no live client samples from are released."""
        registry = self.core.registry
        registry.add_snapshot(key, model.model_id, saved=True)
        self.core.spawn(self.resources.enforce_memory, frozenset({key}))
        if path is not None:
            registry.sampler_keys[str(path)] = key
            self.resources.limit_snapshots(protect=frozenset({key}))
            return None
        sampler_id = self._new_session(
            key, None, model.base_model, model.session_id, ephemeral=True
        )
        self.resources.limit_ephemeral()
        return sampler_id

    def get_sampler(self, sampler_id: str) -> dict[str, Any]:
        session = self.core.registry.samplers.get(sampler_id)
        if session is None:
            raise HttpError(404, self._unknown_session(sampler_id))
        answer: dict[str, Any] = {"sampler_id": sampler_id, "base_model": session.base_model}
        if session.model_path is not None:
            answer["model_path"] = session.model_path
        return answer

    def _unknown_session(self, sampler_id: str) -> str:
        why = self.core.registry.why_released(sampler_id)
        if why is not None:
            return f"sampling session {sampler_id!r} was released: {why}"
        return (
            f"unknown sampling_session_id {sampler_id!r} (sampling sessions do not survive a "
            "server restart; create a new sampling client)"
        )

    # ---- asample --------------------------------------------------------------------------

    def asample(
        self, body: Any, digest: str = "", backpressure: str | None = None
    ) -> dict[str, Any]:
        """Queue one sample request for the batcher, through the sampling slots
        (``engine.local.operations.sampling_gate``; ``backpressure``: the value of the request's
        X-Tinker-Sampling-Backpressure header). A resubmission (same session, seq_id and
        body) gets the original future; a different body under the same seq_id (another
        client object on the same session) is a new request."""
        core = self.core
        session_id = raw_field(body, "sampling_session_id", str)
        seq_id = raw_field(body, "seq_id", int)
        dedupe_key = (session_id, seq_id, digest)
        if session_id is not None and seq_id is not None:
            existing = self._sample_requests.get(dedupe_key)
            if existing is not None and core.futures.get(existing) is not None:
                core.stats.dedupe_hits["asample"] += 1
                return sample_ref({"request_id": existing}, body)
        entry = core.new_future("asample")
        try:
            req = parse(SampleW, body, "asample")
            job = sample_job_of(
                req,
                self._sampler_of(req),
                core.card,
                core.config.limits,
                tempered=core.config.sampling_logprobs == "tempered",
            )
        except USER_ERRORS as exc:
            core.futures.fail(entry, str(exc))
            return core.ref(entry)
        if core.faults.submit_fault("asample"):
            core.futures.fail(entry, INJECTED_FAIL, "server")
            return core.ref(entry)
        recorder = self._recorder(entry, req) if req.record_stability_info else None
        deliver = functools.partial(
            self._deliver,
            entry,
            req.prompt_logprobs_last_n,
            job.sampler,
            recorder,
        )
        try:
            self.gate.admit(
                entry.request_id,
                functools.partial(self.batcher.submit, PendingSample(job, deliver)),
                backpressure=backpressure == "1",
            )
        except (SamplerQueueFull, QueueFull) as exc:
            core.futures.discard(entry)
            raise busy(str(exc)) from None
        if job.sampler is not None:
            core.registry.sampling_started(job.sampler)
        if session_id is not None and seq_id is not None:
            self._sample_requests.remember(dedupe_key, entry.request_id)
        return sample_ref(core.ref(entry), body)

    def _sampler_of(self, req: SampleW) -> str | None:
        """The backend key the request samples with (None: the bare base model)."""
        registry = self.core.registry
        if req.sampling_session_id is not None:
            session = registry.samplers.get(req.sampling_session_id)
            if session is None:
                raise WireError(self._unknown_session(req.sampling_session_id))
            registry.touch(session)
            return session.key
        if req.model_path is not None:
            key = registry.sampler_keys.get(req.model_path)
            if key is None:
                raise WireError(
                    f"model_path {req.model_path!r} is not loaded: create a sampling client "
                    "for it first"
                )
            return key
        if req.base_model is not None:
            self.core.resolve_base_model(req.base_model)
            return None
        raise WireError("asample needs a sampling_session_id, model_path or base_model")

    def _deliver(
        self,
        entry: FutureEntry,
        last_n: int | None,
        sampler: str | None,
        recorder: Callable[[SampledSequences], None] | None,
        outcome: SampleOutcome,
    ) -> None:
        core = self.core
        if sampler is not None:
            self.resources.sampling_ended(sampler)
        if isinstance(outcome, Exception):
            self.gate.release(entry.request_id)
            if isinstance(outcome, USER_ERRORS):
                core.futures.fail(entry, str(outcome), "user")
            else:
                if not isinstance(outcome, ComputeThreadClosed):
                    log.error("sampling failed", exc_info=outcome)
                core.futures.fail(
                    entry,
                    f"internal error in the local server while sampling: "
                    f"{type(outcome).__name__}: {outcome}",
                    "server",
                )
            return
        try:
            payload = keep_last_prompt_logprobs(sample_json(outcome), last_n)
        except ValueError as exc:
            self.gate.release(entry.request_id)
            core.futures.fail(entry, f"sampling produced an invalid result: {exc}", "server")
            return
        if recorder is not None:
            recorder(outcome)
        core.stats.applied["asample"] += 1
        started = self.gate.started_at(entry.request_id)
        if core.latency is not None and started is not None:
            # simulated from when it got its sampling slot
            due = started + core.latency.sample_time(generated_tokens(outcome))
            if due > anyio.current_time():
                core.spawn(self._resolve_at, entry, payload, due)
                return
        self.gate.release(entry.request_id)
        core.futures.resolve(entry, payload)

    def _recorder(self, entry: FutureEntry, req: SampleW) -> Callable[[SampledSequences], None]:
        """Records a finished request's sequences under the ids its promise announced
        (``sample_ref``), for the session that sampled them."""
        session = self.core.registry.samplers.get(req.sampling_session_id or "")
        session_id = session.session_id if session is not None else None

        def record(outcome: SampledSequences) -> None:
            for i, seq in enumerate(outcome.sequences):
                behaviour = seq.behaviour_logprobs or seq.logprobs  # what was sampled from
                self.core.stability.record(
                    session_id, sequence_id(entry.request_id, i), seq.tokens, behaviour
                )

        return record

    async def _resolve_at(self, entry: FutureEntry, payload: dict[str, Any], due: float) -> None:
        await anyio.sleep_until(due)
        self.gate.release(entry.request_id)
        self.core.futures.resolve(entry, payload)


def sample_ref(ref: dict[str, Any], body: Any) -> dict[str, Any]:
    """An asample future with one sequence id per requested sample (tinker >= 0.38 stamps
    them on the sequences; older clients ignore the key). Derived from the request id,
    so a resubmission's answer carries the same ids."""
    count = raw_field(body, "num_samples", int)
    count = 1 if count is None else count
    if 1 <= count <= 1 << 16:
        ref["sample_sequence_ids"] = [sequence_id(ref["request_id"], i) for i in range(count)]
    return ref


def sequence_id(request_id: str, index: int) -> str:
    """The ``sequence_id`` of sample ``index`` of asample request ``request_id``."""
    return f"{request_id}-{index}"


def keep_last_prompt_logprobs(payload: dict[str, Any], last_n: int | None) -> dict[str, Any]:
    """``prompt_logprobs_last_n``: only the last N prompt positions keep their logprobs
    (and top-k rows); earlier ones read as not computed."""
    if last_n is None:
        return payload
    for key in ("prompt_logprobs", "topk_prompt_logprobs"):
        values = payload.get(key)
        if values is not None:
            cut = max(0, len(values) - last_n)
            payload[key] = [None] * cut + values[cut:]
    return payload


_UNSUPPORTED_SAMPLE_OPTIONS = {
    "topk_sample_logprobs": "top-k logprobs of the sampled tokens",
    "target_prompt_logprobs": "logprobs of chosen target tokens at prompt positions",
    "prompt_alt_tokens_k": "alternative-token draws at prompt positions",
}


def _check_supported_options(req: SampleW) -> None:
    for field, what in _UNSUPPORTED_SAMPLE_OPTIONS.items():
        if getattr(req, field):
            raise WireError(
                f"{field} ({what}) is not supported by the local server; leave it unset"
            )


def sample_job_of(
    req: SampleW, sampler: str | None, card: ModelCard, limits: Limits, *, tempered: bool = True
) -> SampleJob:
    """The backend job for one asample request: every check of a sample request lives
    here (the backend trusts the jobs it gets)."""
    _check_supported_options(req)
    prompt = tokens_of(req.prompt, "prompt")
    if not prompt:
        raise WireError("prompt must contain at least one token")
    last_n = req.prompt_logprobs_last_n
    if last_n is not None:
        if not req.prompt_logprobs:
            raise WireError(
                "prompt_logprobs_last_n applies to prompt logprobs; set prompt_logprobs"
            )
        if not 1 <= last_n <= len(prompt) - 1:
            raise WireError(
                f"prompt_logprobs_last_n must be in 1..{len(prompt) - 1} (the prompt has "
                f"{len(prompt)} tokens), got {last_n}"
            )
    check_token_ids(prompt, card.vocab_size, "prompt")
    params = req.sampling_params
    if params.max_tokens is None or params.max_tokens < 1:
        raise WireError("sampling_params.max_tokens must be set to an integer >= 1")
    if len(prompt) + params.max_tokens > card.max_context:
        raise WireError(
            f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
            f"model's max_context_length {card.max_context}"
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
    if not (math.isfinite(params.temperature) and params.temperature >= 0):
        raise WireError(f"sampling_params.temperature must be >= 0, got {params.temperature}")
    if not 0 < params.top_p <= 1:
        raise WireError(f"sampling_params.top_p must be in (0, 1], got {params.top_p}")
    if params.top_k < -1:
        raise WireError(f"sampling_params.top_k must be -1 (off) or positive, got {params.top_k}")
    if params.seed is not None and not 0 <= params.seed <= MAX_SEED:
        raise WireError(f"sampling_params.seed must be in 0..2^63-1, got {params.seed}")
    stop = params.stop
    stop_strings = [stop] if isinstance(stop, str) else []
    stop_ids: list[int] = []
    if isinstance(stop, list):
        stop_strings = [s for s in stop if isinstance(s, str)]
        stop_ids = [s for s in stop if isinstance(s, int)]
    if any(not s for s in stop_strings):
        raise WireError("sampling_params.stop strings must be non-empty")
    return SampleJob(
        sampler=sampler,
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
        tempered_logprobs=tempered,
    )
