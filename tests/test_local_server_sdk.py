"""The unmodified ``mint`` SDK against the local server (in a background thread): the
whole training/sampling flow in sync and async forms with ``tml-`` and ``sk-`` keys,
clear errors for bad requests, frozen sampler snapshots, and the MinT-only calls."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import mint
import pytest
from mint import types

from engine.local import LocalServer

TML_KEY = "tml-local-sdk-test"
SK_KEY = "sk-local-sdk-test"
QUESTION = "Question: What is 12 + 30?\nAnswer:"


@pytest.fixture(scope="module")
def server() -> Iterator[LocalServer]:
    with LocalServer(api_key=TML_KEY) as running:
        yield running


@pytest.fixture(scope="module")
def service(server: LocalServer) -> mint.ServiceClient:
    return mint.ServiceClient(base_url=server.base_url, api_key=TML_KEY)


def sft_datum(tokenizer, prompt: str, answer: str) -> types.Datum:
    prompt_tokens = tokenizer.encode(prompt)
    full = tokenizer.encode(prompt + answer)
    weights = [0.0] * (len(prompt_tokens) - 1) + [1.0] * (len(full) - len(prompt_tokens))
    return types.Datum(
        model_input=types.ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={"target_tokens": full[1:], "weights": weights},
    )


def test_sync_flow_with_a_tml_key(server: LocalServer, service: mint.ServiceClient) -> None:
    caps = service.get_server_capabilities()
    assert [m.model_name for m in caps.supported_models] == [server.model_name]
    tc = service.create_lora_training_client(base_model=server.model_name, rank=8, seed=1)
    info = tc.get_info()
    assert info.lora_rank == 8
    # The tokenizer as filed in the hub cache (engine.local.models.tokenizer_cache), by its path.
    filed = Path(info.model_data.tokenizer_id)
    assert filed.parent.name == "snapshots" and (filed / "tokenizer.json").is_file()
    tokenizer = tc.get_tokenizer()
    data = [sft_datum(tokenizer, QUESTION, " 42"), sft_datum(tokenizer, QUESTION, " 42</s>")]

    losses = []
    for _ in range(3):
        fb = tc.forward_backward(data, "cross_entropy")  # submitted back to back
        opt = tc.optim_step(types.AdamParams(learning_rate=5e-3))
        losses.append(fb.result().metrics["loss:sum"])
        assert opt.result().metrics is not None
    assert losses[-1] < losses[0]  # the real model learns

    prompt = types.ModelInput.from_ints(tokenizer.encode(QUESTION))
    sampler = tc.save_weights_and_get_sampling_client()
    assert sampler.get_tokenizer().encode(QUESTION) == tokenizer.encode(QUESTION)
    response = sampler.sample(prompt, 3, types.SamplingParams(max_tokens=6, seed=0)).result()
    assert len(response.sequences) == 3
    for seq in response.sequences:
        assert seq.stop_reason in ("length", "stop") and len(seq.logprobs or []) == len(seq.tokens)

    state = tc.save_state("after-3").result().path
    assert state == f"tinker://{tc.model_id}/weights/after-3"
    named = tc.save_weights_for_sampler("sampler-3").result().path
    from_path = service.create_sampling_client(model_path=named)
    assert from_path.compute_logprobs(prompt).result() == sampler.compute_logprobs(prompt).result()

    resumed = service.create_training_client_from_state_with_optimizer(state)
    assert resumed.model_id != tc.model_id
    assert server.backend_call(lambda b: b.optimizer_steps(resumed.model_id)) == 3
    fwd_a = tc.forward(data, "cross_entropy").result()
    fwd_b = resumed.forward(data, "cross_entropy").result()
    assert fwd_b.metrics["loss:sum"] == pytest.approx(fwd_a.metrics["loss:sum"], rel=1e-6)
    resumed.load_state(state).result()  # weights only: optimizer restarts
    assert server.backend_call(lambda b: b.optimizer_steps(resumed.model_id)) == 0


def test_forward_backward_travels_as_protobuf_and_means_what_the_json_forward_means(
    server: LocalServer, service: mint.ServiceClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server's client config has tinker 0.22 send forward_backward as protobuf (its
    JSON costs both sides more); forward stays JSON. Same weights, same datums: same
    loss and logprobs either way."""
    sent: dict[str, str] = {}
    send = httpx.AsyncClient.send

    async def recording(self: httpx.AsyncClient, request: httpx.Request, **kwargs: Any) -> Any:
        sent[request.url.path.rsplit("/", 1)[-1]] = request.headers.get("content-type", "")
        return await send(self, request, **kwargs)

    monkeypatch.setattr(httpx.AsyncClient, "send", recording)
    tc = service.create_lora_training_client(base_model=server.model_name, rank=8, seed=3)
    tokenizer = tc.get_tokenizer()
    data = [sft_datum(tokenizer, QUESTION, " 42"), sft_datum(tokenizer, QUESTION, " 7</s>")]
    trained = tc.forward_backward(data, "cross_entropy").result()
    forward = tc.forward(data, "cross_entropy").result()
    assert sent["forward_backward"] == "application/x-protobuf"
    assert sent["forward"] == "application/json"
    assert trained.metrics["loss:sum"] == pytest.approx(forward.metrics["loss:sum"], rel=1e-6)
    for a, b in zip(trained.loss_fn_outputs, forward.loss_fn_outputs, strict=True):
        assert a["logprobs"].tolist() == pytest.approx(b["logprobs"].tolist(), abs=1e-6)


