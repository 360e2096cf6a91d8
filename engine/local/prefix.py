"""Shared-prefix forward for training batches: compute each common prompt once.

RL batches hold several samples per prompt (the quickstart's group), so most of every
datum's tokens repeat the same prompt. Instead of running the full padded batch, the
backend can run each shared prefix once, with a KV cache, and then only the datums'
distinct suffixes on top of their prefix's cache (rows of the cache replicated per datum).
The math is the same as the plain forward (every position sees the same tokens at the
same positions); gradients of the shared prefix are summed over its datums by autograd.

Grouping is a heuristic that only decides speed, never results: datums are sorted by
tokens, a run of neighbours sharing most of their leading tokens becomes one group, and
the plan is used only when it cuts the padded token count substantially.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from engine.local.datums import CheckedDatum, PaddedBatch

Tensor = torch.Tensor

_MIN_PREFIX = 4
"""Shortest prefix worth sharing, in tokens."""
_KEEP_FRACTION = 0.75
"""A datum joins the current group only if the shared prefix keeps this much of its length."""
_MAX_COST = 0.75
"""Use a plan only if it runs at most this fraction of the plain batch's padded tokens."""


@dataclass(frozen=True)
class PrefixPlan:
    group_of: Tensor
    """(B,) the group of each datum."""
    leads: list[int]
    """Per group, a datum whose leading tokens are the group's prefix."""
    prefix_lens: list[int]
    """Per group, the shared prefix length (every member has at least one token after it)."""


def _common_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def plan_prefixes(data: Sequence[CheckedDatum]) -> PrefixPlan | None:
    """Group datums by shared leading tokens; None when sharing would not pay off."""
    if len(data) < 2 or any(d.length < 2 for d in data):
        return None
    tokens = [d.tokens.tolist() for d in data]
    groups: list[list[int]] = []
    prefix_lens: list[int] = []
    for i in sorted(range(len(data)), key=lambda k: tokens[k]):
        if groups:
            lead = tokens[groups[-1][0]]
            shared = min(prefix_lens[-1], _common_length(lead, tokens[i]), len(tokens[i]) - 1)
            single = len(groups[-1]) == 1
            if shared >= _MIN_PREFIX and (single or shared >= _KEEP_FRACTION * prefix_lens[-1]):
                groups[-1].append(i)
                prefix_lens[-1] = shared
                continue
        groups.append([i])
        prefix_lens.append(len(tokens[i]) - 1)
    group_of = [0] * len(data)
    for g, members in enumerate(groups):
        for i in members:
            group_of[i] = g
    width = max(d.length for d in data)
    prefix_width = max(prefix_lens)
    suffix_width = max(d.length - prefix_lens[group_of[i]] for i, d in enumerate(data))
    shared_cost = len(groups) * prefix_width + len(data) * suffix_width
    if shared_cost > _MAX_COST * len(data) * width:
        return None
    return PrefixPlan(torch.tensor(group_of), [m[0] for m in groups], prefix_lens)


def shared_prefix_logprobs(
    model: nn.Module, cache_kw: str, batch: PaddedBatch, plan: PrefixPlan, pad_id: int
) -> Tensor:
    """Per-token logprobs of ``batch.targets`` (B, T), as the plain forward computes them
    (values on the padding are arbitrary)."""
    ids, targets = batch.ids, batch.targets
    rows, width = ids.shape
    lengths = batch.mask.sum(-1)
    group_lens = torch.tensor(plan.prefix_lens)
    prefix = group_lens[plan.group_of]  # (B,)
    prefix_width = int(group_lens.max())
    suffix_width = int((lengths - prefix).max())

    # each group's prefix, right-padded (causal attention: real tokens never see padding)
    t = torch.arange(prefix_width)[None, :]
    in_prefix = t < group_lens[:, None]
    prefix_ids = torch.where(in_prefix, ids[plan.leads, :prefix_width], pad_id)
    out = model(input_ids=prefix_ids, use_cache=True)
    prefix_logp = torch.log_softmax(out.logits.float(), dim=-1)
    cache = getattr(out, cache_kw)
    cache.batch_select_indices(plan.group_of)

    # every datum's suffix on top of its group's cache; the prefix padding is masked out
    s = torch.arange(suffix_width)[None, :]
    source = (prefix[:, None] + s).clamp(max=width - 1)
    real = prefix[:, None] + s < lengths[:, None]
    suffix_ids = torch.where(real, ids.gather(1, source), pad_id)
    suffix_targets = torch.where(real, targets.gather(1, source), 0)
    mask = torch.cat([in_prefix[plan.group_of], real], dim=1).long()
    out = model(
        input_ids=suffix_ids,
        attention_mask=mask,
        position_ids=prefix[:, None] + s,
        use_cache=True,
        **{cache_kw: cache},
    )
    suffix_logp = -torch.nn.functional.cross_entropy(
        out.logits.float().flatten(0, 1), suffix_targets.flatten(), reduction="none"
    ).view(rows, suffix_width)

    # gather both parts back into the (B, T) layout of the plain forward
    prefix_targets = torch.where(t < prefix[:, None], targets[:, :prefix_width], 0)
    from_prefix = prefix_logp[plan.group_of[:, None], t, prefix_targets]  # (B, prefix_width)
    both = torch.cat([from_prefix, suffix_logp], dim=1)
    pos = torch.arange(width)[None, :]
    column = torch.where(pos < prefix[:, None], pos, prefix_width + pos - prefix[:, None])
    column = torch.where(batch.mask, column, 0)
    return both.gather(1, column)
