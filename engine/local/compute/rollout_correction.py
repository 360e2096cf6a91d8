"""MinT's session-level rollout correction: ``create_model(rollout_correction_config=...)``
applied inside every later ``forward_backward(loss_fn="importance_sampling")`` of that model.

The keys follow verl's rollout-correction settings (``verl/trainer/ppo/rollout_corr_helper.py``
and ``compute_policy_loss_bypass_mode`` in ``core_algos.py``), as MinT's
``advanced/validate_mis_rollout_correction.py`` sends them. With ``lr = sg(logp) - q`` on the
datum's response positions ``m`` (where ``logprobs`` or ``advantages`` is non-zero: the
wire carries no mask, and prompt positions hold zero in both):

- IS weights ``w`` (``rollout_is``): ``token``: ``exp(lr)``; ``sequence``: ``exp(sum_m lr)``
  on every token (log ratios clamped to +-20). ``rollout_is_threshold`` U truncates,
  ``w = min(w, U)`` (TIS); a ``"L_U"`` string zeroes weights outside [L, U] (IcePop).
  Unset: ``w = 1``.
- Rejection (``rollout_rs``, comma-separated options, all must pass): ``token_k1`` keeps a
  token when ``log L <= -lr <= log U``; ``seq_sum_k1`` / ``seq_mean_k1`` the same on the
  sum / mean of ``-lr`` over ``m``; ``*_k2`` (``lr^2 / 2``) and ``*_k3``
  (``exp(lr) - 1 - lr``) keep a value ``<= U``; ``seq_max_k2/k3`` the sequence's largest.
  ``rollout_rs_threshold``: ``"L_U"`` or one number U (k1: L = 1/U), or one per option.
  Rejected tokens leave the loss: ``m' = m * keep``.
- The loss (a SUM, as every Tinker loss): ``bypass_mode`` true, ``loss_type`` ``reinforce``:
  ``-sum(m' * w * A * logp)``; ``ppo_clip``: verl's PPO with ``r = exp(logp - q)``, clip
  [0.8, 1.2] and dual clip 3 for negative advantages. ``bypass_mode`` false (verl's
  decoupled mode, whose proximal policy is the current weights with one update per batch):
  ``-sum(m' * w * A * exp(logp - sg(logp)))``, REINFORCE's gradient weighted by ``w``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

Tensor = torch.Tensor

SAFETY_BOUND = 20.0
"""verl's clamp on log ratios before exponentiating."""
PPO_CLIP = 0.2
PPO_DUAL_CLIP = 3.0
"""verl's ``clip_ratio`` and ``clip_ratio_c`` defaults (its ``compute_policy_loss_vanilla``)."""
IS_LEVELS = ("token", "sequence")
LOSS_TYPES = ("ppo_clip", "reinforce")
RS_OPTIONS = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)
KEYS = (
    "rollout_is",
    "rollout_is_threshold",
    "rollout_rs",
    "rollout_rs_threshold",
    "bypass_mode",
    "loss_type",
)


class RolloutCorrectionError(ValueError):
    """A bad ``rollout_correction_config``; the message names the key."""


@dataclass(frozen=True)
class RsOption:
    name: str
    lower: float | None
    """k1 options only: the lower ratio bound."""
    upper: float


@dataclass(frozen=True)
class RolloutCorrection:
    rollout_is: str | None
    is_upper: float
    is_lower: float | None
    """Set: IcePop (weights outside [is_lower, is_upper] become 0); None: TIS."""
    rs: tuple[RsOption, ...]
    bypass_mode: bool
    loss_type: str


def parse(config: object) -> RolloutCorrection:
    """The validated config; RolloutCorrectionError naming the bad key otherwise."""
    if not isinstance(config, Mapping):
        raise RolloutCorrectionError("rollout_correction_config must be a JSON object")
    unknown = sorted(set(config) - set(KEYS))
    if unknown:
        raise RolloutCorrectionError(
            f"rollout_correction_config key(s) {', '.join(map(repr, unknown))} are not "
            f"supported (supported: {', '.join(KEYS)})"
        )
    level = config.get("rollout_is")
    if level is not None and level not in IS_LEVELS:
        raise RolloutCorrectionError(
            f"rollout_correction_config rollout_is must be one of {', '.join(IS_LEVELS)} or "
            f"null, got {level!r}"
        )
    lower, upper = _bounds(config.get("rollout_is_threshold", 2.0), "rollout_is_threshold")
    loss_type = config.get("loss_type", "ppo_clip")
    if loss_type not in LOSS_TYPES:
        raise RolloutCorrectionError(
            f"rollout_correction_config loss_type must be one of {', '.join(LOSS_TYPES)}, "
            f"got {loss_type!r}"
        )
    bypass = config.get("bypass_mode", False)
    if not isinstance(bypass, bool):
        raise RolloutCorrectionError(
            f"rollout_correction_config bypass_mode must be true or false, got {bypass!r}"
        )
    return RolloutCorrection(
        level,
        upper,
        lower,
        _rs_options(config.get("rollout_rs"), config.get("rollout_rs_threshold")),
        bypass,
        loss_type,
    )


