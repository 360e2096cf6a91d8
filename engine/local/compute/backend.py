"""Torch compute backend of the local MinT-compatible server.

Contract (with the HTTP layer, ``engine/local/http/app.py``; change only together): every
method is called from ONE compute thread, so nothing locks; it sees plain Python / torch
values, never JSON or HTTP; a user-caused problem raises ``BackendError`` (the server
answers a "user" ``RequestFailedError``). The exception: while ``samples_apart`` is
true, ``sample`` may run on a second thread, reading only what nothing else writes (the
base weights, cloned sampler snapshots, the folded model copy only it touches).
"""

from __future__ import annotations

import copy
import itertools
import math
import secrets
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from engine.basemodels.recommended import served_model_name
from engine.local.compute import losses
from engine.local.compute.backend_types import (
    AdamConfig,
    AdapterSpec,
    BackendError,
    DatumIn,
    ForwardResult,
    SampledSeq,
    SampledSequences,
    SampleJob,
    SamplerSnapshot,
    request_of,
)
from engine.local.compute.base_model import load_base_model
from engine.local.compute.datums import (
    CheckedDatum,
    DatumError,
    PaddedBatch,
    check_data,
    micro_batches,
    pad_right,
)
from engine.local.compute.prefix import plan_prefixes, shared_prefix_logprobs
from engine.local.compute.sampling import Sampler, cache_keyword
from engine.local.models import checkpoint
from engine.local.models.lora import AdapterHost, BaseWeights, TargetSet
from engine.local.models.training_state import (
    Client,
    TrainingState,
    all_finite,
    check_adam,
    check_finite,
    check_optimizer,
    gradients_kept_only_on_success,
    new_adam,
    restore_adam,
)

_DEFAULT_LOGITS_BUDGET = 1 << 25  # logits elements per forward micro-batch (128 MiB fp32)


