"""Tinker's training losses, per datum, as SUMS over tokens.

Each loss maps the training policy's per-token logprobs ``logp`` (N,) and the datum's
dense loss inputs to a scalar, or a batch of right-padded datums (B, T) to their (B,)
losses (the padding must hold zero logp and zero inputs, which makes every term there
0); the backend sums these over datums. Semantics follow the wire protocol
(docs/architecture.md, "Wire facts"): the inputs are already aligned
(``logp[i]`` scores ``target_tokens[i]``) and nothing is averaged, so gradients from
several ``forward_backward`` calls add up exactly as one bigger call would.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

Tensor = torch.Tensor


class LossConfigError(ValueError):
    """An unknown loss name or a bad ``loss_fn_config``."""


@dataclass(frozen=True)
class LossDefinition:
    """What a loss needs from each datum and which config keys it accepts (with defaults)."""

    fn: Callable[[Tensor, Mapping[str, Tensor], Mapping[str, float]], Tensor]
    inputs: tuple[str, ...]
    config: Mapping[str, float | None]  # None: required key without a default
    check: Callable[[Mapping[str, Tensor]], str | None] | None = None
    """What is wrong with one datum's inputs for this loss beyond shapes, or None."""


def _ratio(logp: Tensor, inputs: Mapping[str, Tensor]) -> Tensor:
    return torch.exp(logp - inputs["logprobs"])


def cross_entropy(logp: Tensor, inputs: Mapping[str, Tensor], cfg: Mapping[str, float]) -> Tensor:
    return -(inputs["weights"] * logp).sum(-1)


def _kept(ratio: Tensor, cfg: Mapping[str, float]) -> Tensor | float:
    """MIS / IcePop: 1 where the ratio lies in [mask_low, mask_high], else 0 (no mask
    while ``mask_high`` is 0)."""
    if cfg["mask_high"] <= 0:
        return 1.0
    r = ratio.detach()
    return ((r >= cfg["mask_low"]) & (r <= cfg["mask_high"])).to(ratio.dtype)


def importance_sampling(
    logp: Tensor, inputs: Mapping[str, Tensor], cfg: Mapping[str, float]
) -> Tensor:
    """``-(r * A)``; with ``tis_cap`` C > 0 the truncated form ``-(sg(min(r, C)) * A *
    logp)`` (TIS); ``mask_low``/``mask_high`` drop tokens whose ratio is outside them."""
    ratio = _ratio(logp, inputs)
    adv = inputs["advantages"]
    if cfg["tis_cap"] > 0:
        terms = ratio.detach().clamp(max=cfg["tis_cap"]) * adv * logp
    else:
        terms = ratio * adv
    return -(_kept(ratio, cfg) * terms).sum(-1)


def ppo(logp: Tensor, inputs: Mapping[str, Tensor], cfg: Mapping[str, float]) -> Tensor:
    ratio = _ratio(logp, inputs)
    adv = inputs["advantages"]
    clipped = ratio.clamp(cfg["clip_low_threshold"], cfg["clip_high_threshold"])
    return -(_kept(ratio, cfg) * torch.minimum(ratio * adv, clipped * adv)).sum(-1)


def cispo(logp: Tensor, inputs: Mapping[str, Tensor], cfg: Mapping[str, float]) -> Tensor:
    ratio = _ratio(logp, inputs).detach()
    clipped = ratio.clamp(cfg["clip_low_threshold"], cfg["clip_high_threshold"])
    return -(clipped * inputs["advantages"] * logp).sum(-1)


def dro(logp: Tensor, inputs: Mapping[str, Tensor], cfg: Mapping[str, float]) -> Tensor:
    adv = inputs["advantages"]
    quad = (logp - inputs["logprobs"]) ** 2
    return -(logp * adv - 0.5 * cfg["beta"] * quad).sum(-1)


def gspo(logp: Tensor, inputs: Mapping[str, Tensor], cfg: Mapping[str, float]) -> Tensor:
    """GSPO-token (Zheng et al. 2025, as hosted Tinker defines it): every token's ratio
    has the value of its sequence's ratio, exp(mean log(p/q) over the tokens
    ``sequence_ratio_mask`` marks), and the gradient of its own logprob; clipped like PPO."""
    in_ratio = (inputs["sequence_ratio_mask"] != 0).to(logp.dtype)
    log_q = inputs["logprobs"]
    count = in_ratio.sum(-1, keepdim=True)
    log_ratio = ((logp.detach() - log_q) * in_ratio).sum(-1, keepdim=True) / count
    ratio = torch.exp(log_ratio + logp - logp.detach())
    adv = inputs["advantages"]
    clipped = ratio.clamp(cfg["clip_low_threshold"], cfg["clip_high_threshold"])
    return -torch.minimum(ratio * adv, clipped * adv).sum(-1)


