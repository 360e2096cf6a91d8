"""The values the local server's backend takes and returns: plain Python / torch values,
never JSON or HTTP (the wire layer decodes into them), and its one error type."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from pydantic import BaseModel, ConfigDict

from engine.local.compute.sampling import Request
from engine.local.models.lora import TargetSet

__all__ = [
    "AdamConfig",
    "AdapterSpec",
    "BackendError",
    "DatumIn",
    "ForwardResult",
    "SampleJob",
    "SampledSeq",
    "SampledSequences",
    "SamplerSnapshot",
    "request_of",
]


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


@dataclass(frozen=True)
class SamplerSnapshot:
    """Frozen LoRA tensors a sampler reads (cloned, so later training cannot move them)."""

    rank: int
    targets: TargetSet
    tensors: dict[str, torch.Tensor]


def request_of(job: SampleJob) -> Request:
    """Jobs arrive validated (``engine.local.operations.sampling.sample_job_of``); ``sample``
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