def test_async_flow_with_an_sk_key() -> None:
    async def flow(base_url: str, model_name: str) -> None:
        service = mint.ServiceClient(base_url=base_url, api_key=SK_KEY)
        tc = await service.create_lora_training_client_async(base_model=model_name, rank=4)
        tokenizer = tc.get_tokenizer()
        data = [sft_datum(tokenizer, QUESTION, " 42")]
        fb_future = await tc.forward_backward_async(data, "cross_entropy")
        opt_future = await tc.optim_step_async(types.AdamParams(learning_rate=1e-3))
        fb = await fb_future
        await opt_future
        assert fb.loss_fn_outputs[0]["logprobs"].shape == [len(data[0].model_input.to_ints())]
        sampler = await tc.save_weights_and_get_sampling_client_async()
        prompt = types.ModelInput.from_ints(tokenizer.encode(QUESTION))
        answers = await sampler.sample_async(prompt, 2, types.SamplingParams(max_tokens=4))
        assert len(answers.sequences) == 2
        saved = await (await tc.save_weights_for_sampler_async("async-final"))
        other = await service.create_sampling_client_async(model_path=saved.path)
        logprobs = await other.compute_logprobs_async(prompt)
        assert logprobs[0] is None and all(lp is not None and lp <= 0 for lp in logprobs[1:])

    with LocalServer(api_key=SK_KEY) as server:
        anyio.run(flow, server.base_url, server.model_name)
        stats = server.stats
        assert stats.requests["auth/token"] >= 1  # the sk- key went through JWT exchange
        assert list(stats.optimizer_steps.values()) == [1]


def test_both_key_kinds_work_when_the_server_has_no_key() -> None:
    with LocalServer() as open_server:
        for key in ("tml-anything", "sk-anything"):
            service = mint.ServiceClient(base_url=open_server.base_url, api_key=key)
            names = [m.model_name for m in service.get_server_capabilities().supported_models]
            assert names == [open_server.model_name]


def test_a_wrong_key_is_refused_with_a_clear_error(server: LocalServer) -> None:
    with pytest.raises(mint.AuthenticationError) as info:
        mint.ServiceClient(base_url=server.base_url, api_key="tml-wrong")
    assert "unauthorized: invalid API key" in str(info.value)


def test_bad_requests_raise_clear_errors_and_the_server_keeps_serving(
    server: LocalServer, service: mint.ServiceClient
) -> None:
    with pytest.raises(mint.RequestFailedError) as info:
        service.create_lora_training_client(base_model="Qwen/Qwen3-0.6B", rank=4)
    assert f"this local server serves {server.model_name!r}" in str(info.value)

    tc = service.create_lora_training_client(base_model=server.model_name, rank=4)
    tokenizer = tc.get_tokenizer()
    good = sft_datum(tokenizer, QUESTION, " 42")
    n = len(good.model_input.to_ints())
    cases = [
        (tc.forward_backward([good], "kl_divergence"), "unsupported loss_fn 'kl_divergence'"),
        (
            tc.forward_backward(
                [
                    types.Datum(
                        model_input=good.model_input,
                        loss_fn_inputs={"target_tokens": good.loss_fn_inputs["target_tokens"]},
                    ),
                ],
                "importance_sampling",
            ),
            "missing loss input(s) ['logprobs', 'advantages']",
        ),
        (
            tc.forward_backward(
                [
                    types.Datum(
                        model_input=good.model_input,
                        loss_fn_inputs={"target_tokens": [1] * n, "weights": [1.0] * (n - 1)},
                    )
                ],
                "cross_entropy",
            ),
            f"has shape [{n - 1}] but must be [{n}]",
        ),
    ]
    for future, message in cases:
        with pytest.raises(mint.RequestFailedError) as info:
            future.result()
        assert message in str(info.value)
        assert info.value.category == types.RequestErrorCategory.User

    sampler = service.create_sampling_client(base_model=server.model_name)
    image = types.ModelInput(
        chunks=[
            types.EncodedTextChunk(tokens=tokenizer.encode(QUESTION)),
            types.ImageChunk(data=b"\x89PNG", format="png", expected_tokens=4),
        ]
    )
    with pytest.raises(mint.RequestFailedError, match="text-only model"):
        sampler.sample(image, 1, types.SamplingParams(max_tokens=4)).result()
    prompt = types.ModelInput.from_ints(tokenizer.encode(QUESTION))
    with pytest.raises(mint.RequestFailedError, match="max_context_length"):
        sampler.sample(prompt, 1, types.SamplingParams(max_tokens=100_000)).result()

    # ...and the same client keeps working afterwards.
    assert tc.forward_backward([good], "cross_entropy").result().metrics["loss:sum"] > 0
    assert (
        len(sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2)).result().sequences) == 1
    )