def _number(text: object, key: str) -> float:
    try:
        value = float(text)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        value = math.nan
    if isinstance(text, bool) or not (math.isfinite(value) and value > 0):
        raise RolloutCorrectionError(
            f"rollout_correction_config {key} must hold positive numbers, got {text!r}"
        )
    return value


def _bounds(spec: object, key: str) -> tuple[float | None, float]:
    """(lower or None, upper) from a number, "U" or "L_U"."""
    if isinstance(spec, str) and "_" in spec:
        low_text, high_text = spec.split("_", 1)
        lower, upper = _number(low_text, key), _number(high_text, key)
        if lower > upper:
            raise RolloutCorrectionError(
                f"rollout_correction_config {key}: the lower bound exceeds the upper, got {spec!r}"
            )
        return lower, upper
    return None, _number(spec, key)


def _rs_options(names: object, thresholds: object) -> tuple[RsOption, ...]:
    if names is None:
        return ()
    options = [n.strip() for n in names.split(",") if n.strip()] if isinstance(names, str) else []
    bad = [n for n in options if n not in RS_OPTIONS]
    if not options or bad:
        raise RolloutCorrectionError(
            f"rollout_correction_config rollout_rs must list options of {', '.join(RS_OPTIONS)}, "
            f"got {names!r}"
        )
    if thresholds is None:
        raise RolloutCorrectionError(
            "rollout_correction_config rollout_rs needs rollout_rs_threshold"
        )
    specs: list[object] = (
        [s.strip() for s in thresholds.split(",")] if isinstance(thresholds, str) else [thresholds]
    )
    if len(specs) not in (1, len(options)):
        raise RolloutCorrectionError(
            f"rollout_correction_config rollout_rs_threshold needs one threshold or one per "
            f"rollout_rs option ({len(options)}), got {thresholds!r}"
        )
    specs = specs * len(options) if len(specs) == 1 else specs
    parsed = []
    for name, spec in zip(options, specs, strict=True):
        lower, upper = _bounds(spec, "rollout_rs_threshold")
        if name.endswith("k1"):
            parsed.append(RsOption(name, 1.0 / upper if lower is None else lower, upper))
        elif lower is not None:
            raise RolloutCorrectionError(
                f"rollout_correction_config rollout_rs_threshold for {name} takes one upper "
                f"bound, got {spec!r}"
            )
        else:
            parsed.append(RsOption(name, None, upper))
    return tuple(parsed)


def loss(logp: Tensor, inputs: Mapping[str, Tensor], rc: RolloutCorrection) -> Tensor:
    """The corrected importance_sampling loss of datums (N,) or right-padded (B, T)."""
    q, adv = inputs["logprobs"], inputs["advantages"]
    mask = ((q != 0) | (adv != 0)).to(logp.dtype)
    log_ratio = ((logp.detach() - q) * mask).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    keep = mask * _kept(log_ratio, mask, rc.rs)
    weights = _weights(log_ratio, mask, rc)
    if not rc.bypass_mode:
        terms = weights * adv * torch.exp(logp - logp.detach())
    elif rc.loss_type == "reinforce":
        terms = weights * adv * logp
    else:
        ratio = torch.exp(logp - q)
        clipped = torch.minimum(ratio * adv, ratio.clamp(1 - PPO_CLIP, 1 + PPO_CLIP) * adv)
        terms = torch.where(adv < 0, torch.maximum(clipped, PPO_DUAL_CLIP * adv), clipped)
    return -(keep * terms).sum(-1)


def _weights(log_ratio: Tensor, mask: Tensor, rc: RolloutCorrection) -> Tensor | float:
    if rc.rollout_is is None:
        return 1.0
    if rc.rollout_is == "sequence":
        log_ratio = log_ratio.sum(-1, keepdim=True).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    raw = torch.exp(log_ratio) * mask
    if rc.is_lower is None:
        return raw.clamp(max=rc.is_upper)
    return torch.where((raw >= rc.is_lower) & (raw <= rc.is_upper), raw, 0.0)


def _kept(log_ratio: Tensor, mask: Tensor, options: tuple[RsOption, ...]) -> Tensor | float:
    keep: Tensor | float = 1.0
    for option in options:
        kind, estimator = option.name.rsplit("_", 1)
        stat = {
            "k1": -log_ratio,
            "k2": 0.5 * log_ratio**2,
            "k3": torch.exp(log_ratio) - 1 - log_ratio,
        }[estimator] * mask
        if kind == "seq_sum":
            stat = stat.sum(-1, keepdim=True)
        elif kind == "seq_mean":
            stat = stat.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
        elif kind == "seq_max":
            stat = stat.masked_fill(mask == 0, -math.inf).amax(-1, keepdim=True)
        if option.lower is not None:
            passed = (stat >= math.log(option.lower)) & (stat <= math.log(option.upper))
        else:
            passed = stat <= option.upper
        keep = keep * passed.to(log_ratio.dtype)
    return keep
