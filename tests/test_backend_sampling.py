"""Sampling: logprob conventions (on-policy importance ratio 1), batching equivalence,
seeds, stops, prompt logprobs, frozen snapshots and request validation."""

from __future__ import annotations

import functools
import math
from pathlib import Path

import anyio
import pytest
import torch
from backend_util import (
    decode_text,
    lora_params,
    new_backend,
    prompt_ids,
    random_datums,
    rl_datum,
)

from engine.local.compute.backend import Backend
from engine.local.compute.backend_types import (
    AdamConfig,
    AdapterSpec,
    BackendError,
    DatumIn,
    SampledSequences,
    SampleJob,
)
from engine.local.compute.thread import ComputeThread
from engine.local.operations.batcher import PendingSample, SampleBatcher, SampleOutcome


@pytest.fixture(scope="module")
def backend() -> Backend:
    b = new_backend()
    b.create_model("trained", AdapterSpec(rank=4, seed=0))
    # move the adapter away from the base model so snapshots are not trivially equal
    for seed in range(3):
        data = [
            DatumIn(
                t, {"target_tokens": torch.tensor(t[1:] + t[:1]), "weights": torch.ones(len(t))}
            )
            for t in random_datums(b, 2, seed)
        ]
        b.forward_backward("trained", data, "cross_entropy", None, backward=True)
        b.optim_step("trained", AdamConfig(learning_rate=5e-3))
    return b


def _train_logprobs(
    backend: Backend, model_id: str, prompt: list[int], tokens: list[int]
) -> list[float]:
    full = prompt + tokens
    datum = rl_datum(full, len(prompt), [0.0] * len(tokens), 1.0)
    out = backend.forward_backward(model_id, [datum], "importance_sampling", None, backward=False)
    return out.outputs[0]["logprobs"][len(prompt) - 1 :].tolist()


def test_on_policy_importance_ratio_is_one(backend: Backend) -> None:
    key = backend.save_sampler("trained", None)
    prompts = [prompt_ids(backend, 12, 34), prompt_ids(backend, 5, 99), [1, 40, 41, 42]]
    results = backend.sample([SampleJob(key, p, 4, 12, temperature=1.0, seed=1) for p in prompts])
    data = []
    for prompt, res in zip(prompts, results, strict=True):
        for seq in res.sequences:
            data.append(rl_datum(prompt + seq.tokens, len(prompt), seq.logprobs, 1.0))
    out = backend.forward_backward("trained", data, "importance_sampling", None, backward=False)

    n_tokens = 0
    for datum, o in zip(data, out.outputs, strict=True):
        mask = datum.inputs["advantages"] != 0
        ratio = torch.exp(o["logprobs"][mask] - datum.inputs["logprobs"][mask])
        n_tokens += int(mask.sum())
        assert float((ratio - 1).abs().max()) < 1e-5
    # IS loss with A = 1 on every sampled token is then minus the token count
    assert out.metrics["loss:sum"] == pytest.approx(-n_tokens, rel=1e-5)


def test_logprobs_follow_the_sampling_distribution(backend: Backend) -> None:
    key = backend.save_sampler("trained", None)
    prompt = prompt_ids(backend, 47, 38)
    greedy, top1, sharp, warm = backend.sample(
        [
            SampleJob(key, prompt, 1, 8, temperature=0.0),
            SampleJob(key, prompt, 3, 8, temperature=1.0, top_k=1, seed=3),
            SampleJob(key, prompt, 3, 8, temperature=1.0, top_p=1e-6, seed=4),
            SampleJob(key, prompt, 3, 8, temperature=0.5, seed=5),
        ]
    )
    g = greedy.sequences[0]
    # greedy reports the untempered model logprob: what training computes
    assert g.logprobs == pytest.approx(
        _train_logprobs(backend, "trained", prompt, g.tokens), abs=1e-5
    )
    # top-k=1 / tiny top-p: the renormalised distribution is a point mass on the argmax
    for res in (top1, sharp):
        for seq in res.sequences:
            assert seq.tokens == g.tokens
            assert seq.logprobs == [0.0] * len(seq.tokens)
    # temperature 0.5: log_softmax(logits / 0.5) of the chosen token
    with backend._host.active(backend._load_slot(key)):
        for seq in warm.sequences:
            ids = torch.tensor([prompt + seq.tokens])
            logits = backend._model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
            want = torch.log_softmax(logits / 0.5, -1).gather(-1, torch.tensor(seq.tokens)[:, None])
            assert seq.logprobs == pytest.approx(want.squeeze(-1).tolist(), abs=1e-5)