def test_a_sampler_keeps_the_weights_of_the_step_it_was_saved_at(
    server: LocalServer, service: mint.ServiceClient
) -> None:
    tc = service.create_lora_training_client(base_model=server.model_name, rank=8, seed=3)
    tokenizer = tc.get_tokenizer()
    data = [sft_datum(tokenizer, QUESTION, " 42")]
    prompt = types.ModelInput.from_ints(tokenizer.encode(QUESTION + " 42"))

    def step() -> None:
        tc.forward_backward(data, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()

    step()
    at_step_1 = tc.save_weights_and_get_sampling_client()
    before = at_step_1.compute_logprobs(prompt).result()
    step()
    step()
    after = at_step_1.compute_logprobs(prompt).result()
    assert after == before  # bit-identical: the snapshot did not move
    newer = tc.save_weights_and_get_sampling_client().compute_logprobs(prompt).result()
    assert newer != before


def test_mint_only_calls_fail_clearly(server: LocalServer, service: mint.ServiceClient) -> None:
    with pytest.raises(mint.RequestFailedError, match="not supported by the local server"):
        mint.mint.interpolate_checkpoints(
            service, source_paths=["tinker://a/sampler_weights/x"], coefficients=[1.0]
        )


def test_extreme_loss_inputs_fail_clearly_and_leave_the_weights_intact(
    server: LocalServer, service: mint.ServiceClient
) -> None:
    """Issue 12 item 6: logprobs=-200 made forward_backward fail as a retryable internal
    error after storing an infinite gradient, and the next optim_step, reported as failed,
    applied it (NaN weights). Now: a user error, and training goes on unharmed."""
    tc = service.create_lora_training_client(base_model=server.model_name, rank=4, seed=2)
    tokenizer = tc.get_tokenizer()
    full = tokenizer.encode(QUESTION + " 42")
    n = len(full) - 1

    def rl_datum(sampler_logprob: float) -> types.Datum:
        return types.Datum(
            model_input=types.ModelInput.from_ints(full[:-1]),
            loss_fn_inputs={
                "target_tokens": full[1:],
                "logprobs": [sampler_logprob] * n,
                "advantages": [1.0] * n,
            },
        )

    with pytest.raises(mint.RequestFailedError, match="too extreme") as info:
        tc.forward_backward([rl_datum(-200.0)], "importance_sampling").result()
    assert info.value.category == types.RequestErrorCategory.User
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    after = tc.forward([rl_datum(-2.0)], "importance_sampling").result()
    assert all(math.isfinite(x) for out in after.loss_fn_outputs for x in out["logprobs"].tolist())
    assert math.isfinite(after.metrics["loss:sum"])


def test_a_client_loads_the_tokenizer_by_an_alias_offline_as_by_the_served_name() -> None:
    """tinker-cookbook loads its tokenizer with ``AutoTokenizer.from_pretrained(model
    name)``, offline from the hub cache: ``--model-alias NAME`` files the tokenizer under
    NAME too, as ``--model-name`` does."""
    from transformers import AutoTokenizer

    alias = "someone-hosted/alias-of-tiny-arith"
    with LocalServer(model_aliases=[alias]):
        loaded = AutoTokenizer.from_pretrained(alias)
        served = AutoTokenizer.from_pretrained("engine-local/tiny-arith")
    text = "Question: What is 12 + 30?\nAnswer: 42"
    assert loaded.encode(text) == served.encode(text)
    assert loaded.eos_token_id == served.eos_token_id
