"""AdamW against torch.optim.AdamW + clip_grad_norm_, step counting, and the isolation
and determinism of LoRA training clients sharing one base model."""

from __future__ import annotations

import pytest
import torch
from backend_util import lora_params, new_backend, random_datums

from engine.local.compute.backend import Backend
from engine.local.compute.backend_types import (
    AdamConfig,
    AdapterSpec,
    BackendError,
    DatumIn,
    SampleJob,
)


@pytest.fixture(scope="module")
def backend() -> Backend:
    return new_backend()


def _ce_data(backend: Backend, seed: int) -> list[DatumIn]:
    out = []
    for tokens in random_datums(backend, 3, seed):
        targets = torch.tensor(tokens[1:] + tokens[:1])
        out.append(DatumIn(tokens, {"target_tokens": targets, "weights": torch.ones(len(tokens))}))
    return out


def _logprobs(backend: Backend, model_id: str, data: list[DatumIn]) -> list[torch.Tensor]:
    res = backend.forward_backward(model_id, data, "cross_entropy", None, backward=False)
    return [o["logprobs"] for o in res.outputs]


@pytest.mark.parametrize(
    "adam",
    [
        AdamConfig(learning_rate=1e-2),
        AdamConfig(learning_rate=3e-3, beta1=0.8, beta2=0.99, eps=1e-8, weight_decay=0.1),
        AdamConfig(learning_rate=1e-2, weight_decay=0.01, grad_clip_norm=0.5),
    ],
    ids=["defaults", "decay", "clipped"],
)
def test_adamw_matches_torch_adamw_with_clipping(backend: Backend, adam: AdamConfig) -> None:
    model_id = f"adam-{adam}"
    backend.create_model(model_id, AdapterSpec(rank=4, seed=7))
    params = lora_params(backend, model_id)
    names = list(params)  # the backend's order: the clip norm's float sum follows it
    ref = [params[n].detach().clone().requires_grad_(True) for n in names]
    ref_opt = torch.optim.AdamW(
        ref,
        lr=adam.learning_rate,
        betas=(adam.beta1, adam.beta2),
        eps=adam.eps,
        weight_decay=adam.weight_decay,
    )
    clipped_somewhere = False
    for step in range(4):
        backend.forward_backward(
            model_id, _ce_data(backend, step), "cross_entropy", None, backward=True
        )
        for r, n in zip(ref, names, strict=True):
            r.grad = params[n].grad.detach().clone()
        want_norm = torch.linalg.vector_norm(torch.stack([g.grad.norm() for g in ref]))
        if adam.grad_clip_norm > 0:
            clipped_somewhere |= float(want_norm) > adam.grad_clip_norm
            torch.nn.utils.clip_grad_norm_(ref, adam.grad_clip_norm)
        ref_opt.step()

        metrics = backend.optim_step(model_id, adam)

        assert metrics["grad_norm:mean"] == pytest.approx(float(want_norm), rel=1e-6)
        for r, n in zip(ref, names, strict=True):
            assert torch.equal(params[n].detach(), r.detach()), f"step {step}: {n} differs"
            assert params[n].grad is None  # optim_step zeroes the gradients
    assert backend.optimizer_steps(model_id) == 4
    if adam.grad_clip_norm > 0:
        assert clipped_somewhere
    backend.delete_model(model_id)


def test_optim_step_without_gradients_is_still_a_step(backend: Backend) -> None:
    """No forward_backward since the last step counts as a zero gradient: only weight
    decay (and the old momentum) move the weights, and the step is counted."""
    backend.create_model("nograd", AdapterSpec(rank=2, seed=1))
    params = lora_params(backend, "nograd")
    before = {k: p.detach().clone() for k, p in params.items()}
    metrics = backend.optim_step("nograd", AdamConfig(learning_rate=0.1, weight_decay=0.5))
    assert metrics["grad_norm:mean"] == 0.0
    assert backend.optimizer_steps("nograd") == 1
    for k, p in params.items():
        torch.testing.assert_close(p.detach(), before[k] * (1 - 0.1 * 0.5))


@pytest.mark.parametrize(
    ("adam", "field"),
    [
        (AdamConfig(learning_rate=-1.0), "learning_rate"),
        (AdamConfig(beta1=1.0), "beta1"),
        (AdamConfig(beta2=float("nan")), "beta2"),
        (AdamConfig(eps=-1e-8), "eps"),
        (AdamConfig(weight_decay=-0.1), "weight_decay"),
        (AdamConfig(grad_clip_norm=-1.0), "grad_clip_norm"),
    ],
)
def test_bad_adam_params_are_rejected_before_any_change(
    backend: Backend, adam: AdamConfig, field: str
) -> None:
    if not backend.has_model("badadam"):
        backend.create_model("badadam", AdapterSpec(rank=2, seed=1))
    with pytest.raises(BackendError, match=f"AdamParams.{field}"):
        backend.optim_step("badadam", adam)
    assert backend.optimizer_steps("badadam") == 0