def test_untempered_logprobs_and_the_trainer_at_the_sampling_temperature(
    backend: Backend,
) -> None:
    """At temperature 0.7: the same seed draws the same tokens either way; 'untempered'
    reports the model's own logprob (what training computes by default) and still keeps
    the sampling distribution's for the stability records; 'tempered' reports the
    sampling distribution's, which the RL losses reproduce with loss_fn_config
    temperature = 0.7 (an on-policy ratio of 1)."""
    key = backend.save_sampler("trained", None)
    prompt = prompt_ids(backend, 21, 43)
    tempered, untempered = backend.sample(
        [
            SampleJob(key, prompt, 3, 10, temperature=0.7, seed=8),
            SampleJob(key, prompt, 3, 10, temperature=0.7, seed=8, tempered_logprobs=False),
        ]
    )
    for t, u in zip(tempered.sequences, untempered.sequences, strict=True):
        assert t.tokens == u.tokens and t.behaviour_logprobs is None
        # what stable_reinforce's records keep: the distribution actually sampled
        assert u.behaviour_logprobs == pytest.approx(t.logprobs, abs=1e-6)
        assert u.logprobs == pytest.approx(
            _train_logprobs(backend, "trained", prompt, u.tokens), abs=1e-5
        )
        datum = rl_datum(prompt + t.tokens, len(prompt), t.logprobs, 1.0)
        for cfg, same in (({"temperature": 0.7}, True), (None, False)):
            out = backend.forward_backward("trained", [datum], "ppo", cfg, backward=False)
            trained = out.outputs[0]["logprobs"][len(prompt) - 1 :].tolist()
            assert (trained == pytest.approx(t.logprobs, abs=1e-5)) is same


def test_batched_requests_equal_individual_requests(backend: Backend) -> None:
    key = backend.save_sampler("trained", None)
    jobs = [
        SampleJob(key, prompt_ids(backend, 12, 34), 6, 16, temperature=0.8, seed=1),
        SampleJob(key, [1, 50, 60], 3, 10, temperature=1.0, seed=2, top_k=20),
        SampleJob(None, prompt_ids(backend, 5, 7), 2, 16, temperature=1.0, seed=3, top_p=0.9),
        SampleJob(key, prompt_ids(backend, 99, 99), 1, 16, temperature=0.0),
        SampleJob(key, [1, *range(10, 40)], 4, 5, temperature=1.2, seed=4, prompt_logprobs=True),
    ]
    together = backend.sample(jobs)
    for job, res in zip(jobs, together, strict=True):
        (alone,) = backend.sample([job])
        assert [s.tokens for s in res.sequences] == [s.tokens for s in alone.sequences]
        assert [s.stop_reason for s in res.sequences] == [s.stop_reason for s in alone.sequences]
        for s, t in zip(res.sequences, alone.sequences, strict=True):
            # float32: a different batch shape may change the last bits of the arithmetic
            assert s.logprobs == pytest.approx(t.logprobs, abs=1e-4)
            assert all(math.isfinite(x) for x in s.logprobs)
        if job.prompt_logprobs:
            assert res.prompt_logprobs is not None and alone.prompt_logprobs is not None
            assert res.prompt_logprobs[0] is None
            assert res.prompt_logprobs[1:] == pytest.approx(alone.prompt_logprobs[1:], abs=1e-4)


def test_many_requests_cost_one_batched_forward_per_token(backend: Backend) -> None:
    """8 problems x 6 samples x 16 tokens: one prefill plus at most 15 decode forwards."""
    key = backend.save_sampler("trained", None)
    calls = []
    folded = backend._folded if backend.fold_sampling_weights else None
    sampling_model = backend._model if folded is None else folded.model
    hook = sampling_model.register_forward_hook(lambda m, i, o: calls.append(1))
    try:
        jobs = [
            SampleJob(key, prompt_ids(backend, 10 + i, 20 + 3 * i), 6, 16, temperature=1.0, seed=i)
            for i in range(8)
        ]
        results = backend.sample(jobs)
    finally:
        hook.remove()
    assert [len(r.sequences) for r in results] == [6] * 8
    assert len(calls) <= 16