def stable_reinforce(
    logp: Tensor, inputs: Mapping[str, Tensor], cfg: Mapping[str, float]
) -> Tensor:
    """REINFORCE weighted by the truncated, stop-gradient ratio to the recorded sampler
    policy, with a quadratic pull towards it (docs/losses.md): on the positions the
    server found recorded (``stability_mask``),
    ``-(sg(min(r, ratio_cap)) * A * logp - kl_coeff * (logp - q)**2 / 2)``."""
    recorded = inputs["stability_mask"]
    log_q = inputs["logprobs"]
    weight = _ratio(logp, inputs).detach().clamp(max=cfg["ratio_cap"])
    pull = 0.5 * cfg["kl_coeff"] * (logp - log_q) ** 2
    return -(recorded * (weight * inputs["advantages"] * logp - pull)).sum(-1)


def _marks_a_token(inputs: Mapping[str, Tensor]) -> str | None:
    if bool((inputs["sequence_ratio_mask"] != 0).any()):
        return None
    return "sequence_ratio_mask marks no token; gspo's sequence ratio needs at least one"


_T = {"temperature": 1.0}
"""The RL losses score the targets under the logits divided by ``temperature``: set it to
the sampling temperature and the trainer's policy is the one the sampler drew from, so
the on-policy ratio is 1 (local server only; docs/losses.md)."""
_CLIP = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2, **_T}
_MASK = {"mask_low": 0.0, "mask_high": 0.0}
"""Off-policy masking (MIS / IcePop) of importance_sampling and ppo; off while mask_high
is 0 (docs/losses.md)."""
_RL_INPUTS = ("target_tokens", "logprobs", "advantages")

LOSSES: dict[str, LossDefinition] = {
    "cross_entropy": LossDefinition(cross_entropy, ("target_tokens", "weights"), {}),
    "importance_sampling": LossDefinition(
        importance_sampling, _RL_INPUTS, {"tis_cap": 0.0, **_MASK, **_T}
    ),
    "ppo": LossDefinition(ppo, _RL_INPUTS, {**_CLIP, **_MASK}),
    "cispo": LossDefinition(cispo, _RL_INPUTS, _CLIP),
    "dro": LossDefinition(dro, _RL_INPUTS, {"beta": None, **_T}),
    "gspo": LossDefinition(gspo, (*_RL_INPUTS, "sequence_ratio_mask"), _CLIP, _marks_a_token),
    "stable_reinforce": LossDefinition(
        stable_reinforce,
        (*_RL_INPUTS, "stability_mask"),
        {"kl_coeff": 0.0, "ratio_cap": 2.0, **_T},
    ),
}
STABILITY_LOSSES = frozenset({"stable_reinforce"})
"""Losses whose behaviour logprobs come from the server's stability records
(``engine.local.compute.stability``), not from the datum."""


def resolve(
    loss_fn: str, config: Mapping[str, float] | None
) -> tuple[LossDefinition, dict[str, float]]:
    """The loss spec and its full config (defaults filled in); clear errors otherwise."""
    spec = LOSSES.get(loss_fn)
    if spec is None:
        raise LossConfigError(
            f"unknown loss_fn {loss_fn!r}; supported: {', '.join(sorted(LOSSES))}"
        )
    given = dict(config or {})
    unknown = sorted(set(given) - set(spec.config))
    if unknown:
        allowed = ", ".join(sorted(spec.config)) or "none"
        raise LossConfigError(
            f"loss_fn_config keys {unknown} are not accepted by {loss_fn!r} (accepted: {allowed})"
        )
    resolved: dict[str, float] = {}
    for key, default in spec.config.items():
        value = given.get(key, default)
        if value is None:
            raise LossConfigError(f"loss {loss_fn!r} needs loss_fn_config[{key!r}]")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise LossConfigError(f"loss_fn_config[{key!r}] must be a number, got {value!r}")
        resolved[key] = float(value)
    if resolved.get("kl_coeff", 0.0) < 0 or resolved.get("ratio_cap", 1.0) <= 0:
        raise LossConfigError("need kl_coeff >= 0 and ratio_cap > 0")
    if resolved.get("tis_cap", 0.0) < 0:
        raise LossConfigError(f"need tis_cap >= 0 (0: off), got {resolved['tis_cap']}")
    mask_low, mask_high = resolved.get("mask_low", 0.0), resolved.get("mask_high", 0.0)
    if mask_high != 0 and not 0 <= mask_low < mask_high:
        raise LossConfigError(
            f"need 0 <= mask_low < mask_high (mask_high 0: off), got {mask_low} and {mask_high}"
        )
    if not resolved.get("temperature", 1.0) > 0:
        raise LossConfigError(
            f"loss_fn_config temperature must be > 0, got {resolved['temperature']}"
        )
    lo, hi = resolved.get("clip_low_threshold"), resolved.get("clip_high_threshold")
    if lo is not None and hi is not None and not 0.0 <= lo <= hi:
        raise LossConfigError(
            f"need 0 <= clip_low_threshold <= clip_high_threshold, got {lo} and {hi}"
        )
    return spec, resolved