class Backend:
    """Loads one local Hugging Face causal-LM directory and serves many LoRA training
    clients and frozen sampler snapshots on top of it.

    The base weights are loaded once and frozen; each training client is a peft adapter
    with its own gradients and AdamW state (see ``engine.local.models.lora``). Numerics are
    float32 with deterministic torch algorithms, so equal inputs give equal bits (which
    the resume guarantee relies on).
    """

    model_name: str  # the name clients pass as base_model
    model_dir: Path  # absolute; also the tokenizer directory
    max_context_length: int

    def __init__(
        self,
        model_dir: Path,
        *,
        model_name: str | None = None,
        lora_alpha: int = 32,
        num_threads: int | None = None,
        logits_budget: int = _DEFAULT_LOGITS_BUDGET,
    ) -> None:
        """``lora_alpha`` fixes the LoRA scale at alpha/rank (Tinker uses a constant alpha
        of 32, which makes good learning rates roughly rank-independent).
        ``num_threads`` sets torch's (process-wide) intra-op threads; None picks one
        thread for small models and torch's default otherwise (see
        :func:`~engine.local.compute.base_model.auto_threads`)."""
        loaded = load_base_model(model_dir, num_threads)
        model, tokenizer = loaded.model, loaded.tokenizer
        self.model_dir = loaded.model_dir
        self.model_name = model_name or served_model_name(loaded.model_dir)
        self.tokenizer = tokenizer
        self._model = model
        self.vocab_size = loaded.vocab_size
        self.max_context_length = loaded.max_context_length
        self._pad_id = loaded.pad_id
        self._eos_ids = loaded.eos_ids
        self._host = AdapterHost(model, lora_alpha)
        self._base = BaseWeights.of(model, self._host.groups, lora_alpha)
        self._logits_budget = logits_budget
        self._cache_kw = cache_keyword(model)
        self.share_prefixes = True
        """Run prompts shared by several training datums once (False: the plain padded
        forward; both compute the same values)."""
        self._clients: dict[str, Client] = {}
        self._snapshots: dict[str, SamplerSnapshot] = {}
        self._loaded_paths: dict[Path, str] = {}
        self._slots: dict[tuple[int, str], str] = {}
        self._slot_holds: dict[str, str] = {}  # slot -> the snapshot key copied into it
        self._counter = itertools.count()

        def sampler(of: torch.nn.Module) -> Sampler:
            return Sampler(
                of,
                pad_id=self._pad_id,
                eos_ids=self._eos_ids,
                decode=lambda ids: str(tokenizer.decode(ids, skip_special_tokens=False)),
            )

        self._sampler = sampler(model)
        # Small models also sample from a plain copy with the snapshot's LoRA folded into
        # its weights: a forward without peft's per-layer detours costs far less.
        small = loaded.small
        self._folded = sampler(copy.deepcopy(model)) if small else None
        self._folded_holds: tuple[str | None] | None = None  # (key,) folded in, if any
        self.fold_sampling_weights = small
        """Sample from the folded copy (False: through the peft adapters; both compute the
        same values; only small models have the copy). Set it before serving: it decides
        ``samples_apart``."""

    @property
    def samples_apart(self) -> bool:
        """Whether ``sample`` may run on its own thread (see the module's CONTRACT)."""
        return self._folded is not None and self.fold_sampling_weights

    # ---- training clients -------------------------------------------------------------

    def create_model(self, model_id: str, spec: AdapterSpec) -> None:
        if model_id in self._clients:
            raise BackendError(f"model {model_id!r} already exists")
        if isinstance(spec.rank, bool) or not isinstance(spec.rank, int) or spec.rank < 1:
            raise BackendError(f"LoRA rank must be a positive integer, got {spec.rank!r}")
        targets = self._targets(spec)
        seed = spec.seed if spec.seed is not None else secrets.randbits(31)
        adapter = f"client{next(self._counter)}"
        params = self._host.add(adapter, spec.rank, targets, seed)
        self._clients[model_id] = Client(adapter, spec, targets, seed, params, new_adam(params))

    def delete_model(self, model_id: str) -> None:
        """Drop a training client (its adapter, gradients and optimizer state)."""
        client = self._clients.pop(model_id, None)
        if client is not None:
            self._host.remove(client.adapter)

    def has_model(self, model_id: str) -> bool:
        return model_id in self._clients

    def optimizer_steps(self, model_id: str) -> int:
        """How many optim_steps this model's current optimizer state has applied: counts
        up by one per ``optim_step``, restored by ``load_state(optimizer=True)`` and reset
        to 0 by ``load_state(optimizer=False)``."""
        return self._client(model_id).steps

    def _client(self, model_id: str) -> Client:
        client = self._clients.get(model_id)
        if client is None:
            raise BackendError(f"unknown model_id {model_id!r}")
        return client

    def _targets(self, spec: AdapterSpec) -> TargetSet:
        if not (spec.train_attn or spec.train_mlp or spec.train_unembed):
            raise BackendError("at least one of train_attn, train_mlp, train_unembed must be true")
        targets = self._host.groups.select(
            attn=spec.train_attn, mlp=spec.train_mlp, unembed=spec.train_unembed
        )
        if not targets.modules:
            raise BackendError(f"{self.model_name} has no linear layers matching that LoRA spec")
        return targets

    # ---- training ---------------------------------------------------------------------

    def forward_backward(
        self,
        model_id: str,
        data: list[DatumIn],
        loss_fn: str,
        loss_fn_config: dict[str, float] | None,
        *,
        backward: bool,
        formula: Callable[[torch.Tensor, Mapping[str, torch.Tensor]], torch.Tensor] | None = None,
    ) -> ForwardResult:
        """Loss is a SUM over tokens and datums; with backward=True gradients accumulate
        into the model's LoRA parameters until ``optim_step``. ``formula`` replaces
        that of ``loss_fn`` (same inputs and checks), e.g. a rollout correction's."""
        client = self._client(model_id)
        try:
            spec, cfg = losses.resolve(loss_fn, loss_fn_config)
        except losses.LossConfigError as e:
            raise BackendError(str(e)) from e
        if not data:
            raise BackendError("forward_backward needs at least one datum")
        try:
            checked = check_data(
                data, spec.inputs, vocab=self.vocab_size, max_len=self.max_context_length
            )
        except DatumError as e:
            raise BackendError(str(e)) from e
        for i, d in enumerate(checked):
            problem = spec.check(d.inputs) if spec.check else None
            if problem:
                raise BackendError(f"datum {i}: {problem}")
        outputs: list[dict[str, torch.Tensor]] = [{} for _ in checked]
        total = 0.0
        params = list(client.params.values()) if backward else []
        with (
            self._host.active(client.adapter),
            torch.set_grad_enabled(backward),
            gradients_kept_only_on_success(params),
        ):
            for batch in micro_batches(checked, self.vocab_size, self._logits_budget):
                rows = [checked[i] for i in batch]
                padded = pad_right(rows, self._pad_id, spec.inputs)
                logp = self._logprobs(rows, padded, cfg.get("temperature", 1.0))
                # zero logp and inputs on the padding: every loss term there is then 0
                logp = torch.where(padded.mask, logp, 0.0)
                datum_losses = (
                    spec.fn(logp, padded.inputs, cfg)
                    if formula is None
                    else formula(logp, padded.inputs)
                )
                finite = torch.isfinite(datum_losses.detach())
                if not bool(finite.all()):
                    row = int((~finite).int().argmax())
                    value = float(datum_losses[row].detach())
                    raise BackendError(
                        f"datum {batch[row]}: the {loss_fn} loss is {value}: its loss inputs "
                        "are too extreme (e.g. sampler logprobs far below the model's make "
                        "exp(logp - logprobs) overflow); nothing was applied"
                    )
                loss = datum_losses.sum()
                if backward:
                    loss.backward()
                total += float(loss.detach())
                kept = logp.detach()
                for row, (i, d) in enumerate(zip(batch, rows, strict=True)):
                    outputs[i]["logprobs"] = kept[row, : d.length].clone()
            if not math.isfinite(total):
                raise BackendError(
                    f"the summed {loss_fn} loss overflows to {total}; nothing was applied "
                    "(send fewer or less extreme datums)"
                )
            if not all_finite(p.grad for p in params):
                raise BackendError(
                    f"the {loss_fn} gradient of this request is not finite (its loss inputs are "
                    "too extreme); nothing was applied"
                )
        return ForwardResult(outputs=outputs, metrics={"loss:sum": total})

    def _logprobs(
        self, rows: list[CheckedDatum], padded: PaddedBatch, temperature: float
    ) -> torch.Tensor:
        """(B, T) logprobs of the padded targets under the active adapter's logits divided
        by ``temperature``; datums that share a prompt run it once
        (``engine.local.compute.prefix``)."""
        plan = plan_prefixes(rows) if self.share_prefixes else None
        if plan is not None:
            return shared_prefix_logprobs(
                self._model, self._cache_kw, padded, plan, self._pad_id, temperature
            )
        logits = self._model(input_ids=padded.ids, use_cache=False).logits.float() / temperature
        return -torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), padded.targets.flatten(), reduction="none"
        ).view(padded.targets.shape)

    def optim_step(self, model_id: str, adam: AdamConfig) -> dict[str, float]:
        """One AdamW step (decoupled weight decay, optional global grad-norm clipping) on
        the accumulated gradients, then zero them. Parameters with no gradient since the
        last step count as zero gradient, so every call is a real Adam step. A step that
        fails (a non-finite gradient, or weights that would become non-finite) changes
        nothing: weights, optimizer state and step count stay as they were."""
        client = self._client(model_id)
        check_adam(adam)
        params = list(client.params.values())
        if not all_finite(p.grad for p in params):
            client.optimizer.zero_grad(set_to_none=True)
            raise BackendError(
                "optim_step refused: the accumulated gradient is not finite; it was "
                "discarded, and the weights and optimizer state are unchanged"
            )
        saved = TrainingState.of(client)
        try:
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            grads = [p.grad for p in params if p.grad is not None]
            if adam.grad_clip_norm > 0:
                norm = torch.nn.utils.clip_grad_norm_(params, adam.grad_clip_norm)
            else:
                norm = torch.nn.utils.get_total_norm(grads)
            for group in client.optimizer.param_groups:
                group.update(
                    lr=adam.learning_rate,
                    betas=(adam.beta1, adam.beta2),
                    eps=adam.eps,
                    weight_decay=adam.weight_decay,
                )
            client.optimizer.step()
            if not all_finite(params):
                raise BackendError(
                    f"optim_step refused: with these AdamParams (learning_rate "
                    f"{adam.learning_rate:g}, eps {adam.eps:g}) the weights would become "
                    "non-finite; the weights and optimizer state are unchanged"
                )
        except BaseException:
            saved.restore(client)
            raise
        client.optimizer.zero_grad(set_to_none=True)
        client.steps += 1
        return {"grad_norm:mean": float(norm)}

    # ---- checkpoints ------------------------------------------------------------------

    def _meta(self, client: Client, kind: str) -> dict[str, Any]:
        return {
            "kind": kind,
            "base_model": self.model_name,
            "is_lora": True,
            "lora_rank": client.spec.rank,
            "lora_alpha": self._host.alpha,
            "train_attn": client.spec.train_attn,
            "train_mlp": client.spec.train_mlp,
            "train_unembed": client.spec.train_unembed,
            "target_modules": list(client.targets.modules),
            "seed": client.seed,
            "optimizer_steps": client.steps,
        }

    def save_sampler(self, model_id: str, dest: Path | None) -> str:
        """Freeze the current LoRA weights as a sampler snapshot (written to ``dest`` when
        given, so it survives a restart) and return its key."""
        client = self._client(model_id)
        tensors = {k: p.detach().clone() for k, p in client.params.items()}
        key = f"{model_id}:sampler{next(self._counter)}"
        self._snapshots[key] = SamplerSnapshot(client.spec.rank, client.targets, tensors)
        if dest is not None:
            checkpoint.write(Path(dest), self._meta(client, "sampler"), tensors)
            self._loaded_paths[Path(dest).resolve()] = key
        return key

    def load_sampler(self, src: Path) -> str:
        """Load a snapshot written by ``save_sampler`` (or a state from ``save_state``).
        Loading the same path again returns the same key."""
        path = Path(src).resolve()
        known = self._loaded_paths.get(path)
        if known is not None and known in self._snapshots:
            return known
        ckpt = self._read(path, optimizer=False)
        targets = self._targets_of(path, ckpt.meta)
        self._check_tensors(path, ckpt.weights, ckpt.meta["lora_rank"], targets)
        key = f"loaded:sampler{next(self._counter)}"
        self._snapshots[key] = SamplerSnapshot(ckpt.meta["lora_rank"], targets, ckpt.weights)
        self._loaded_paths[path] = key
        return key

    def release_sampler(self, key: str) -> None:
        """Forget a snapshot (memory is otherwise held until the backend goes away)."""
        self._snapshots.pop(key, None)
        for path in [p for p, k in self._loaded_paths.items() if k == key]:
            del self._loaded_paths[path]

    def has_sampler(self, key: str) -> bool:
        return key in self._snapshots

    def held_bytes(self) -> tuple[dict[str, int], dict[str, int]]:
        """Memory of each training client and each sampler snapshot, in bytes:
        ({model_id: n}, {sampler key: n}). A client counts at its full size from the
        start: LoRA weights, gradients and both Adam moments."""
        models = {
            model_id: 4 * sum(p.numel() * p.element_size() for p in client.params.values())
            for model_id, client in self._clients.items()
        }
        snapshots = {
            key: sum(t.numel() * t.element_size() for t in snap.tensors.values())
            for key, snap in self._snapshots.items()
        }
        return models, snapshots

    def save_state(self, model_id: str, dest: Path) -> None:
        """Weights + optimizer state + metadata (base model, LoRA spec, step count)."""
        client = self._client(model_id)
        weights = {k: p.detach().clone() for k, p in client.params.items()}
        opt_state: dict[str, torch.Tensor] = {}
        for key, p in client.params.items():
            state = client.optimizer.state.get(p)
            if state:
                opt_state[f"exp_avg/{key}"] = state["exp_avg"].clone()
                opt_state[f"exp_avg_sq/{key}"] = state["exp_avg_sq"].clone()
                opt_state[f"step/{key}"] = torch.as_tensor(state["step"]).clone().reshape(1)
        checkpoint.write(Path(dest), self._meta(client, "state"), weights, opt_state)

    def load_state(self, model_id: str, src: Path, *, optimizer: bool) -> None:
        """Replace the model's weights (and, with ``optimizer``, its Adam moments and step
        counts) by a saved state; pending gradients are dropped."""
        client = self._client(model_id)
        ckpt = self._read(Path(src), optimizer=optimizer)
        if ckpt.meta.get("kind") != "state" and optimizer:
            raise BackendError(f"{src} is a sampler checkpoint; it has no optimizer state")
        rank = int(ckpt.meta["lora_rank"])
        if rank != client.spec.rank or tuple(ckpt.meta["target_modules"]) != client.targets.modules:
            raise BackendError(
                f"{src} holds a rank-{rank} LoRA over {len(ckpt.meta['target_modules'])} modules; "
                f"model {model_id!r} is rank {client.spec.rank} over {len(client.targets.modules)}"
            )
        self._check_tensors(Path(src), ckpt.weights, rank, client.targets)
        with torch.no_grad():
            for key, p in client.params.items():
                p.copy_(ckpt.weights[key])
                p.grad = None
        client.optimizer = new_adam(client.params)
        client.steps = 0
        if optimizer and ckpt.optimizer is not None:
            restore_adam(client, ckpt.optimizer, Path(src))
            client.steps = int(ckpt.meta.get("optimizer_steps", 0))

    def verify_checkpoint(self, src: Path) -> dict[str, Any]:
        """Read a checkpoint completely (tensors, and optimizer state for a state) and
        check it fits this base model; return its metadata."""
        path = Path(src)
        try:
            kind = checkpoint.read_meta(path)["kind"]
        except checkpoint.CheckpointError as e:
            raise BackendError(str(e)) from e
        ckpt = self._read(path, optimizer=kind == "state")
        targets = self._targets_of(path, ckpt.meta)
        rank = ckpt.meta["lora_rank"]
        self._check_tensors(path, ckpt.weights, rank, targets)
        if ckpt.optimizer is not None:
            check_optimizer(path, ckpt.optimizer, self._host.shapes(rank, targets))
        return {k: v for k, v in ckpt.meta.items() if k != "format"}

    @staticmethod
    def read_state_info(src: Path) -> dict[str, Any]:
        """{"base_model", "is_lora", "lora_rank", ...} of a saved state or sampler."""
        try:
            meta = checkpoint.read_meta(Path(src))
        except checkpoint.CheckpointError as e:
            raise BackendError(str(e)) from e
        return {k: v for k, v in meta.items() if k != "format"}

    def _read(self, src: Path, *, optimizer: bool) -> checkpoint.Checkpoint:
        try:
            ckpt = checkpoint.read(src, optimizer=optimizer)
        except checkpoint.CheckpointError as e:
            raise BackendError(str(e)) from e
        base = ckpt.meta["base_model"]
        if base != self.model_name:
            raise BackendError(
                f"{src} was trained on base model {base!r}; this server serves {self.model_name!r}"
            )
        return ckpt

    def _targets_of(self, src: Path, meta: dict[str, Any]) -> TargetSet:
        unknown = sorted(set(meta["target_modules"]) - self._host.groups.all)
        if unknown:
            raise BackendError(
                f"{src}: target_modules {unknown[:3]} are not adaptable layers of {self.model_name}"
            )
        return TargetSet(tuple(meta["target_modules"]))

    def _check_tensors(
        self, src: Path, tensors: dict[str, torch.Tensor], rank: int, targets: TargetSet
    ) -> None:
        expected = self._host.shapes(rank, targets)
        if set(tensors) != set(expected):
            raise BackendError(f"{src}: LoRA tensors do not match this base model's layers")
        for key, shape in expected.items():
            if tuple(tensors[key].shape) != shape:
                raise BackendError(
                    f"{src}: tensor {key} has shape {tuple(tensors[key].shape)}, expected {shape}"
                )
            check_finite(src, key, tensors[key])

    # ---- sampling ---------------------------------------------------------------------

    def sample(self, jobs: list[SampleJob]) -> list[SampledSequences]:
        """Run many asample requests as one batched computation (per snapshot)."""
        snapshots: dict[str, SamplerSnapshot] = {}
        for i, job in enumerate(jobs):
            if job.sampler is not None and job.sampler not in snapshots:
                snap = self._snapshots.get(job.sampler)
                if snap is None:
                    raise BackendError(f"sample request {i}: unknown sampler {job.sampler!r}")
                snapshots[job.sampler] = snap
        requests = [request_of(job) for job in jobs]
        results: list[SampledSequences | None] = [None] * len(jobs)
        groups: dict[str | None, list[int]] = {}
        for i, job in enumerate(jobs):
            groups.setdefault(job.sampler, []).append(i)
        for key, idxs in groups.items():
            batch = [requests[i] for i in idxs]
            snap = None if key is None else snapshots[key]
            if self.samples_apart:  # the folded copy (only then may this run apart)
                assert self._folded is not None
                self._fold(key, snap, self._folded.model)
                outs = self._folded.run(batch)
            else:
                with self._host.active(self._load_slot(key)):
                    outs = self._sampler.run(batch)
            for i, out in zip(idxs, outs, strict=True):
                seqs = [
                    SampledSeq(s.tokens, s.logprobs, s.stop_reason, s.behaviour_logprobs)
                    for s in out.sequences
                ]
                results[i] = SampledSequences(
                    sequences=seqs,
                    prompt_logprobs=out.prompt_logprobs,
                    topk_prompt_logprobs=out.topk_prompt_logprobs,
                )
        return [r for r in results if r is not None]

    def _fold(self, key: str | None, snap: SamplerSnapshot | None, folded: torch.nn.Module) -> None:
        """Give the folded copy the base weights plus snapshot ``key``'s LoRA delta
        (computed from the snapshot's own tensors: no adapter, no shared module)."""
        if self._folded_holds == (key,):
            return
        weights = (
            self._base.folded(None, {})
            if snap is None
            else self._base.folded(snap.rank, snap.tensors)
        )
        with torch.no_grad():
            for name, weight in weights.items():
                target = folded.get_submodule(name).weight
                assert isinstance(target, torch.Tensor)
                target.copy_(weight)
        self._folded_holds = (key,)

    def _load_slot(self, key: str | None) -> str | None:
        """Copy a snapshot into the sampling adapter of its shape; return that adapter."""
        if key is None:
            return None
        snap = self._snapshots.get(key)
        if snap is None:
            raise BackendError(f"unknown sampler {key!r}")
        shape = (snap.rank, snap.targets.key)
        slot = self._slots.get(shape)
        if slot is None:
            slot = f"slot{next(self._counter)}"
            self._host.add(slot, snap.rank, snap.targets, seed=0)
            self._slots[shape] = slot
        if self._slot_holds.get(slot) != key:  # snapshots never change: copy once
            with torch.no_grad():
                for name, p in self._host.params(slot).items():
                    p.copy_(snap.tensors[name])
            self._slot_holds[slot] = key
        return slot
