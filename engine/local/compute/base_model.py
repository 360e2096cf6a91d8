"""Loading the local server's base model: a Hugging Face causal-LM directory read into
float32 torch weights, frozen, with what the backend reads off it (its context length,
padding and end-of-sequence ids), and torch's intra-op threads set for its size."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from engine.local.compute.backend_types import BackendError

__all__ = ["BaseModel", "auto_threads", "load_base_model"]

SMALL_MODEL_PARAMS = 20_000_000
"""Below this many parameters a model is small (see :func:`auto_threads`)."""


def auto_threads(model: torch.nn.Module) -> int:
    """One thread for small models: their matmuls are too small to gain from intra-op
    parallelism, and when the CPUs are shared (engine, server and scoring on 2 cores)
    OpenMP barriers stall on descheduled threads: one RL step of the default model took
    ~130 ms with 1 thread but up to ~2 s with 2 threads on a loaded 2-core machine.
    Larger models leave one core to the engine and the HTTP server in the same process:
    SmolLM2-135M sampled 8 responses in 7.5 s with 1 thread and 294 s with 2 on that
    machine (``engine.run --local-model smollm2-135m``, load average 6-9)."""
    return 1 if n_params(model) < SMALL_MODEL_PARAMS else max(1, torch.get_num_threads() - 1)


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@dataclass(frozen=True)
class BaseModel:
    model_dir: Path
    """Absolute; also the tokenizer directory."""
    model: Any
    tokenizer: Any
    vocab_size: int
    max_context_length: int
    pad_id: int
    eos_ids: frozenset[int]

    @property
    def small(self) -> bool:
        return n_params(self.model) < SMALL_MODEL_PARAMS


def load_base_model(model_dir: Path, num_threads: int | None) -> BaseModel:
    """Load ``model_dir`` frozen, in float32 with deterministic torch algorithms (equal
    inputs give equal bits), and set torch's (process-wide) intra-op threads to
    ``num_threads`` (None: :func:`auto_threads`); a directory that is not a model raises
    :class:`BackendError`."""
    model_dir = Path(model_dir).expanduser().resolve()
    if not (model_dir / "config.json").is_file():
        raise BackendError(f"{model_dir} is not a Hugging Face model directory (no config.json)")
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
    torch.set_num_threads(num_threads or auto_threads(model))
    pad = tokenizer.pad_token_id
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer.eos_token_id is not None:
        eos_ids.add(int(tokenizer.eos_token_id))
    return BaseModel(
        model_dir,
        model,
        tokenizer,
        int(model.get_output_embeddings().weight.shape[0]),
        int(getattr(model.config, "max_position_embeddings", None) or tokenizer.model_max_length),
        int(pad if pad is not None else tokenizer.eos_token_id or 0),
        frozenset(int(e) for e in eos_ids),
    )
