"""A failed training operation leaves no trace in the model state: extreme but finite
loss inputs fail forward_backward with a clear user error before any gradient is kept,
and an optim_step that fails changes neither weights nor optimizer state."""

from __future__ import annotations

import pytest
import torch
from backend_util import lora_params, new_backend, random_datums, rl_datum

from engine.local.compute.backend import Backend
from engine.local.compute.backend_types import AdamConfig, AdapterSpec, BackendError, DatumIn


@pytest.fixture(scope="module")
def backend() -> Backend:
    return new_backend()


def _rl(backend: Backend, sampler_logprob: float, seed: int = 0) -> list[DatumIn]:
    out = []
    for tokens in random_datums(backend, 2, seed, min_len=8, max_len=12):
        n_prompt = 4
        m = len(tokens) - n_prompt
        out.append(rl_datum(tokens, n_prompt, [sampler_logprob] * m, advantage=1.0))
    return out


def _state(backend: Backend, model_id: str) -> dict[str, torch.Tensor | None]:
    params = lora_params(backend, model_id)
    snapshot: dict[str, torch.Tensor | None] = {}
    for name, p in params.items():
        snapshot[f"w/{name}"] = p.detach().clone()
        snapshot[f"g/{name}"] = None if p.grad is None else p.grad.clone()
    return snapshot


def _assert_same(a: dict[str, torch.Tensor | None], b: dict[str, torch.Tensor | None]) -> None:
    assert a.keys() == b.keys()
    for key, value in a.items():
        other = b[key]
        if value is None or other is None:
            assert value is other, key
        else:
            assert torch.equal(value, other), key


def _new_model(backend: Backend, name: str) -> str:
    backend.create_model(name, AdapterSpec(rank=4, seed=3))
    return name


def test_extreme_logprobs_fail_forward_backward_without_touching_gradients(
    backend: Backend,
) -> None:
    model_id = _new_model(backend, "extreme-logprobs")
    backend.forward_backward(
        model_id, _rl(backend, -2.0), "importance_sampling", None, backward=True
    )
    before = _state(backend, model_id)
    with pytest.raises(
        BackendError, match=r"importance_sampling loss is -?inf.*nothing was applied"
    ):
        backend.forward_backward(
            model_id, _rl(backend, -200.0, seed=1), "importance_sampling", None, backward=True
        )
    _assert_same(before, _state(backend, model_id))  # the earlier gradient is kept as it was
    backend.optim_step(model_id, AdamConfig(learning_rate=1e-2))
    assert all(bool(torch.isfinite(p).all()) for p in lora_params(backend, model_id).values())
    assert backend.optimizer_steps(model_id) == 1


def test_a_failed_forward_backward_on_a_fresh_model_leaves_no_gradient(backend: Backend) -> None:
    model_id = _new_model(backend, "no-gradient")
    with pytest.raises(BackendError, match="too extreme"):
        backend.forward_backward(model_id, _rl(backend, -200.0), "ppo", None, backward=True)
    assert all(p.grad is None for p in lora_params(backend, model_id).values())


def test_forward_reports_extreme_inputs_as_a_user_error(backend: Backend) -> None:
    model_id = _new_model(backend, "forward-extreme")
    with pytest.raises(BackendError, match=r"importance_sampling loss is -?inf"):
        backend.forward_backward(
            model_id, _rl(backend, -200.0), "importance_sampling", None, backward=False
        )


def test_an_optim_step_that_would_make_weights_nan_changes_nothing(backend: Backend) -> None:
    model_id = _new_model(backend, "nan-step")
    backend.forward_backward(
        model_id, _rl(backend, -2.0), "importance_sampling", None, backward=True
    )
    backend.optim_step(model_id, AdamConfig(learning_rate=1e-2))
    before = _state(backend, model_id)
    optimizer = backend._clients[model_id].optimizer
    moments = {
        k: {n: t.clone() for n, t in v.items()} for k, v in optimizer.state_dict()["state"].items()
    }
    # eps=0 with a zero gradient (nothing accumulated) divides 0 by 0 in Adam's update.
    with pytest.raises(BackendError, match="would become non-finite"):
        backend.optim_step(model_id, AdamConfig(learning_rate=1e-2, eps=0.0))
    _assert_same(before, _state(backend, model_id))
    after = optimizer.state_dict()["state"]
    for k, v in moments.items():
        for n, t in v.items():
            assert torch.equal(t, after[k][n]), (k, n)
    assert backend.optimizer_steps(model_id) == 1
    backend.optim_step(model_id, AdamConfig(learning_rate=1e-2))  # a sane step still works
    assert backend.optimizer_steps(model_id) == 2


def test_non_finite_gradients_are_refused_before_the_step(backend: Backend) -> None:
    model_id = _new_model(backend, "inf-grad")
    params = lora_params(backend, model_id)
    weights = {k: p.detach().clone() for k, p in params.items()}
    first = next(iter(params.values()))
    first.grad = torch.full_like(first, float("inf"))
    with pytest.raises(BackendError, match="gradient is not finite; it was discarded"):
        backend.optim_step(model_id, AdamConfig(learning_rate=1e-2))
    assert all(torch.equal(p, weights[k]) for k, p in params.items())
    assert all(p.grad is None for p in params.values())
    assert backend.optimizer_steps(model_id) == 0
