"""The seven losses and the TIS / MIS options of importance_sampling and ppo: values and
LoRA gradients against a reference written directly on the model's logits (log_softmax +
gather + the loss formula, autograd), PPO/CISPO clipping, sum semantics and gradient
accumulation."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from backend_util import assert_close_rel, lora_params, new_backend, random_datums

from engine.local.compute.backend import Backend
from engine.local.compute.backend_types import AdapterSpec, BackendError, DatumIn

Tensor = torch.Tensor


@pytest.fixture(scope="module")
def backend() -> Backend:
    return new_backend()


def _model_with_nonzero_b(backend: Backend, model_id: str, seed: int) -> None:
    """A fresh client whose B matrices are non-zero, so every LoRA tensor gets gradient."""
    backend.create_model(model_id, AdapterSpec(rank=4, seed=seed))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in lora_params(backend, model_id).items():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)


def _reference_logp(backend: Backend, model_id: str, tokens: list[int], targets: Tensor) -> Tensor:
    """Per-token logprobs straight from the logits (not the backend's code path)."""
    with backend._host.active(backend._clients[model_id].adapter):
        logits = backend._model(input_ids=torch.tensor([tokens])).logits[0]
    return torch.log_softmax(logits.double(), dim=-1).gather(-1, targets[:, None]).squeeze(-1)


def _ce(lp: Tensor, d: dict[str, Tensor], cfg: dict[str, float]) -> Tensor:
    return -(d["weights"] * lp).sum()


def _is(lp: Tensor, d: dict[str, Tensor], cfg: dict[str, float]) -> Tensor:
    return -(torch.exp(lp - d["logprobs"]) * d["advantages"]).sum()


def _mask(r: Tensor, cfg: dict[str, float]) -> Tensor:
    if cfg.get("mask_high", 0.0) == 0:
        return torch.ones_like(r)
    r = r.detach()
    return ((r >= cfg["mask_low"]) & (r <= cfg["mask_high"])).double()


def _tis(lp: Tensor, d: dict[str, Tensor], cfg: dict[str, float]) -> Tensor:
    r = torch.exp(lp - d["logprobs"])
    w = r.clamp(max=cfg["tis_cap"]).detach()
    return -(_mask(r, cfg) * w * d["advantages"] * lp).sum()


def _ppo(lp: Tensor, d: dict[str, Tensor], cfg: dict[str, float]) -> Tensor:
    lo, hi = cfg.get("clip_low_threshold", 0.8), cfg.get("clip_high_threshold", 1.2)
    r = torch.exp(lp - d["logprobs"])
    a = d["advantages"]
    return -(_mask(r, cfg) * torch.minimum(r * a, torch.clamp(r, lo, hi) * a)).sum()


def _cispo(lp: Tensor, d: dict[str, Tensor], cfg: dict[str, float]) -> Tensor:
    lo, hi = cfg.get("clip_low_threshold", 0.8), cfg.get("clip_high_threshold", 1.2)
    w = torch.clamp(torch.exp(lp - d["logprobs"]), lo, hi).detach()
    return -(w * d["advantages"] * lp).sum()


def _dro(lp: Tensor, d: dict[str, Tensor], cfg: dict[str, float]) -> Tensor:
    return -(lp * d["advantages"] - 0.5 * cfg["beta"] * (lp - d["logprobs"]) ** 2).sum()


def _gspo(lp: Tensor, d: dict[str, Tensor], cfg: dict[str, float]) -> Tensor:
    lo, hi = cfg.get("clip_low_threshold", 0.8), cfg.get("clip_high_threshold", 1.2)
    marked = d["sequence_ratio_mask"] != 0
    s = torch.exp((lp - d["logprobs"])[marked].mean()).detach()
    r = s * torch.exp(lp - lp.detach())
    a = d["advantages"]
    return -torch.minimum(r * a, torch.clamp(r, lo, hi) * a).sum()


def _stable_reinforce(lp: Tensor, d: dict[str, Tensor], cfg: dict[str, float]) -> Tensor:
    w = torch.exp(lp - d["logprobs"]).clamp(max=cfg.get("ratio_cap", 2.0)).detach()
    pull = 0.5 * cfg.get("kl_coeff", 0.0) * (lp - d["logprobs"]) ** 2
    return -(d["stability_mask"] * (w * d["advantages"] * lp - pull)).sum()


REFERENCES: dict[str, tuple[Callable[..., Tensor], dict[str, float] | None]] = {
    "cross_entropy": (_ce, None),
    "importance_sampling": (_is, None),
    "ppo": (_ppo, None),
    "ppo_custom_clip": (_ppo, {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05}),
    "ppo_masked": (_ppo, {"mask_low": 0.8, "mask_high": 1.25}),
    "importance_sampling_tis_masked": (_tis, {"tis_cap": 1.1, "mask_low": 0.7, "mask_high": 1.4}),
    "cispo": (_cispo, {"clip_low_threshold": 0.7, "clip_high_threshold": 1.1}),
    "dro": (_dro, {"beta": 0.3}),
    "gspo": (_gspo, {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
    "stable_reinforce": (_stable_reinforce, {"kl_coeff": 0.05, "ratio_cap": 1.2}),
}


def _datums(backend: Backend, model_id: str, seed: int) -> list[DatumIn]:
    """Random sequences; sampler logprobs = current logprobs + noise (ratios around 1,
    some of them outside any clip range)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for tokens in random_datums(backend, 4, seed):
        n = len(tokens)
        targets = torch.randint(0, backend.vocab_size, (n,), generator=gen)
        with torch.no_grad():
            current = _reference_logp(backend, model_id, tokens, targets).float()
        inputs = {
            "target_tokens": targets,
            "weights": torch.rand(n, generator=gen),
            "advantages": torch.randn(n, generator=gen),
            "logprobs": current + 0.3 * torch.randn(n, generator=gen),
            "sequence_ratio_mask": (torch.arange(n) >= n // 3).float(),
            "stability_mask": (torch.arange(n) >= n // 4).float(),
        }
        out.append(DatumIn(tokens, inputs))
    return out


@pytest.mark.parametrize("case", sorted(REFERENCES))
def test_loss_value_and_gradients_match_reference(backend: Backend, case: str) -> None:
    ref_fn, cfg = REFERENCES[case]
    loss_fn = next(name for name in ("ppo", "importance_sampling", case) if case.startswith(name))
    model_id = f"loss-{case}"
    _model_with_nonzero_b(backend, model_id, seed=11)
    data = _datums(backend, model_id, seed=3)
    params = lora_params(backend, model_id)

    result = backend.forward_backward(model_id, data, loss_fn, cfg, backward=True)
    got = {k: p.grad.clone() for k, p in params.items() if p.grad is not None}
    assert set(got) == set(params)

    total = torch.zeros((), dtype=torch.float64)
    for i, d in enumerate(data):
        lp = _reference_logp(backend, model_id, d.tokens, d.inputs["target_tokens"])
        torch.testing.assert_close(result.outputs[i]["logprobs"].double(), lp, rtol=1e-5, atol=1e-5)
        inputs = {k: v.double() for k, v in d.inputs.items()}
        total = total + ref_fn(lp, inputs, dict(cfg or {}))
    names = sorted(params)
    want = torch.autograd.grad(total, [params[n] for n in names])

    assert result.metrics["loss:sum"] == pytest.approx(float(total.detach()), rel=1e-4, abs=1e-4)
    for name, w in zip(names, want, strict=True):
        assert_close_rel(got[name], w, what=name)
    assert any(float(g.abs().max()) > 0 for g in got.values())
    backend.delete_model(model_id)


def _clip_probe(backend: Backend, model_id: str, ratio: float, adv: float) -> dict[str, Tensor]:
    """Gradient of a loss where every token has importance ratio ``ratio`` and
    advantage ``adv``."""
    tokens = random_datums(backend, 1, seed=9)[0]
    targets = torch.tensor(tokens[1:] + tokens[:1])
    res = backend.forward_backward(
        model_id,
        [DatumIn(tokens, {"target_tokens": targets, "weights": torch.ones(len(tokens))})],
        "cross_entropy",
        None,
        backward=False,
    )
    logp = res.outputs[0]["logprobs"]
    q = logp - torch.log(torch.tensor(ratio))
    inputs = {"target_tokens": targets, "logprobs": q, "advantages": torch.full_like(q, adv)}
    backend.forward_backward(model_id, [DatumIn(tokens, inputs)], "ppo", None, backward=True)
    grads = {k: p.grad.clone() for k, p in lora_params(backend, model_id).items()}
    for p in lora_params(backend, model_id).values():
        p.grad = None
    return grads


@pytest.mark.parametrize(
    ("ratio", "adv", "clipped"),
    [
        (1.5, 1.0, True),  # r > 1.2 with A > 0: the clipped term is smaller -> no gradient
        (0.5, -1.0, True),  # r < 0.8 with A < 0: clipped -> no gradient
        (1.5, -1.0, False),  # r > 1.2 with A < 0: unclipped term is the min -> gradient
        (0.5, 1.0, False),  # r < 0.8 with A > 0: unclipped -> gradient
        (1.0, 1.0, False),  # inside the trust region
    ],
)
def test_ppo_clipping_zeroes_gradient_exactly_where_it_should(
    backend: Backend, ratio: float, adv: float, clipped: bool
) -> None:
    model_id = f"ppo-clip-{ratio}-{adv}"
    _model_with_nonzero_b(backend, model_id, seed=5)
    grads = _clip_probe(backend, model_id, ratio, adv)
    largest = max(float(g.abs().max()) for g in grads.values())
    if clipped:
        assert largest == 0.0
    else:
        assert largest > 1e-4
    backend.delete_model(model_id)


def test_losses_are_sums_and_gradients_accumulate_across_calls(backend: Backend) -> None:
    model_id = "accumulate"
    _model_with_nonzero_b(backend, model_id, seed=2)
    data = _datums(backend, model_id, seed=4)
    params = lora_params(backend, model_id)

    whole = backend.forward_backward(model_id, data, "importance_sampling", None, backward=True)
    g_whole = {k: p.grad.clone() for k, p in params.items()}
    for p in params.values():
        p.grad = None
    a = backend.forward_backward(model_id, data[:1], "importance_sampling", None, backward=True)
    b = backend.forward_backward(model_id, data[1:], "importance_sampling", None, backward=True)

    assert a.metrics["loss:sum"] + b.metrics["loss:sum"] == pytest.approx(
        whole.metrics["loss:sum"], rel=1e-5
    )
    for k, p in params.items():
        assert_close_rel(p.grad, g_whole[k], what=k)
    # doubling the data doubles loss and gradient (a sum, not a mean)
    for p in params.values():
        p.grad = None
    twice = backend.forward_backward(
        model_id, data + data, "importance_sampling", None, backward=True
    )
    assert twice.metrics["loss:sum"] == pytest.approx(2 * whole.metrics["loss:sum"], rel=1e-5)
    for k, p in params.items():
        assert_close_rel(p.grad, 2 * g_whole[k], what=k)
    backend.delete_model(model_id)


def test_forward_returns_logprobs_without_touching_gradients(backend: Backend) -> None:
    model_id = "forward-only"
    _model_with_nonzero_b(backend, model_id, seed=1)
    data = _datums(backend, model_id, seed=5)
    params = lora_params(backend, model_id)
    backend.forward_backward(model_id, data[:2], "cross_entropy", None, backward=True)
    before = {k: p.grad.clone() for k, p in params.items()}

    out = backend.forward_backward(model_id, data, "ppo", None, backward=False)

    for k, p in params.items():
        assert torch.equal(p.grad, before[k])
    assert [o["logprobs"].shape[0] for o in out.outputs] == [len(d.tokens) for d in data]
    assert all(o["logprobs"].dtype == torch.float32 for o in out.outputs)
    assert all(float(o["logprobs"].max()) <= 0.0 for o in out.outputs)
    assert all(k.count(":") == 1 for k in out.metrics)
    backend.delete_model(model_id)


def test_micro_batching_does_not_change_results() -> None:
    """A tiny logits budget forces one datum per forward; results must not change."""
    small = new_backend()
    small._logits_budget = 1
    big = new_backend()
    for b in (small, big):
        b.create_model("m", AdapterSpec(rank=4, seed=3))
    data = _datums(big, "m", seed=6)
    r_small = small.forward_backward("m", data, "dro", {"beta": 0.1}, backward=True)
    r_big = big.forward_backward("m", data, "dro", {"beta": 0.1}, backward=True)
    assert r_small.metrics["loss:sum"] == pytest.approx(r_big.metrics["loss:sum"], rel=1e-5)
    for k, p in lora_params(big, "m").items():
        assert_close_rel(lora_params(small, "m")[k].grad, p.grad, what=k)


def _ok_datum(backend: Backend) -> DatumIn:
    tokens = [5, 6, 7, 8]
    return DatumIn(
        tokens,
        {
            "target_tokens": torch.tensor([6, 7, 8, 9]),
            "weights": torch.ones(4),
            "logprobs": torch.zeros(4),
            "advantages": torch.ones(4),
        },
    )


def _with(d: DatumIn, **changes: Any) -> DatumIn:
    inputs = dict(d.inputs)
    tokens = changes.pop("tokens", d.tokens)
    for k, v in changes.items():
        if v is None:
            inputs.pop(k)
        else:
            inputs[k] = v
    return DatumIn(tokens, inputs)


@pytest.mark.parametrize(
    ("make", "loss_fn", "config", "message"),
    [
        (lambda d: _with(d, target_tokens=None), "cross_entropy", None, "missing loss input"),
        (lambda d: _with(d, weights=None), "cross_entropy", None, "'weights'"),
        (lambda d: _with(d, advantages=None), "ppo", None, "'advantages'"),
        (lambda d: _with(d, weights=torch.ones(3)), "cross_entropy", None, "4 tokens"),
        (
            lambda d: _with(d, target_tokens=torch.tensor([1, 2, 3, 10**6])),
            "cross_entropy",
            None,
            "outside the model's vocabulary",
        ),
        (
            lambda d: _with(d, tokens=[1, 2, -3, 4]),
            "cross_entropy",
            None,
            "outside the model's vocabulary",
        ),
        (lambda d: _with(d, tokens=[]), "cross_entropy", None, "empty"),
        (
            lambda d: _with(
                d,
                tokens=[1] * 1000,
                target_tokens=torch.ones(1000, dtype=torch.long),
                weights=torch.ones(1000),
            ),
            "cross_entropy",
            None,
            "max context length",
        ),
        (lambda d: _with(d, target_tokens=torch.ones(4)), "cross_entropy", None, "integers"),
        (
            lambda d: _with(d, advantages=torch.tensor([0.0, float("nan"), 0, 0])),
            "importance_sampling",
            None,
            "NaN",
        ),
        (lambda d: d, "gspo", None, "['sequence_ratio_mask']"),
        (
            lambda d: _with(d, sequence_ratio_mask=torch.zeros(4)),
            "gspo",
            None,
            "datum 0: sequence_ratio_mask marks no token",
        ),
        (lambda d: d, "reinforce", None, "unknown loss_fn 'reinforce'"),
        (lambda d: d, "ppo", {"clip_lo": 0.5}, "not accepted"),
        (lambda d: d, "cross_entropy", {"beta": 0.5}, "not accepted"),
        (lambda d: d, "dro", None, "needs loss_fn_config['beta']"),
        (
            lambda d: d,
            "ppo",
            {"clip_low_threshold": 1.5, "clip_high_threshold": 1.2},
            "clip_low_threshold <= clip_high_threshold",
        ),
    ],
)
def test_bad_training_input_is_a_clear_backend_error(
    backend: Backend,
    make: Callable[[DatumIn], DatumIn],
    loss_fn: str,
    config: dict[str, float] | None,
    message: str,
) -> None:
    if not backend.has_model("validation"):
        backend.create_model("validation", AdapterSpec(rank=2, seed=0))
    datum = make(_ok_datum(backend))
    with pytest.raises(BackendError, match=None) as err:
        backend.forward_backward("validation", [datum], loss_fn, config, backward=True)
    assert message in str(err.value)
    assert all(p.grad is None for p in lora_params(backend, "validation").values())


def test_unknown_model_and_empty_batch_are_errors(backend: Backend) -> None:
    with pytest.raises(BackendError, match="unknown model_id 'nope'"):
        backend.forward_backward("nope", [], "cross_entropy", None, backward=True)
    backend.create_model("empty", AdapterSpec(rank=2, seed=0))
    with pytest.raises(BackendError, match="at least one datum"):
        backend.forward_backward("empty", [], "cross_entropy", None, backward=True)
