"""GSPO's math on small hand-made tensors (``engine.local.compute.losses.gspo``): one importance
ratio per sequence over the tokens ``sequence_ratio_mask`` marks, PPO clipping of that
ratio for the whole sequence, masked and padded tokens ignored, and a gradient that
moves each token's logprob the way its advantage says. The model-level check (values
and LoRA gradients against a reference on the logits) is in test_backend_losses."""

from __future__ import annotations

import math

import pytest
import torch

from engine.local.compute.losses import LossConfigError, resolve

Tensor = torch.Tensor


def _gspo(
    logp: Tensor, logprobs: Tensor, advantages: Tensor, mask: Tensor, **config: float
) -> tuple[Tensor, Tensor]:
    """The per-datum losses and d(sum of losses)/d(logp)."""
    spec, cfg = resolve("gspo", config)
    logp = logp.clone().requires_grad_(True)
    inputs = {"logprobs": logprobs, "advantages": advantages, "sequence_ratio_mask": mask}
    losses = spec.fn(logp, inputs, cfg)
    losses.sum().backward()
    assert logp.grad is not None
    return losses.detach(), logp.grad


def test_the_ratio_is_one_per_sequence_the_geometric_mean_over_the_masked_tokens() -> None:
    logp = torch.tensor([[-1.0, -2.0, -0.5, -3.0]])
    q = torch.tensor([[-1.1, -1.9, -0.2, -3.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    adv = torch.tensor([[0.0, 0.5, 0.5, 0.5]])
    wide = {"clip_low_threshold": 0.0, "clip_high_threshold": 100.0}

    loss, grad = _gspo(logp, q, adv, mask, **wide)

    s = math.exp(((-2.0 + 1.9) + (-0.5 + 0.2) + 0.0) / 3)
    assert float(loss[0]) == pytest.approx(-s * 1.5, rel=1e-6)
    # every token's ratio has the sequence's value and its own logprob's gradient
    torch.testing.assert_close(grad, -s * adv)


def test_tokens_outside_the_mask_and_the_padding_do_not_move_the_ratio() -> None:
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.7, -0.9, 0.0]])
    q = torch.tensor([[-1.0, -2.5, -0.5], [-0.6, -1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])  # row 1: a padded position
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, 0.0]])
    base, _ = _gspo(logp, q, adv, mask)

    far_off = q.clone()
    far_off[0, 2] = -50.0  # an unmasked token whose own ratio would be e^49.5
    moved, _ = _gspo(logp, far_off, adv, mask)
    torch.testing.assert_close(moved, base)

    # the padded row's loss is the row's loss alone
    alone, _ = _gspo(logp[1:, :2], q[1:, :2], adv[1:, :2], mask[1:, :2])
    torch.testing.assert_close(base[1:], alone)


@pytest.mark.parametrize(
    ("log_ratio", "adv", "clipped"),
    [
        (math.log(1.5), 1.0, True),  # s > 1.2, A > 0: the clipped term is the min
        (math.log(0.5), -1.0, True),  # s < 0.8, A < 0: clipped
        (math.log(1.5), -1.0, False),  # s > 1.2, A < 0: the unclipped term is the min
        (math.log(0.5), 1.0, False),  # s < 0.8, A > 0: unclipped
        (0.0, 1.0, False),  # inside the trust region
    ],
)
def test_clipping_keeps_or_drops_the_whole_sequence(
    log_ratio: float, adv: float, clipped: bool
) -> None:
    """Token log-ratios spread by 0.5 around the sequence's: one token's own ratio is
    inside [0.8, 1.2] in each clipped case, so PPO would keep its gradient; GSPO clips
    every token by the ratio they share."""
    logp = torch.tensor([[-1.0, -1.0, -1.0]])
    q = logp - torch.tensor([[log_ratio - 0.5, log_ratio, log_ratio + 0.5]])
    mask = torch.ones(1, 3)
    advantages = torch.full((1, 3), adv)

    _, grad = _gspo(logp, q, advantages, mask)

    if clipped:
        assert torch.equal(grad, torch.zeros_like(grad))
        ppo, cfg = resolve("ppo", None)
        token_level = logp.clone().requires_grad_(True)
        ppo.fn(token_level, {"logprobs": q, "advantages": advantages}, cfg).sum().backward()
        assert token_level.grad is not None
        assert int((token_level.grad != 0).sum()) == 1
    else:
        torch.testing.assert_close(grad, torch.full_like(grad, -math.exp(log_ratio) * adv))


def test_the_gradient_raises_the_logprob_of_good_tokens_and_lowers_bad_ones() -> None:
    logp = torch.log(torch.tensor([[0.3, 0.4, 0.5]]))
    q = logp.clone()  # on policy: s = 1
    mask = torch.ones(1, 3)
    adv = torch.tensor([[2.0, -1.0, 0.0]])

    _, grad = _gspo(logp, q, adv, mask)

    step = logp - 0.01 * grad  # one gradient-descent step on the loss
    assert float(step[0, 0]) > float(logp[0, 0])
    assert float(step[0, 1]) < float(logp[0, 1])
    assert float(step[0, 2]) == float(logp[0, 2])


def test_gspo_takes_the_ppo_clip_config_and_needs_the_mask() -> None:
    spec, cfg = resolve("gspo", {"clip_high_threshold": 1.1})
    assert cfg == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.1, "temperature": 1.0}
    assert "sequence_ratio_mask" in spec.inputs
    assert spec.check is not None
    assert spec.check({"sequence_ratio_mask": torch.tensor([0.0, 1.0])}) is None
    assert "marks no token" in (spec.check({"sequence_ratio_mask": torch.zeros(3)}) or "")
    with pytest.raises(LossConfigError, match="not accepted"):
        resolve("gspo", {"beta": 0.1})
