"""Shared helpers for the backend tests: the shipped model, datums, and the quickstart
RL datum layout (prompt positions carry zero weight/advantage)."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from engine.local.compute.backend import Backend
from engine.local.compute.backend_types import DatumIn, SampleJob
from scripts.make_model import DEFAULT_OUT, parse_int, prompt_text

MODEL_DIR = DEFAULT_OUT


def new_backend(model_dir: Path = MODEL_DIR) -> Backend:
    return Backend(Path(model_dir))


def prompt_ids(backend: Backend, a: int, b: int) -> list[int]:
    return list(backend.tokenizer.encode(prompt_text(a, b)))


def decode_text(backend: Backend, tokens: list[int], skip_special_tokens: bool = False) -> str:
    """The text of one token sequence (transformers types ``decode`` as ``str | list[str]``:
    a batch of sequences decodes to a list)."""
    text = backend.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)
    assert isinstance(text, str)
    return text


def random_datums(
    backend: Backend, n: int, seed: int, *, min_len: int = 5, max_len: int = 20
) -> list[list[int]]:
    """Token sequences drawn uniformly from the vocabulary (lengths vary, to exercise
    padding)."""
    rng = random.Random(seed)
    return [
        [rng.randrange(backend.vocab_size) for _ in range(rng.randint(min_len, max_len))]
        for _ in range(n)
    ]


def rl_datum(
    full: list[int], n_prompt: int, sampler_logprobs: list[float], advantage: float
) -> DatumIn:
    """The quickstart datum: model_input = full[:-1], target_tokens = full[1:], and zero
    weights / logprobs / advantages over the first ``n_prompt - 1`` positions."""
    pad = n_prompt - 1
    m = len(full) - n_prompt
    assert len(sampler_logprobs) == m
    return DatumIn(
        full[:-1],
        {
            "target_tokens": torch.tensor(full[1:]),
            "weights": torch.tensor([0.0] * pad + [1.0] * m),
            "logprobs": torch.tensor([0.0] * pad + list(sampler_logprobs)),
            "advantages": torch.tensor([0.0] * pad + [advantage] * m),
        },
    )


def greedy_exact_rate(
    backend: Backend, sampler: str | None, problems: list[tuple[int, int]]
) -> float:
    jobs = [
        SampleJob(sampler, prompt_ids(backend, a, b), 1, 16, temperature=0.0) for a, b in problems
    ]
    results = backend.sample(jobs)
    hits = 0
    for res, (a, b) in zip(results, problems, strict=True):
        text = decode_text(backend, res.sequences[0].tokens, skip_special_tokens=True)
        hits += parse_int(text) == a + b
    return hits / len(problems)


def lora_params(backend: Backend, model_id: str) -> dict[str, torch.Tensor]:
    """White-box access to a client's LoRA parameters (tests only)."""
    return backend._clients[model_id].params  # type: ignore[return-value]


def assert_close_rel(
    got: torch.Tensor, want: torch.Tensor, tol: float = 1e-4, what: str = ""
) -> None:
    """Compare relative to the tensor's norm: float32 sums in a different order differ
    elementwise where terms cancel, but not in norm."""
    err = float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-12))
    assert err < tol, f"{what}: relative error {err:.2e} (tolerance {tol:.0e})"
