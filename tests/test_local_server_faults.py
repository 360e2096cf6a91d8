"""Fault injection against the unmodified SDK: every fault kind is injected into a real
training step and sampling call; the SDK rides out the ones it retries, and no retry
ever applies an optimizer step twice (the server dedupes on (model_id, seq_id))."""

from __future__ import annotations

import mint
import pytest
from mint import types

from engine.local import LocalServer

# A real-server end-to-end set: deselected by default, run with -m slow (CI runs both).
pytestmark = pytest.mark.slow

KEY = "tml-faults-test"
QUESTION = "Question: What is 21 + 21?\nAnswer:"


def one_step(server: LocalServer, steps: int = 1) -> str:
    """Create a model, train ``steps`` steps (forward_backward and optim_step back to
    back), snapshot a sampler and sample from it. Returns the model id."""
    service = mint.ServiceClient(base_url=server.base_url, api_key=KEY)
    tc = service.create_lora_training_client(base_model=server.model_name, rank=4, seed=0)
    tokenizer = tc.get_tokenizer()
    full = tokenizer.encode(QUESTION + " 42")
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={"target_tokens": full[1:], "weights": [1.0] * (len(full) - 1)},
    )
    for _ in range(steps):
        fb = tc.forward_backward([datum], "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=1e-3))
        assert fb.result().metrics["loss:sum"] > 0
        opt.result()
    sampler = tc.save_weights_and_get_sampling_client()
    prompt = types.ModelInput.from_ints(tokenizer.encode(QUESTION))
    answer = sampler.sample(prompt, 2, types.SamplingParams(max_tokens=4, seed=1)).result()
    assert len(answer.sequences) == 2
    return tc.model_id


def assert_exactly_once(server: LocalServer, model_id: str, steps: int = 1) -> None:
    assert server.stats.optimizer_steps == {model_id: steps}
    assert server.backend_call(lambda b: b.optimizer_steps(model_id)) == steps


SURVIVABLE = {
    # kind: (spec, injections expected)
    "500": ("500@forward_backward:at=1,500@optim_step:at=1,500@retrieve_future:at=2", 3),
    "503": ("503@optim_step:at=1,503@asample:at=1,503@create_model:at=1", 3),
    "429": ("retry_after_s=0.05,429@forward_backward:at=1,429@retrieve_future:at=1", 2),
    "408": ("408@optim_step:at=1,408@retrieve_future:at=1+3", 3),
    "drop": ("drop@forward_backward:at=1,drop@retrieve_future:at=2,drop@asample:at=1", 3),
    "slow": ("slow_s=0.2,slow@optim_step:at=1,slow~after@retrieve_future:at=1", 2),
}


@pytest.mark.parametrize("kind", sorted(SURVIVABLE))
def test_the_sdk_survives_injected_http_faults(kind: str) -> None:
    spec, expected = SURVIVABLE[kind]
    with LocalServer(api_key=KEY, faults=spec) as server:
        model_id = one_step(server)
        assert server.stats.faults_injected[kind] == expected
        assert_exactly_once(server, model_id)


@pytest.mark.parametrize("endpoint", ["forward_backward", "optim_step", "asample"])
def test_a_lost_answer_after_applying_is_not_applied_again(endpoint: str) -> None:
    """ "drop~after" and "500~after" apply the request and then lose the answer: the SDK
    resubmits with the same seq_id and must get the original future back."""
    spec = f"drop~after@{endpoint}:at=1,500~after@{endpoint}:at=2"
    with LocalServer(api_key=KEY, faults=spec) as server:
        model_id = one_step(server, steps=2)
        stats = server.stats
        assert stats.faults_injected["drop"] == 1 and stats.faults_injected["500"] == 1
        assert stats.dedupe_hits[endpoint] == 2
        assert_exactly_once(server, model_id, steps=2)
        assert stats.applied[endpoint] == (1 if endpoint == "asample" else 2)


def test_an_expired_sample_future_is_resubmitted_by_the_sdk() -> None:
    with LocalServer(api_key=KEY, faults="410@asample:at=1") as server:
        one_step(server)
        stats = server.stats
        assert stats.faults_injected["410"] == 1
        assert stats.requests["asample"] == 2  # the SDK sampled again after the 410


def test_failed_futures_surface_as_server_errors_and_do_not_block_the_model() -> None:
    with LocalServer(api_key=KEY, faults="fail@forward_backward:at=1,fail@asample:at=1") as server:
        service = mint.ServiceClient(base_url=server.base_url, api_key=KEY)
        tc = service.create_lora_training_client(base_model=server.model_name, rank=4)
        tokenizer = tc.get_tokenizer()
        full = tokenizer.encode(QUESTION + " 42")
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(full[:-1]),
            loss_fn_inputs={"target_tokens": full[1:], "weights": [1.0] * (len(full) - 1)},
        )
        with pytest.raises(mint.RequestFailedError, match="injected fault") as info:
            tc.forward_backward([datum], "cross_entropy").result()
        assert info.value.category == types.RequestErrorCategory.Server
        tc.forward_backward([datum], "cross_entropy").result()  # the next seq_id runs
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        assert server.stats.applied["forward_backward"] == 1
        sampler = tc.save_weights_and_get_sampling_client()
        prompt = types.ModelInput.from_ints(tokenizer.encode(QUESTION))
        with pytest.raises(mint.RequestFailedError, match="injected fault"):
            sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2)).result()
        assert_exactly_once(server, tc.model_id)


def test_random_fault_mix_keeps_training_exactly_once() -> None:
    spec = (
        "seed=11,retry_after_s=0.05,slow_s=0.05,"
        "500:0.03,503:0.03,429:0.02,408:0.03,drop:0.03,drop~after:0.03,500~after:0.03,slow:0.03"
    )
    with LocalServer(api_key=KEY, faults=spec) as server:
        model_id = one_step(server, steps=3)
        assert sum(v for k, v in server.stats.faults_injected.items() if "@" not in k) > 0
        assert_exactly_once(server, model_id, steps=3)
