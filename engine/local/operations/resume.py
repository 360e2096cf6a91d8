"""Create a training client from a saved state in one request (tinker >= 0.38).

tinker 0.22 resumes with ``weights_info`` + ``create_model`` + ``load_weights``. tinker 0.38
sends a single ``load_weights`` that names no model but its session and ``model_seq_id``
(like ``create_model``); the client itself names the model ``<session_id>:train:<seq>``,
takes the LoRA shape from the checkpoint and numbers the model's operations from 1.
A resubmission (same session and model_seq_id) gets the original future.
"""

from __future__ import annotations

from typing import Any

from engine.local.compute.backend import Backend
from engine.local.compute.backend_types import AdapterSpec
from engine.local.http.wire import ResumeFromStateW, WireError, check_adamw, parse
from engine.local.models.storage import TinkerPath, check_model_id
from engine.local.operations.checkpoints import CheckpointStore
from engine.local.operations.core import INJECTED_FAIL, USER_ERRORS, BoundedMap, Core, raw_field
from engine.local.operations.futures import FutureEntry
from engine.local.operations.jobs import Job
from engine.local.operations.registry import ModelState
from engine.local.operations.resources import Resources
from engine.local.operations.sequencer import ModelSequencer


def is_resume(body: Any) -> bool:
    """A load_weights that names a session and model_seq_id instead of a model."""
    return isinstance(body, dict) and body.get("model_id") is None and "session_id" in body


def resumed_model_id(session_id: str, model_seq_id: int) -> str:
    """The id tinker 0.38 gives the model it resumes (it never reads it from the server)."""
    return f"{session_id}:train:{model_seq_id}"


class ResumeOps:
    def __init__(self, core: Core, checkpoints: CheckpointStore, resources: Resources) -> None:
        self.core = core
        self.checkpoints = checkpoints
        self.resources = resources
        self._requests = BoundedMap()

    def load(self, body: Any) -> dict[str, Any]:
        core = self.core
        key = (raw_field(body, "session_id", str), raw_field(body, "model_seq_id", int))
        if None not in key:
            existing = self._requests.get(key)
            if existing is not None and core.futures.get(existing) is not None:
                core.stats.dedupe_hits["load_weights"] += 1
                return {"request_id": existing}
        self.resources.check_model_budget()
        entry = core.new_future("load_weights")
        if None not in key:
            self._requests.remember(key, entry.request_id)
        try:
            req = parse(ResumeFromStateW, body, "load_weights")
            check_adamw(req.optimizer_config, "load_weights")
            if req.base_model is not None:
                core.resolve_base_model(req.base_model)
            model_id = check_model_id(resumed_model_id(req.session_id, req.model_seq_id))
            if model_id in core.registry.models:
                raise WireError(
                    f"model {model_id} already exists: model_seq_id {req.model_seq_id} of this "
                    "session was already used"
                )
            self.checkpoints.expire_if_due(req.path)
            path = TinkerPath.parse(req.path)
            if not path.directory(core.data_dir).is_dir():
                raise WireError(f"checkpoint {path} not found")
        except USER_ERRORS as exc:
            core.futures.fail(entry, str(exc))
            return core.ref(entry)
        if core.faults.submit_fault("load_weights"):
            core.futures.fail(entry, INJECTED_FAIL, "server")
            return core.ref(entry)
        core.spawn(self._run, entry, req, model_id, path)
        self.resources.creating_models += 1
        return core.ref(entry)

    async def _run(
        self, entry: FutureEntry, req: ResumeFromStateW, model_id: str, path: TinkerPath
    ) -> None:
        try:
            await self._resume(entry, req, model_id, path)
        finally:
            self.resources.creating_models -= 1

    async def _resume(
        self, entry: FutureEntry, req: ResumeFromStateW, model_id: str, path: TinkerPath
    ) -> None:
        core = self.core
        directory = path.directory(core.data_dir)
        backend = core.backend

        def run() -> tuple[AdapterSpec, str]:
            info = Backend.read_state_info(directory)
            spec = AdapterSpec(
                rank=int(info["lora_rank"]),
                train_mlp=bool(info.get("train_mlp", True)),
                train_attn=bool(info.get("train_attn", True)),
                train_unembed=bool(info.get("train_unembed", True)),
            )
            base_model = req.base_model or str(info.get("base_model") or core.card.name)
            backend.create_model(model_id, spec)
            try:
                backend.load_state(model_id, directory, optimizer=req.optimizer)
            except BaseException:
                backend.delete_model(model_id)
                raise
            self.checkpoints.write_run(model_id, base_model, spec.rank, req.user_metadata)
            return spec, base_model

        def finish(result: tuple[AdapterSpec, str]) -> dict[str, Any]:
            spec, base_model = result
            seq = ModelSequencer(
                gap_timeout=core.config.seq_gap_timeout_s,
                dedupe_window=core.config.limits.dedupe_window,
                max_seq_gap=core.config.limits.max_seq_gap,
            )
            core.registry.add_model(
                ModelState(model_id, spec, seq, req.session_id, base_model, core.now())
            )
            return {"path": str(path), "type": "load_weights"}

        with self.checkpoints.reading(path):
            payload = await core.finish_job(entry, Job(run=run, finish=finish))
        if payload is not None:
            await self.resources.enforce_memory(frozenset({model_id}))
            core.futures.resolve(entry, payload)
