"""Torch compute backend of the local MinT-compatible server.

CONTRACT (shared by the HTTP layer in ``engine/local/app.py`` and this module; change
only together): every method is called from ONE compute thread owned by the server, so
the backend needs no locking; it never sees JSON or HTTP, only plain Python / torch
values; every user-caused problem raises ``BackendError`` with a clear message (the
server turns it into a ``RequestFailedError`` with category "user").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


class BackendError(Exception):
    """A request the backend cannot honour (bad shapes, unknown loss, unknown model...)."""


@dataclass(frozen=True)
class LoraSpec:
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


@dataclass(frozen=True)
class AdamConfig:
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


@dataclass(frozen=True)
class SampledSeq:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str  # "length" | "stop"


@dataclass(frozen=True)
class SampleResult:
    sequences: list[SampledSeq]
    prompt_logprobs: list[float | None] | None = None  # first entry None
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = None


@dataclass(frozen=True)
class ForwardResult:
    outputs: list[dict[str, torch.Tensor]]  # per datum, at least {"logprobs": (N,)}
    metrics: dict[str, float]  # keys "name:reduction", at least "loss:sum"


class Backend:
    """Loads one local Hugging Face causal-LM directory and serves many LoRA training
    clients and frozen sampler snapshots on top of it."""

    model_name: str  # the name clients pass as base_model
    model_dir: Path  # absolute; also the tokenizer directory
    max_context_length: int

    def __init__(self, model_dir: Path, *, model_name: str | None = None) -> None:
        raise NotImplementedError

    def create_model(self, model_id: str, spec: LoraSpec) -> None:
        raise NotImplementedError

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
        raise NotImplementedError

    def optim_step(self, model_id: str, adam: AdamConfig) -> dict[str, float]:
        raise NotImplementedError

    def save_sampler(self, model_id: str, dest: Path | None) -> str:
        """Freeze the current LoRA weights as a sampler snapshot (written to ``dest`` when
        given, so it survives a restart) and return its key."""
        raise NotImplementedError

    def load_sampler(self, src: Path) -> str:
        """Load a snapshot written by ``save_sampler`` (or a state from ``save_state``)."""
        raise NotImplementedError

    def save_state(self, model_id: str, dest: Path) -> None:
        """Weights + optimizer state + metadata (base model, LoRA spec, step count)."""
        raise NotImplementedError

    def load_state(self, model_id: str, src: Path, *, optimizer: bool) -> None:
        raise NotImplementedError

    @staticmethod
    def read_state_info(src: Path) -> dict[str, Any]:
        """{"base_model", "is_lora", "lora_rank", ...} of a saved state or sampler."""
        raise NotImplementedError

    def sample(self, jobs: list[SampleJob]) -> list[SampleResult]:
        """Run many asample requests as one batched computation (per snapshot)."""
        raise NotImplementedError

    def optimizer_steps(self, model_id: str) -> int:
        """How many optim_steps this model has applied (for the chaos tests)."""
        raise NotImplementedError
