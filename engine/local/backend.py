"""Torch compute backend of the local MinT-compatible server.

CONTRACT (shared by the HTTP layer in ``engine/local/app.py`` and this module; change
only together): every method is called from ONE compute thread owned by the server, so
the backend needs no locking; it never sees JSON or HTTP, only plain Python / torch
values; every user-caused problem raises ``BackendError`` with a clear message (the
server turns it into a ``RequestFailedError`` with category "user").

One exception: while ``samples_apart`` is true, ``sample`` may run on a second thread
(one at a time), concurrently with every other method, as the hosted samplers run apart
from the trainer. It then reads only what nothing else writes: the base weights
(``BaseWeights``, captured before any adapter existed), sampler snapshots (cloned
tensors, never changed; the dict entry is looked up once per call) and the folded copy
of the model, which only ``sample`` touches. Training clients, peft adapters and slots
are never read on that path.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import math
import secrets
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from engine.local import checkpoint, losses
from engine.local.datums import (
    CheckedDatum,
    DatumError,
    PaddedBatch,
    check_data,
    micro_batches,
    pad_right,
)
from engine.local.lora import AdapterHost, BaseWeights, TargetSet
from engine.local.prefix import plan_prefixes, shared_prefix_logprobs
from engine.local.recommended import served_model_name
from engine.local.sampling import Request, Sampler, cache_keyword


class BackendError(Exception):
    """A request the backend cannot honour (bad shapes, unknown loss, unknown model...)."""


@dataclass(frozen=True)
class AdapterSpec:
    """The LoRA adapter of one training client: its rank, init seed and which modules
    it trains."""

    rank: int
    seed: int | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True


@dataclass(frozen=True)
class DatumIn:
    """One datum, decoded: ``tokens`` is the flattened model_input; ``inputs`` holds the
    dense loss_fn_inputs (target_tokens int64, weights/advantages/logprobs float32...)."""

    tokens: list[int]
    inputs: dict[str, torch.Tensor]


class AdamConfig(BaseModel):
    """AdamW hyperparameters: the backend's argument and the wire's ``adam_params``
    (unknown keys are ignored, as for every wire type)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


@dataclass(frozen=True)
class SampleJob:
    """One asample request. ``sampler`` is a key from ``save_sampler``/``load_sampler``,
    or None for the bare base model."""

    sampler: str | None
    prompt: list[int]
    num_samples: int
    max_tokens: int
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop_strings: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    tempered_logprobs: bool = True


@dataclass(frozen=True)
class SampledSeq:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str  # "length" | "stop"
    behaviour_logprobs: list[float] | None = None
    """Under the distribution each token was drawn from, when ``logprobs`` report the
    untempered model instead (None: ``logprobs`` are these)."""


@dataclass(frozen=True)
class SampledSequences:
    """What one sample job produced: its sequences, and the prompt's logprobs when asked."""

    sequences: list[SampledSeq]
    prompt_logprobs: list[float | None] | None = None  # first entry None
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = None


@dataclass(frozen=True)
class ForwardResult:
    outputs: list[dict[str, torch.Tensor]]  # per datum, at least {"logprobs": (N,)}
    metrics: dict[str, float]  # keys "name:reduction", at least "loss:sum"


@dataclass
class _Client:
    """One training client: its adapter, LoRA spec, optimizer and step count."""

    adapter: str
    spec: AdapterSpec
    targets: TargetSet
    seed: int
    params: dict[str, torch.nn.Parameter]
    optimizer: torch.optim.AdamW
    steps: int = 0


@dataclass(frozen=True)
class _Snapshot:
    """Frozen LoRA tensors a sampler reads (cloned, so later training cannot move them)."""

    rank: int
    targets: TargetSet
    tensors: dict[str, torch.Tensor]


_DEFAULT_LOGITS_BUDGET = 1 << 25  # logits elements per forward micro-batch (128 MiB fp32)


def _new_adam(params: dict[str, torch.nn.Parameter]) -> torch.optim.AdamW:
    # hyperparameters are overwritten from AdamConfig on every step
    return torch.optim.AdamW(list(params.values()), lr=0.0, foreach=False)


_SMALL_MODEL_PARAMS = 20_000_000


def _auto_threads(model: torch.nn.Module) -> int:
    """One thread for small models: their matmuls are too small to gain from intra-op
    parallelism, and when the CPUs are shared (engine, server and scoring on 2 cores)
    OpenMP barriers stall on descheduled threads: one RL step of the default model took
    ~130 ms with 1 thread but up to ~2 s with 2 threads on a loaded 2-core machine.
    Larger models leave one core to the engine and the HTTP server in the same process:
    SmolLM2-135M sampled 8 responses in 7.5 s with 1 thread and 294 s with 2 on that
    machine (``engine.run --local-model smollm2-135m``, load average 6-9)."""
    n_params = sum(p.numel() for p in model.parameters())
    return 1 if n_params < _SMALL_MODEL_PARAMS else max(1, torch.get_num_threads() - 1)


