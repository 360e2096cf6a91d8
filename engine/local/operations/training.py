"""Training clients: create_model, get_info and the seq_id-ordered training operations
(forward, forward_backward, optim_step, save_weights, save_weights_for_sampler,
load_weights)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
import uuid
from collections.abc import Callable
from typing import Any

import anyio

from engine.local.compute import rollout_correction
from engine.local.compute.backend_types import AdapterSpec
from engine.local.compute.losses import STABILITY_LOSSES
from engine.local.compute.stability import stability_inputs
from engine.local.http.wire import (
    CreateModelW,
    ForwardBackwardW,
    ForwardW,
    LoadWeightsW,
    ModelRefW,
    OptimStepW,
    SaveForSamplerW,
    SaveWeightsW,
    WireError,
    check_adamw,
    parse,
)
from engine.local.models.storage import TinkerPath
from engine.local.operations.checkpoints import CheckpointStore
from engine.local.operations.core import (
    INJECTED_FAIL,
    USER_ERRORS,
    BoundedMap,
    Core,
    HttpError,
    raw_field,
    sync_parse,
)
from engine.local.operations.futures import FutureEntry
from engine.local.operations.jobs import (
    Job,
    ModelLimits,
    forward_job,
    load_state_job,
    optim_job,
    save_sampler_job,
    save_state_job,
)
from engine.local.operations.registry import ModelState
from engine.local.operations.resources import Resources
from engine.local.operations.sequencer import ModelSequencer, SeqRejected
from engine.local.profiles import ServiceRefusal
from engine.local.stats import OpCycle

SamplerSaved = Callable[[str, TinkerPath | None, ModelState], str | None]
"""(backend key, named path or None, model) -> the new sampling_session_id (ephemeral)."""


class TrainingOps:
    def __init__(
        self,
        core: Core,
        checkpoints: CheckpointStore,
        resources: Resources,
        on_sampler_saved: SamplerSaved,
    ) -> None:
        self.core = core
        self.checkpoints = checkpoints
        self.resources = resources
        self._on_sampler_saved = on_sampler_saved
        self._model_requests = BoundedMap()

    # ---- models -----------------------------------------------------------------------

    def create_model(self, body: Any) -> dict[str, Any]:
        core = self.core
        session_id = raw_field(body, "session_id", str)
        model_seq_id = raw_field(body, "model_seq_id", int)
        dedupe_key = (session_id, model_seq_id)
        if session_id is not None and model_seq_id is not None:
            existing = self._model_requests.get(dedupe_key)
            if existing is not None and core.futures.get(existing) is not None:
                core.stats.dedupe_hits["create_model"] += 1
                return {"request_id": existing}
        self.resources.check_model_budget()
        entry = core.new_future("create_model")
        if session_id is not None and model_seq_id is not None:
            self._model_requests.remember(dedupe_key, entry.request_id)
        try:
            req = parse(CreateModelW, body, "create_model")
            core.resolve_base_model(req.base_model)
            check_adamw(req.optimizer_config, "create_model")
            lora = req.lora_config
            if lora is None:
                raise WireError("create_model needs a lora_config (the local server trains LoRA)")
            if not 1 <= lora.rank <= core.config.limits.max_lora_rank:
                raise WireError(
                    f"lora_config.rank must be in 1..{core.config.limits.max_lora_rank}, "
                    f"got {lora.rank}"
                )
            spec = AdapterSpec(
                rank=lora.rank,
                seed=lora.seed,
                train_mlp=lora.train_mlp,
                train_attn=lora.train_attn,
                train_unembed=lora.train_unembed,
            )
            correction = self._rollout_correction(req.rollout_correction_config)
        except USER_ERRORS as exc:
            core.futures.fail(entry, str(exc))
            return core.ref(entry)
        if core.faults.submit_fault("create_model"):
            core.futures.fail(entry, INJECTED_FAIL, "server")
            return core.ref(entry)
        core.spawn(self._run_create_model, entry, spec, req, correction)
        self.resources.creating_models += 1
        return core.ref(entry)

    def _rollout_correction(self, config: Any) -> rollout_correction.RolloutCorrection | None:
        if config is None:
            return None
        profile = self.core.config.profile
        if not profile.rollout_correction:
            raise WireError(
                "create_model: rollout_correction_config (MinT's session-level rollout "
                f"correction) is not supported by this server (--service {profile.name})"
            )
        try:
            return rollout_correction.parse(config)
        except rollout_correction.RolloutCorrectionError as exc:
            raise WireError(f"create_model: {exc}") from None

    async def _run_create_model(
        self,
        entry: FutureEntry,
        spec: AdapterSpec,
        req: CreateModelW,
        correction: rollout_correction.RolloutCorrection | None,
    ) -> None:
        try:
            await self._create_model(entry, spec, req, correction)
        finally:
            self.resources.creating_models -= 1

    async def _create_model(
        self,
        entry: FutureEntry,
        spec: AdapterSpec,
        req: CreateModelW,
        correction: rollout_correction.RolloutCorrection | None,
    ) -> None:
        core = self.core
        model_id = f"model-{uuid.uuid4().hex}"

        def run() -> None:
            core.backend.create_model(model_id, spec)
            self.checkpoints.write_run(model_id, req.base_model, spec.rank, req.user_metadata)

        def finish(_: None) -> dict[str, Any]:
            seq = ModelSequencer(
                gap_timeout=core.config.seq_gap_timeout_s,
                dedupe_window=core.config.limits.dedupe_window,
                max_seq_gap=core.config.limits.max_seq_gap,
            )
            core.registry.add_model(
                ModelState(
                    model_id, spec, seq, req.session_id, req.base_model, core.now(), correction
                )
            )
            return {"model_id": model_id, "type": "create_model"}

        payload = await core.finish_job(entry, Job(run=run, finish=finish))
        if payload is not None:
            await self.resources.enforce_memory(frozenset({model_id}))
            core.futures.resolve(entry, payload)

    def get_info(self, body: Any) -> dict[str, Any]:
        req = sync_parse(ModelRefW, body, "get_info")
        model = self.model_or_404(req.model_id)
        card = self.core.card
        return {
            "type": "get_info",
            "model_id": model.model_id,
            "model_data": {
                "arch": card.arch,
                "model_name": model.base_model,
                "tokenizer_id": str(card.tokenizer_dir),
            },
            "is_lora": True,
            "lora_rank": model.spec.rank,
            "model_name": model.base_model,
        }

    def model_or_404(self, model_id: str) -> ModelState:
        model = self.core.registry.models.get(model_id)
        if model is None:
            raise HttpError(404, self.unknown_model(model_id))
        return model

    def unknown_model(self, model_id: str) -> str:
        why = self.core.registry.why_released(model_id)
        if why is not None:
            return f"model_id {model_id!r} was released: {why}"
        return (
            f"unknown model_id {model_id!r} (training clients do not survive a server restart; "
            "create one again, e.g. with create_training_client_from_state)"
        )

    # ---- training operations ----------------------------------------------------------

    def submit(self, endpoint: str, body: Any, digest: str = "") -> dict[str, Any]:
        """Accept one training operation: dedupe on (model_id, seq_id), build its job
        (bad input fails the future but still takes the seq_id's turn, so later
        operations of the model are not blocked), and queue it in seq order.

        ``digest`` fingerprints the request body: a resubmission carries the same one.
        The same seq_id with a different body is not a retry but a second client
        numbering from 1 again; it is refused rather than answered with a stale result."""
        core = self.core
        model_id, seq_id = raw_field(body, "model_id", str), raw_field(body, "seq_id", int)
        if model_id is None:
            raise HttpError(400, f"invalid {endpoint} request: model_id (a string) is required")
        if isinstance(body, dict) and _RESUBMISSION_VOLATILE & body.keys():
            digest = _fingerprint(body)
        model = core.registry.models.get(model_id)
        if model is None:
            return core.failed_future(endpoint, self.unknown_model(model_id))
        core.registry.touch(model)
        if seq_id is None and core.config.profile.seq_id_optional:
            seq_id = model.seq.first_missing()  # no resubmission can be recognised then
        if seq_id is None or seq_id < 1:
            return core.failed_future(
                endpoint,
                f"invalid {endpoint} request: seq_id (an integer >= 1) is required; it orders "
                "a model's operations",
            )
        existing = model.seq.lookup(seq_id)
        if existing is not None:
            request_id, earlier_digest = existing
            if earlier_digest != digest:
                return core.failed_future(
                    endpoint,
                    f"seq_id {seq_id} of model {model_id} was already used by a different "
                    "request; seq_ids number one training client's operations, so a second "
                    "client for the same model cannot start again at 1 (create a new training "
                    "client, e.g. with create_training_client_from_state)",
                )
            core.stats.dedupe_hits[endpoint] += 1
            return {"request_id": request_id, "model_id": model_id}
        if model.seq.queued >= core.config.limits.max_pending_per_model:
            raise HttpError(
                429,
                f"model {model_id} already has {model.seq.queued} queued operations; retry later",
                category="server",
                headers={"Retry-After": "1"},
            )
        if endpoint == "save_weights_for_sampler":
            named = raw_field(body, "path", str) is not None
            self.resources.check_snapshot_room(model_id, named=named)
        entry = core.new_future(endpoint, model_id)
        try:
            model.seq.claim(seq_id, entry.request_id, digest)
        except SeqRejected as exc:
            core.futures.fail(entry, str(exc))
            return core.ref(entry)
        job: Job | None
        refusal: ServiceRefusal | None = None
        try:
            job = self._build_job(endpoint, model, body)
        except (*USER_ERRORS, ServiceRefusal) as exc:
            core.futures.fail(entry, str(exc))
            refusal = exc if isinstance(exc, ServiceRefusal) else None
            job = None
        if job is not None and core.faults.submit_fault(endpoint):
            core.futures.fail(entry, INJECTED_FAIL, "server")
            job = None
        cycle = core.clock.assign() if (core.clock is not None and job is not None) else None
        core.spawn(self._run, model, seq_id, entry, job, cycle, time.monotonic())
        if refusal is not None:
            # As the hosted service refuses it: at once, naming the key (the seq_id still
            # takes its turn, so the model's later operations are not held up).
            raise HttpError(400, str(refusal))
        return core.ref(entry)

    def _build_job(self, endpoint: str, model: ModelState, body: Any) -> Job:
        core = self.core
        limits = ModelLimits(
            max_datums=core.config.limits.max_datums,
            max_tokens=core.config.limits.max_request_tokens,
        )
        mid = model.model_id
        backend = core.backend
        if endpoint in ("forward_backward", "forward"):
            if endpoint == "forward_backward":
                inp = parse(ForwardBackwardW, body, endpoint).forward_backward_input
            else:
                inp = parse(ForwardW, body, endpoint).forward_input
            core.config.profile.check_loss(inp.loss_fn, inp.loss_fn_config)
            server_inputs = None
            if inp.loss_fn in STABILITY_LOSSES:
                server_inputs = stability_inputs(core.stability, model.session_id, inp)
            correction = model.rollout_correction
            return forward_job(
                backend,
                mid,
                inp,
                limits,
                backward=endpoint == "forward_backward",
                server_inputs=server_inputs,
                corrected=correction if inp.loss_fn == "importance_sampling" else None,
            )
        if endpoint == "optim_step":
            opt = parse(OptimStepW, body, endpoint)
            if opt.adam_params is None:
                if opt.optimizer_params is not None:  # tinker >= 0.38, another optimizer
                    check_adamw(opt.optimizer_params, endpoint)
                raise WireError(f"invalid {endpoint} request: adam_params: Field required")

            def count_step() -> None:
                core.stats.optimizer_steps[mid] += 1

            return optim_job(backend, mid, opt.adam_params, count_step)
        if endpoint == "save_weights":
            sw = parse(SaveWeightsW, body, endpoint)
            job = save_state_job(backend, mid, sw.path, core.data_dir, overwrite=sw.overwrite)
            return self.checkpoints.on_saved(job, sw.ttl_seconds, sw.user_metadata)
        if endpoint == "save_weights_for_sampler":
            ss = parse(SaveForSamplerW, body, endpoint)
            if ss.kind not in ("snapshot", "inflight"):
                raise WireError(
                    "save_weights_for_sampler kind must be 'snapshot' or 'inflight', "
                    f"got {ss.kind!r}"
                )
            if ss.path is None and ss.sampling_session_seq_id is None:
                raise WireError(
                    "save_weights_for_sampler needs a name in 'path' or a sampling_session_seq_id"
                )
            job = save_sampler_job(
                backend,
                mid,
                ss.path,
                core.data_dir,
                on_saved=lambda key, path: self._on_sampler_saved(key, path, model),
                snapshot_delay=core.latency.snapshot if core.latency else 0.0,
            )
            if ss.path is None:
                return job
            return self.checkpoints.on_saved(job, ss.ttl_seconds, ss.user_metadata)
        if endpoint == "load_weights":
            lw = parse(LoadWeightsW, body, endpoint)
            self.checkpoints.expire_if_due(lw.path)
            return load_state_job(backend, mid, lw.path, core.data_dir, optimizer=lw.optimizer)
        raise AssertionError(f"not a training endpoint: {endpoint}")

    async def _run(
        self,
        model: ModelState,
        seq_id: int,
        entry: FutureEntry,
        job: Job | None,
        cycle: int | None,
        submitted: float,
    ) -> None:
        core = self.core
        payload: dict[str, Any] | None = None
        try:
            async with model.seq.turn(seq_id):
                if job is None:
                    return  # already failed; its turn only keeps the order
                if model.model_id not in core.registry.models:
                    core.futures.fail(entry, self.unknown_model(model.model_id))
                    return
                if cycle is not None and core.clock is not None:
                    # Computed now, released when its cycle ends (see engine.local.latency).
                    core.stats.record_cycle(
                        model.model_id, OpCycle(seq_id, entry.endpoint, cycle, submitted)
                    )
                reads = self.checkpoints.reading(job.reads) if job.reads else None
                with reads or contextlib.nullcontext():
                    payload = await core.finish_job(entry, job)
        except SeqRejected as exc:
            core.futures.fail(entry, str(exc))
            return
        if payload is None:
            return
        if cycle is not None and core.clock is not None:
            await core.clock.wait_end(cycle)
        if job.extra_delay > 0:
            await anyio.sleep(job.extra_delay)
        core.futures.resolve(entry, payload)


# Fields the SDK draws anew when it resubmits one operation under the same seq_id (an
# ephemeral save_weights_for_sampler gets a fresh sampling_session_seq_id per attempt):
# they must not make a resubmission look like a different request.
_RESUBMISSION_VOLATILE = frozenset({"sampling_session_seq_id"})


def _fingerprint(body: dict[str, Any]) -> str:
    """A digest of ``body`` without its resubmission-volatile fields."""
    stable = {k: v for k, v in body.items() if k not in _RESUBMISSION_VOLATILE}
    canonical = json.dumps(stable, sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(canonical.encode(), digest_size=16).hexdigest()