def test_folded_weights_sample_what_the_adapters_sample(backend: Backend) -> None:
    """The small-model fast path (LoRA folded into a plain copy of the weights) draws the
    same tokens with the same logprobs as sampling through the peft adapters, also when
    it switches between snapshots and the bare base model."""
    backend.create_model("other", AdapterSpec(rank=2, seed=9, train_attn=False))
    for name, p in lora_params(backend, "other").items():
        if "lora_B" in name:
            p.data.fill_(0.02)
    keys = [backend.save_sampler("trained", None), None, backend.save_sampler("other", None)]
    prompt = prompt_ids(backend, 17, 25)
    assert backend._folded is not None and backend.fold_sampling_weights
    for key in keys + keys[::-1]:
        job = SampleJob(key, prompt, 4, 12, temperature=1.0, seed=11, prompt_logprobs=True)
        outcomes = []
        for fold in (True, False):
            backend.fold_sampling_weights = fold
            try:
                (res,) = backend.sample([job])
            finally:
                backend.fold_sampling_weights = True
            outcomes.append(res)
        folded, adapted = outcomes
        assert [s.tokens for s in folded.sequences] == [s.tokens for s in adapted.sequences]
        for f, a in zip(folded.sequences, adapted.sequences, strict=True):
            assert f.logprobs == pytest.approx(a.logprobs, abs=1e-5)
        assert folded.prompt_logprobs is not None and adapted.prompt_logprobs is not None
        assert folded.prompt_logprobs[1:] == pytest.approx(adapted.prompt_logprobs[1:], abs=1e-5)
    backend.delete_model("other")


def test_seed_makes_sampling_reproducible(backend: Backend) -> None:
    key = backend.save_sampler("trained", None)
    prompt = prompt_ids(backend, 31, 45)

    def draw(seed: int) -> list[list[int]]:
        (res,) = backend.sample([SampleJob(key, prompt, 8, 16, temperature=1.5, seed=seed)])
        return [s.tokens for s in res.sequences]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)
    assert len({tuple(t) for t in draw(7)}) > 1  # samples within a request differ


def test_stop_conditions(backend: Backend) -> None:
    tok = backend.tokenizer
    prompt = prompt_ids(backend, 12, 34)
    (greedy,) = backend.sample([SampleJob(None, prompt, 1, 16, temperature=0.0)])
    g = greedy.sequences[0]
    assert g.stop_reason == "stop" and g.tokens[-1] == tok.eos_token_id  # EOS stops, kept
    text_ids = g.tokens[:-1]
    assert len(text_ids) >= 3
    second = decode_text(backend, text_ids[1:2])

    by_string, by_token, by_length = backend.sample(
        [
            SampleJob(None, prompt, 1, 16, temperature=0.0, stop_strings=[second]),
            SampleJob(None, prompt, 1, 16, temperature=0.0, stop_token_ids=[text_ids[2]]),
            SampleJob(None, prompt, 1, 2, temperature=0.0),
        ]
    )
    assert by_string.sequences[0].tokens == text_ids[:2]
    assert by_string.sequences[0].stop_reason == "stop"
    assert by_token.sequences[0].tokens == text_ids[:3]
    assert by_token.sequences[0].stop_reason == "stop"
    assert by_length.sequences[0].tokens == text_ids[:2]
    assert by_length.sequences[0].stop_reason == "length"
    assert by_length.sequences[0].logprobs == pytest.approx(g.logprobs[:2], abs=1e-5)


def test_prompt_logprobs_and_topk(backend: Backend) -> None:
    key = backend.save_sampler("trained", None)
    prompt = prompt_ids(backend, 64, 17)
    (res,) = backend.sample(
        [SampleJob(key, prompt, 1, 1, prompt_logprobs=True, topk_prompt_logprobs=3)]
    )
    assert res.prompt_logprobs is not None and res.topk_prompt_logprobs is not None
    assert len(res.prompt_logprobs) == len(res.topk_prompt_logprobs) == len(prompt)
    assert res.prompt_logprobs[0] is None and res.topk_prompt_logprobs[0] is None
    datum = DatumIn(
        prompt[:-1],
        {"target_tokens": torch.tensor(prompt[1:]), "weights": torch.ones(len(prompt) - 1)},
    )
    train = backend.forward_backward("trained", [datum], "cross_entropy", None, backward=False)
    # float32, and sampling may fold the LoRA into the weights: equal to a few ulps
    want = train.outputs[0]["logprobs"].tolist()
    assert res.prompt_logprobs[1:] == pytest.approx(want, rel=1e-5, abs=1e-5)
    for pos, top in enumerate(res.topk_prompt_logprobs[1:], start=1):
        assert top is not None and len(top) == 3
        values = [lp for _, lp in top]
        assert values == sorted(values, reverse=True)
        actual = res.prompt_logprobs[pos]
        assert actual is not None and actual <= values[0] + 1e-6
        if prompt[pos] in {t for t, _ in top}:
            assert dict(top)[prompt[pos]] == pytest.approx(actual, abs=1e-6)