class Backend:
    """Loads one local Hugging Face causal-LM directory and serves many LoRA training
    clients and frozen sampler snapshots on top of it.

    The base weights are loaded once and frozen; each training client is a peft adapter
    with its own gradients and AdamW state (see ``engine.local.lora``). Numerics are
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
        thread for small models and torch's default otherwise (see ``_auto_threads``)."""
        model_dir = Path(model_dir).expanduser().resolve()
        if not (model_dir / "config.json").is_file():
            raise BackendError(
                f"{model_dir} is not a Hugging Face model directory (no config.json)"
            )
        torch.use_deterministic_algorithms(True)
        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            tokenizer = AutoTokenizer.from_pretrained(model_dir)
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        except (OSError, ValueError) as e:
            raise BackendError(f"cannot load model from {model_dir}: {e}") from e
        finally:
            if bars:
                hf_logging.enable_progress_bar()
        model.eval()
        model.requires_grad_(False)
        torch.set_num_threads(num_threads or _auto_threads(model))
        self.model_dir = model_dir
        self.model_name = model_name or served_model_name(model_dir)
        self.tokenizer = tokenizer
        self._model = model
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        cfg = model.config
        self.max_context_length = int(
            getattr(cfg, "max_position_embeddings", None) or tokenizer.model_max_length
        )
        pad = tokenizer.pad_token_id
        self._pad_id = int(pad if pad is not None else tokenizer.eos_token_id or 0)
        eos = model.generation_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if tokenizer.eos_token_id is not None:
            eos_ids.add(int(tokenizer.eos_token_id))
        self._eos_ids = frozenset(int(e) for e in eos_ids)
        self._host = AdapterHost(model, lora_alpha)
        self._base = BaseWeights.of(model, self._host.groups, lora_alpha)
        self._logits_budget = logits_budget
        self._cache_kw = cache_keyword(model)
        self.share_prefixes = True
        """Run prompts shared by several training datums once (False: the plain padded
        forward; both compute the same values)."""
        self._clients: dict[str, _Client] = {}
        self._snapshots: dict[str, _Snapshot] = {}
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
        small = sum(p.numel() for p in model.parameters()) < _SMALL_MODEL_PARAMS
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
        self._clients[model_id] = _Client(adapter, spec, targets, seed, params, _new_adam(params))

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

    def _client(self, model_id: str) -> _Client:
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
    ) -> ForwardResult:
        """Loss is a SUM over tokens and datums; with backward=True gradients accumulate
        into the model's LoRA parameters until ``optim_step``."""
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
            _gradients_kept_only_on_success(params),
        ):
            for batch in micro_batches(checked, self.vocab_size, self._logits_budget):
                rows = [checked[i] for i in batch]
                padded = pad_right(rows, self._pad_id, spec.inputs)
                logp = self._logprobs(rows, padded, cfg.get("temperature", 1.0))
                # zero logp and inputs on the padding: every loss term there is then 0
                logp = torch.where(padded.mask, logp, 0.0)
                datum_losses = spec.fn(logp, padded.inputs, cfg)
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
            if not _all_finite(p.grad for p in params):
                raise BackendError(
                    f"the {loss_fn} gradient of this request is not finite (its loss inputs are "
                    "too extreme); nothing was applied"
                )
        return ForwardResult(outputs=outputs, metrics={"loss:sum": total})

    def _logprobs(
        self, rows: list[CheckedDatum], padded: PaddedBatch, temperature: float
    ) -> torch.Tensor:
        """(B, T) logprobs of the padded targets under the active adapter's logits divided
        by ``temperature``; datums that share a prompt run it once (``engine.local.prefix``)."""
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
        _check_adam(adam)
        params = list(client.params.values())
        if not _all_finite(p.grad for p in params):
            client.optimizer.zero_grad(set_to_none=True)
            raise BackendError(
                "optim_step refused: the accumulated gradient is not finite; it was "
                "discarded, and the weights and optimizer state are unchanged"
            )
        saved = _TrainingState.of(client)
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
            if not _all_finite(params):
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

    def _meta(self, client: _Client, kind: str) -> dict[str, Any]:
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
        self._snapshots[key] = _Snapshot(client.spec.rank, client.targets, tensors)
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
        self._snapshots[key] = _Snapshot(ckpt.meta["lora_rank"], targets, ckpt.weights)
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
        client.optimizer = _new_adam(client.params)
        client.steps = 0
        if optimizer and ckpt.optimizer is not None:
            self._restore_adam(client, ckpt.optimizer, Path(src))
            client.steps = int(ckpt.meta.get("optimizer_steps", 0))

    @staticmethod
    def _restore_adam(client: _Client, saved: dict[str, torch.Tensor], src: Path) -> None:
        for key, p in client.params.items():
            names = (f"exp_avg/{key}", f"exp_avg_sq/{key}", f"step/{key}")
            present = [n in saved for n in names]
            if not any(present):
                continue  # never stepped when saved
            if not all(present):
                raise BackendError(f"{src}: optimizer state for {key} is incomplete")
            client.optimizer.state[p] = {
                "step": saved[names[2]].reshape(()).clone(),
                "exp_avg": saved[names[0]].clone(),
                "exp_avg_sq": saved[names[1]].clone(),
            }

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
            self._check_optimizer(path, ckpt.optimizer, self._host.shapes(rank, targets))
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
            _check_finite(src, key, tensors[key])

    @staticmethod
    def _check_optimizer(
        src: Path, saved: dict[str, torch.Tensor], shapes: dict[str, tuple[int, int]]
    ) -> None:
        """Adam state as ``save_state`` writes it: moments shaped like their weights, one
        step count each, all finite."""
        for name, tensor in saved.items():
            kind, _, key = name.partition("/")
            expected = (1,) if kind == "step" else shapes.get(key)
            if kind not in ("exp_avg", "exp_avg_sq", "step") or key not in shapes:
                raise BackendError(f"{src}: unexpected optimizer tensor {name}")
            if tuple(tensor.shape) != expected:
                raise BackendError(
                    f"{src}: optimizer tensor {name} has shape {tuple(tensor.shape)}, "
                    f"expected {expected}"
                )
            _check_finite(src, name, tensor)

    # ---- sampling ---------------------------------------------------------------------

    def sample(self, jobs: list[SampleJob]) -> list[SampledSequences]:
        """Run many asample requests as one batched computation (per snapshot)."""
        snapshots: dict[str, _Snapshot] = {}
        for i, job in enumerate(jobs):
            if job.sampler is not None and job.sampler not in snapshots:
                snap = self._snapshots.get(job.sampler)
                if snap is None:
                    raise BackendError(f"sample request {i}: unknown sampler {job.sampler!r}")
                snapshots[job.sampler] = snap
        requests = [_request(job) for job in jobs]
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

    def _fold(self, key: str | None, snap: _Snapshot | None, folded: torch.nn.Module) -> None:
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


