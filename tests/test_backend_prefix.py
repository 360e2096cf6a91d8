"""The shared-prefix training forward computes what the plain padded forward computes."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from backend_util import assert_close_rel, lora_params, new_backend

from engine.local.compute import prefix
from engine.local.compute.backend import Backend
from engine.local.compute.backend_types import AdapterSpec, DatumIn
from engine.local.compute.datums import CheckedDatum, check_data
from engine.local.compute.prefix import plan_prefixes


def _group_batch(vocab: int, seed: int) -> list[DatumIn]:
    """RL-shaped datums: prompts of different lengths with several sampled continuations
    each (one continuation exactly one token long), plus unrelated datums; targets and
    loss inputs differ per datum even where the tokens are shared."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    sequences: list[list[int]] = []
    for prompt_len in (9, 14, 21):
        prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
        for n_new in (1, 3, 5, 8):
            sequences.append(prompt + [rng.randrange(vocab) for _ in range(n_new)])
    sequences += [[rng.randrange(vocab) for _ in range(n)] for n in (6, 17)]
    rng.shuffle(sequences)
    data = []
    for tokens in sequences:
        n = len(tokens)
        inputs = {
            "target_tokens": torch.randint(0, vocab, (n,), generator=gen),
            "weights": torch.rand(n, generator=gen),
            "advantages": torch.randn(n, generator=gen),
            "logprobs": -3.0 - torch.rand(n, generator=gen),
        }
        data.append(DatumIn(tokens, inputs))
    return data


def _checked(backend: Backend, data: list[DatumIn]) -> list[CheckedDatum]:
    return check_data(data, (), vocab=backend.vocab_size, max_len=10_000)


@pytest.fixture(scope="module")
def backend() -> Backend:
    b = new_backend()
    b.create_model("m", AdapterSpec(rank=4, seed=5))
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in lora_params(b, "m").items():
            if "lora_B" in name:  # non-zero, so every LoRA tensor gets gradient
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return b


def test_plan_groups_datums_by_prompt(backend: Backend) -> None:
    data = _group_batch(backend.vocab_size, seed=1)
    plan = plan_prefixes(_checked(backend, data))
    assert plan is not None
    groups: dict[int, set[int]] = {}
    for i, g in enumerate(plan.group_of.tolist()):
        groups.setdefault(g, set()).add(len(data[i].tokens) - 1)
    shared = [lens for lens in groups.values() if len(lens) > 1]
    assert len(shared) == 3  # the three prompts; the unrelated datums stay alone
    for i, g in enumerate(plan.group_of.tolist()):
        assert plan.prefix_lens[g] < len(data[i].tokens)  # a suffix token is always left
        lead = data[plan.leads[g]].tokens
        assert data[i].tokens[: plan.prefix_lens[g]] == lead[: plan.prefix_lens[g]]
    # packed, each group's row is its prefix and then its datums' suffixes side by side
    spans: dict[int, list[tuple[int, int]]] = {}
    for i, (g, start) in enumerate(zip(plan.group_of.tolist(), plan.starts.tolist(), strict=True)):
        end = start + len(data[i].tokens) - plan.prefix_lens[g]
        assert plan.prefix_lens[g] <= start < end <= plan.packed_width
        spans.setdefault(g, []).append((start, end))
    for g, row in spans.items():
        row.sort()
        assert row[0][0] == plan.prefix_lens[g]
        assert all(end == start for (_, end), (start, _) in itertools.pairwise(row))


def test_unrelated_datums_run_the_plain_forward(backend: Backend) -> None:
    rng = random.Random(2)
    data = [
        DatumIn(
            [rng.randrange(backend.vocab_size) for _ in range(12)],
            {"target_tokens": torch.zeros(12, dtype=torch.long)},
        )
        for _ in range(6)
    ]
    assert plan_prefixes(_checked(backend, data)) is None


def _must_not_run(*args: object) -> None:
    raise AssertionError("the other layout ran")


@pytest.mark.parametrize("layout", ["packed", "cached"])
@pytest.mark.parametrize(
    ("loss_fn", "config"),
    [("importance_sampling", None), ("dro", {"beta": 0.3}), ("cross_entropy", None)],
)
def test_shared_prefix_forward_matches_plain(
    backend: Backend,
    loss_fn: str,
    config: dict[str, float] | None,
    layout: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    data = _group_batch(backend.vocab_size, seed=3)
    plan = plan_prefixes(_checked(backend, data))
    assert plan is not None and plan.packed_width <= prefix.PACKED_ROW_WIDTH
    if layout == "cached":
        monkeypatch.setattr(prefix, "PACKED_ROW_WIDTH", plan.packed_width - 1)
    other = "_packed_logprobs" if layout == "cached" else "_cached_logprobs"
    monkeypatch.setattr(prefix, other, _must_not_run)
    results, grads = [], []
    for share in (False, True):
        backend.share_prefixes = share
        try:
            results.append(backend.forward_backward("m", data, loss_fn, config, backward=True))
        finally:
            backend.share_prefixes = True
        params = lora_params(backend, "m")
        grads.append({k: p.grad.clone() for k, p in params.items() if p.grad is not None})
        for p in params.values():
            p.grad = None
    plain, shared = results
    assert shared.metrics["loss:sum"] == pytest.approx(plain.metrics["loss:sum"], rel=1e-5)
    for i, (a, b) in enumerate(zip(plain.outputs, shared.outputs, strict=True)):
        assert a["logprobs"].shape == b["logprobs"].shape == (len(data[i].tokens),)
        assert_close_rel(b["logprobs"], a["logprobs"], tol=1e-5, what=f"datum {i} logprobs")
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for k, g in grads[0].items():
        assert_close_rel(grads[1][k], g, what=k)
