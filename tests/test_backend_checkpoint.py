"""save_state / load_state: bit-for-bit resume in a fresh backend, optimizer reset,
metadata, and clear errors for foreign or mismatched checkpoints."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from backend_util import lora_params, new_backend, random_datums

from engine.local.compute.backend import Backend
from engine.local.compute.backend_types import AdamConfig, AdapterSpec, BackendError, DatumIn

ADAM = AdamConfig(learning_rate=5e-3, weight_decay=0.01, grad_clip_norm=1.0)
SPEC = AdapterSpec(rank=4, seed=9, train_unembed=False)


def _batch(backend: Backend, step: int) -> list[DatumIn]:
    out = []
    gen = torch.Generator().manual_seed(step)
    for t in random_datums(backend, 3, 100 + step):
        n = len(t)
        out.append(
            DatumIn(
                t,
                {
                    "target_tokens": torch.tensor(t[1:] + t[:1]),
                    "logprobs": -5.0 + 0.1 * torch.randn(n, generator=gen),
                    "advantages": torch.randn(n, generator=gen),
                },
            )
        )
    return out


def _train(backend: Backend, model_id: str, steps: range) -> None:
    for step in steps:
        backend.forward_backward(model_id, _batch(backend, step), "ppo", None, backward=True)
        backend.optim_step(model_id, ADAM)


def _probe(backend: Backend, model_id: str) -> list[torch.Tensor]:
    res = backend.forward_backward(model_id, _batch(backend, 999), "ppo", None, backward=False)
    return [o["logprobs"] for o in res.outputs]


def test_resume_with_optimizer_continues_bit_for_bit(tmp_path: Path) -> None:
    first = new_backend()
    first.create_model("run", SPEC)
    _train(first, "run", range(3))
    first.save_state("run", tmp_path / "step3")
    _train(first, "run", range(3, 5))

    info = Backend.read_state_info(tmp_path / "step3")
    assert info["base_model"] == first.model_name
    assert info["is_lora"] is True and info["lora_rank"] == 4
    assert info["optimizer_steps"] == 3 and info["train_unembed"] is False

    second = new_backend()  # a new process would look the same: nothing shared in memory
    second.create_model("resumed", AdapterSpec(rank=info["lora_rank"], train_unembed=False))
    second.load_state("resumed", tmp_path / "step3", optimizer=True)
    assert second.optimizer_steps("resumed") == 3
    _train(second, "resumed", range(3, 5))

    assert second.optimizer_steps("resumed") == first.optimizer_steps("run") == 5
    for k, p in lora_params(first, "run").items():
        assert torch.equal(p, lora_params(second, "resumed")[k]), k
    for a, b in zip(_probe(first, "run"), _probe(second, "resumed"), strict=True):
        assert torch.equal(a, b)


def test_load_without_optimizer_resets_adam_state(tmp_path: Path) -> None:
    b = new_backend()
    b.create_model("src", SPEC)
    _train(b, "src", range(3))
    b.save_state("src", tmp_path / "s")
    b.create_model("weights-only", SPEC)
    b.load_state("weights-only", tmp_path / "s", optimizer=False)
    assert b.optimizer_steps("weights-only") == 0
    for k, p in lora_params(b, "src").items():
        assert torch.equal(p, lora_params(b, "weights-only")[k])

    # equivalent to a brand-new optimizer started from the saved weights
    b.create_model("fresh-adam", SPEC)
    b.load_state("fresh-adam", tmp_path / "s", optimizer=False)
    _train(b, "weights-only", range(3, 4))
    _train(b, "fresh-adam", range(3, 4))
    _train(b, "src", range(3, 4))
    for k, p in lora_params(b, "weights-only").items():
        assert torch.equal(p, lora_params(b, "fresh-adam")[k])
    assert any(
        not torch.equal(p, lora_params(b, "src")[k])
        for k, p in lora_params(b, "weights-only").items()
    )


def test_load_state_drops_pending_gradients(tmp_path: Path) -> None:
    b = new_backend()
    b.create_model("g", SPEC)
    b.save_state("g", tmp_path / "s")
    b.forward_backward("g", _batch(b, 0), "ppo", None, backward=True)
    b.load_state("g", tmp_path / "s", optimizer=True)
    assert all(p.grad is None for p in lora_params(b, "g").values())


def test_checkpoint_errors_are_clear(tmp_path: Path) -> None:
    b = new_backend()
    b.create_model("m", SPEC)
    b.save_state("m", tmp_path / "state")
    b.save_sampler("m", tmp_path / "sampler")

    with pytest.raises(BackendError, match="not a saved checkpoint"):
        b.load_state("m", tmp_path / "missing", optimizer=False)
    with pytest.raises(BackendError, match="not a saved checkpoint"):
        Backend.read_state_info(tmp_path / "missing")
    with pytest.raises(BackendError, match="no optimizer state"):
        b.load_state("m", tmp_path / "sampler", optimizer=True)
    b.create_model("other-rank", AdapterSpec(rank=8, train_unembed=False))
    with pytest.raises(BackendError, match="rank-4 LoRA"):
        b.load_state("other-rank", tmp_path / "state", optimizer=False)
    b.create_model("other-layers", AdapterSpec(rank=4))
    with pytest.raises(BackendError, match="rank-4 LoRA"):
        b.load_state("other-layers", tmp_path / "state", optimizer=False)

    meta_path = tmp_path / "state" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**meta, "base_model": "someone/else"}))
    with pytest.raises(BackendError, match="base model 'someone/else'"):
        b.load_state("m", tmp_path / "state", optimizer=True)
    with pytest.raises(BackendError, match="base model 'someone/else'"):
        b.load_sampler(tmp_path / "state")

    shutil.copytree(tmp_path / "sampler", tmp_path / "corrupt")
    (tmp_path / "corrupt" / "adapter.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(BackendError, match="cannot read tensors"):
        b.load_sampler(tmp_path / "corrupt")


def test_saving_over_an_existing_checkpoint_replaces_it(tmp_path: Path) -> None:
    b = new_backend()
    b.create_model("m", SPEC)
    b.save_state("m", tmp_path / "s")
    _train(b, "m", range(2))
    b.save_state("m", tmp_path / "s")
    assert Backend.read_state_info(tmp_path / "s")["optimizer_steps"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]  # no temp dirs left behind


def test_backend_rejects_a_directory_without_a_model(tmp_path: Path) -> None:
    with pytest.raises(BackendError, match=r"no config\.json"):
        Backend(tmp_path)