def _request(job: SampleJob) -> Request:
    """Jobs arrive validated (``engine.local.service.sampling.sample_job_of``); ``sample``
    checks that their snapshots exist."""
    return Request(
        prompt=list(job.prompt),
        num_samples=job.num_samples,
        max_tokens=job.max_tokens,
        temperature=float(job.temperature),
        top_k=job.top_k,
        top_p=float(job.top_p),
        seed=job.seed,
        stop_strings=tuple(job.stop_strings),
        stop_token_ids=frozenset(job.stop_token_ids),
        prompt_logprobs=job.prompt_logprobs,
        topk_prompt_logprobs=job.topk_prompt_logprobs,
        tempered_logprobs=job.tempered_logprobs,
    )


def _all_finite(tensors: Iterable[torch.Tensor | None]) -> bool:
    return all(t is None or bool(torch.isfinite(t).all()) for t in tensors)


def _check_finite(src: Path, name: str, tensor: torch.Tensor) -> None:
    if not _all_finite([tensor]):
        raise BackendError(f"{src}: tensor {name} holds NaN or infinite values")


@contextlib.contextmanager
def _gradients_kept_only_on_success(params: list[torch.nn.Parameter]) -> Iterator[None]:
    """Gradients computed inside the block start from zero; when it succeeds they are
    added to the ones accumulated before, when it raises they are dropped and the earlier
    ones are restored untouched (a failed forward_backward leaves no trace)."""
    earlier = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        yield
    except BaseException:
        for p, grad in zip(params, earlier, strict=True):
            p.grad = grad
        raise
    for p, grad in zip(params, earlier, strict=True):
        if grad is not None:
            p.grad = grad if p.grad is None else grad.add_(p.grad)


@dataclass(frozen=True)
class _TrainingState:
    """A copy of a client's weights, gradients and optimizer state (to undo a step)."""

    weights: list[torch.Tensor]
    grads: list[torch.Tensor | None]
    optimizer: dict[str, Any]
    steps: int

    @classmethod
    def of(cls, client: _Client) -> _TrainingState:
        params = list(client.params.values())
        return cls(
            weights=[p.detach().clone() for p in params],
            grads=[None if p.grad is None else p.grad.clone() for p in params],
            optimizer=copy.deepcopy(client.optimizer.state_dict()),
            steps=client.steps,
        )

    def restore(self, client: _Client) -> None:
        with torch.no_grad():
            for p, weight, grad in zip(
                client.params.values(), self.weights, self.grads, strict=True
            ):
                p.copy_(weight)
                p.grad = grad
        client.optimizer.load_state_dict(self.optimizer)
        client.steps = self.steps


def _check_adam(adam: AdamConfig) -> None:
    checks = {
        "learning_rate": adam.learning_rate >= 0,
        "beta1": 0 <= adam.beta1 < 1,
        "beta2": 0 <= adam.beta2 < 1,
        "eps": adam.eps >= 0,
        "weight_decay": adam.weight_decay >= 0,
        "grad_clip_norm": adam.grad_clip_norm >= 0,
    }
    for name, ok in checks.items():
        value = getattr(adam, name)
        if not (math.isfinite(value) and ok):
            raise BackendError(f"invalid AdamParams.{name}: {value}")