def test_sampler_snapshot_is_frozen_and_survives_a_restart(
    backend: Backend, tmp_path: Path
) -> None:
    backend.create_model("frozen", AdapterSpec(rank=4, seed=1))
    data = [
        DatumIn(t, {"target_tokens": torch.tensor(t[1:] + t[:1]), "weights": torch.ones(len(t))})
        for t in random_datums(backend, 2, 77)
    ]
    prompt = prompt_ids(backend, 21, 43)

    def score(key: str, b: Backend = backend) -> list[float | None]:
        (res,) = b.sample([SampleJob(key, prompt, 1, 1, prompt_logprobs=True)])
        assert res.prompt_logprobs is not None
        return res.prompt_logprobs

    for _ in range(2):
        backend.forward_backward("frozen", data, "cross_entropy", None, backward=True)
        backend.optim_step("frozen", AdamConfig(learning_rate=1e-2))
    key = backend.save_sampler("frozen", tmp_path / "step2")
    at_step2 = score(key)
    for _ in range(2):
        backend.forward_backward("frozen", data, "cross_entropy", None, backward=True)
        backend.optim_step("frozen", AdamConfig(learning_rate=1e-2))
    later = backend.save_sampler("frozen", None)

    assert score(key) == at_step2  # still step-2 weights, bit for bit
    assert score(later) != at_step2
    fresh = new_backend()
    loaded = fresh.load_sampler(tmp_path / "step2")
    assert score(loaded, fresh) == at_step2
    assert fresh.load_sampler(tmp_path / "step2") == loaded  # same path: same snapshot
    fresh.release_sampler(loaded)
    assert not fresh.has_sampler(loaded)
    with pytest.raises(BackendError, match="unknown sampler"):
        fresh.sample([SampleJob(loaded, prompt, 1, 1)])


def test_a_sample_job_for_an_unknown_sampler_is_a_clear_error(backend: Backend) -> None:
    good = SampleJob(None, [1, 2, 3], 1, 4)
    with pytest.raises(BackendError) as err:
        backend.sample([good, SampleJob("nope", [1, 2, 3], 1, 4)])
    assert "sample request 1: unknown sampler 'nope'" in str(err.value)


@pytest.mark.anyio
async def test_a_seeded_request_draws_the_same_tokens_whatever_the_batcher_merges_it_with(
    backend: Backend,
) -> None:
    """Two identical seeded requests, queued with others (another seed, another
    temperature, the base model) so the batcher runs them all in one backend.sample call,
    get the same tokens as each other and as the request run alone."""
    key = backend.save_sampler("trained", None)
    prompt = prompt_ids(backend, 31, 17)
    seeded = SampleJob(key, prompt, 3, 12, temperature=0.9, seed=1234)
    others = [
        SampleJob(key, prompt, 2, 12, temperature=0.9, seed=99),
        SampleJob(key, prompt_ids(backend, 8, 9), 4, 7, temperature=1.3, seed=5),
        SampleJob(None, prompt, 3, 12, temperature=0.9, seed=1234),
    ]
    compute = ComputeThread()
    batcher = SampleBatcher(compute, backend.sample, max_batch=8, max_queued=8)
    got: dict[int, SampleOutcome] = {}
    jobs = [others[0], seeded, others[1], seeded, others[2]]
    done = anyio.Event()

    def deliver(i: int, outcome: SampleOutcome) -> None:
        got[i] = outcome
        if len(got) == len(jobs):
            done.set()

    for i, job in enumerate(jobs):  # all queued before the batcher drains: one batch
        batcher.submit(PendingSample(job, functools.partial(deliver, i)))
    async with anyio.create_task_group() as tg:
        tg.start_soon(batcher.run)
        await done.wait()
        tg.cancel_scope.cancel()
    await compute.aclose()
    assert batcher.batches == 1 and batcher.largest_batch == len(jobs)
    (alone,) = backend.sample([seeded])
    first, second = got[1], got[3]
    assert isinstance(first, SampledSequences) and isinstance(second, SampledSequences)
    want = [s.tokens for s in alone.sequences]
    assert [s.tokens for s in first.sequences] == want
    assert [s.tokens for s in second.sequences] == want