def test_clients_share_the_base_but_not_weights_or_optimizer_state(backend: Backend) -> None:
    data = _ce_data(backend, 42)
    backend.create_model("iso-a", AdapterSpec(rank=4, seed=3))
    backend.create_model("iso-b", AdapterSpec(rank=4, seed=3))
    backend.create_model("iso-c", AdapterSpec(rank=8, seed=4, train_mlp=False))
    base_c = _logprobs(backend, "iso-c", data)
    # same seed -> identical initial weights
    for k, p in lora_params(backend, "iso-a").items():
        assert torch.equal(p, lora_params(backend, "iso-b")[k])
    before_b = _logprobs(backend, "iso-b", data)

    for _ in range(3):
        backend.forward_backward("iso-a", data, "cross_entropy", None, backward=True)
        backend.optim_step("iso-a", AdamConfig(learning_rate=1e-2))

    after_a = _logprobs(backend, "iso-a", data)
    assert not torch.equal(after_a[0], before_b[0])  # a trained
    for x, y in zip(_logprobs(backend, "iso-b", data), before_b, strict=True):
        assert torch.equal(x, y)  # b untouched
    for x, y in zip(_logprobs(backend, "iso-c", data), base_c, strict=True):
        assert torch.equal(x, y)  # c untouched
    assert backend.optimizer_steps("iso-b") == 0
    # b, trained the same way, follows a exactly: independent state, same arithmetic
    for _ in range(3):
        backend.forward_backward("iso-b", data, "cross_entropy", None, backward=True)
        backend.optim_step("iso-b", AdamConfig(learning_rate=1e-2))
    for x, y in zip(_logprobs(backend, "iso-b", data), after_a, strict=True):
        assert torch.equal(x, y)


def test_fresh_lora_is_the_base_model_and_seed_controls_init(backend: Backend) -> None:
    data = _ce_data(backend, 1)
    backend.create_model("seed-1", AdapterSpec(rank=4, seed=1))
    backend.create_model("seed-2", AdapterSpec(rank=4, seed=2))
    backend.create_model("seed-1-again", AdapterSpec(rank=4, seed=1))
    p1, p2, p1b = (lora_params(backend, m) for m in ("seed-1", "seed-2", "seed-1-again"))
    a_names = [k for k in p1 if "lora_A" in k]
    assert all(torch.equal(p1[k], p1b[k]) for k in p1)
    assert not any(torch.equal(p1[k], p2[k]) for k in a_names)
    assert all(float(p1[k].detach().abs().max()) == 0.0 for k in p1 if "lora_B" in k)
    # B = 0: a fresh adapter computes exactly the base model
    snapshot = backend.save_sampler("seed-2", None)
    jobs = [
        SampleJob(key, data[0].tokens, 1, 1, temperature=0.0, prompt_logprobs=True)
        for key in (None, snapshot)
    ]
    base, fresh = backend.sample(jobs)
    assert base.prompt_logprobs == fresh.prompt_logprobs


@pytest.mark.parametrize(
    ("flags", "expect"),
    [
        ({}, {"attn", "mlp", "unembed"}),
        ({"train_mlp": False}, {"attn", "unembed"}),
        ({"train_attn": False, "train_unembed": False}, {"mlp"}),
        ({"train_mlp": False, "train_attn": False}, {"unembed"}),
    ],
)
def test_train_flags_choose_the_adapted_layers(
    backend: Backend, flags: dict[str, bool], expect: set[str]
) -> None:
    model_id = f"flags-{sorted(flags.items())}"
    backend.create_model(model_id, AdapterSpec(rank=2, seed=0, **flags))
    kinds = set()
    for name in lora_params(backend, model_id):
        if name.startswith("lm_head"):
            kinds.add("unembed")
        elif ".self_attn." in name:
            kinds.add("attn")
        elif ".mlp." in name:
            kinds.add("mlp")
        else:
            raise AssertionError(name)
    assert kinds == expect
    a_shapes = {tuple(p.shape) for n, p in lora_params(backend, model_id).items() if "lora_A" in n}
    assert all(shape[0] == 2 for shape in a_shapes)


def test_create_model_errors(backend: Backend) -> None:
    with pytest.raises(BackendError, match="at least one of"):
        backend.create_model(
            "none", AdapterSpec(rank=2, train_mlp=False, train_attn=False, train_unembed=False)
        )
    with pytest.raises(BackendError, match="positive integer"):
        backend.create_model("rank0", AdapterSpec(rank=0))
    backend.create_model("dup", AdapterSpec(rank=2))
    with pytest.raises(BackendError, match="already exists"):
        backend.create_model("dup", AdapterSpec(rank=2))
    with pytest.raises(BackendError, match="unknown model_id"):
        backend.optim_step("missing", AdamConfig())
    backend.delete_model("dup")
    assert not backend.has_model("dup")
    backend.create_model("dup", AdapterSpec(rank=2))  # the id is free again
