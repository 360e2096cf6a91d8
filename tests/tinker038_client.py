"""Drives the unmodified tinker 0.38 SDK against a local server; run in the .venv-tinker
interpreter by tests/test_local_server_tinker038.py (it cannot import the engine, whose
environment pins tinker 0.22). Asserts as it goes and prints one JSON report line last.

    python tests/tinker038_client.py BASE_URL {sync|async|errors|stable_reinforce|hosted}
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import warnings
from typing import Any

import tinker
from tinker import types

warnings.simplefilter("ignore", FutureWarning)  # deprecated-but-supported calls are tested

QUESTION = "Question: What is 12 + 30?\nAnswer:"


def sft_datum(tokenizer: Any, prompt: str, answer: str) -> types.Datum:
    prompt_tokens = tokenizer.encode(prompt)
    full = tokenizer.encode(prompt + answer)
    weights = [0.0] * (len(prompt_tokens) - 1) + [1.0] * (len(full) - len(prompt_tokens))
    targets: list[int] = full[1:]
    return types.Datum(
        model_input=types.ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={
            "target_tokens": types.TensorData(data=targets, dtype="int64", shape=[len(targets)]),
            "weights": types.TensorData(data=weights, dtype="float32", shape=[len(weights)]),
        },
    )


def model_name(base_url: str) -> str:
    rest = tinker.RestClient(base_url=base_url)
    return rest.get_server_capabilities().result().supported_models[0].model_name or ""


def sync_flow(base_url: str) -> dict[str, Any]:
    service = tinker.ServiceClient(base_url=base_url)
    rest = tinker.RestClient(base_url=base_url)
    base = model_name(base_url)
    tc = service.create_lora_training_client(base_model=base, rank=8, seed=1).result()
    tokenizer = tc.get_tokenizer()
    data = [sft_datum(tokenizer, QUESTION, " 42"), sft_datum(tokenizer, QUESTION, " 42</s>")]

    losses = []
    for _ in range(3):
        fb = tc.forward_backward(data, "cross_entropy")  # submitted back to back
        opt = tc.optim_step(types.AdamParams(learning_rate=2e-3))
        out = fb.result()
        losses.append(out.metrics["loss:sum"])
        assert [len(o["logprobs"].tolist()) for o in out.loss_fn_outputs] == [
            len(d.model_input.to_ints()) for d in data
        ]
        assert opt.result().metrics is not None
    assert losses[-1] < losses[0], losses

    forward = tc.forward(data, "cross_entropy").result()  # forward_only on forward_backward
    prompt = types.ModelInput.from_ints(tokenizer.encode(QUESTION))
    sampler = tc.save_weights_and_get_sampling_client().result()
    response = sampler.sample(prompt, 3, types.SamplingParams(max_tokens=6, seed=0)).result()
    ids = [seq.sequence_id for seq in response.sequences]
    assert len(ids) == 3 and len(set(ids)) == 3 and all(ids), ids
    for seq in response.sequences:
        assert seq.stop_reason in ("length", "stop") and len(seq.logprobs or []) == len(seq.tokens)

    scored = sampler.sample(
        prompt,
        1,
        types.SamplingParams(max_tokens=1),
        include_prompt_logprobs=True,
        topk_prompt_logprobs=3,
        prompt_logprobs_last_n=2,
    ).result()
    plp = scored.prompt_logprobs or []
    assert len(plp) == len(prompt.to_ints()) and all(x is None for x in plp[:-2]), plp
    assert all(isinstance(x, float) and math.isfinite(x) for x in plp[-2:]), plp
    topk = scored.topk_prompt_logprobs or []
    assert all(row is None for row in topk[:-2]) and all(len(row or []) == 3 for row in topk[-2:])
    logprobs = sampler.compute_logprobs(prompt).result()
    assert logprobs[0] is None and len(logprobs) == len(prompt.to_ints())

    state = tc.save_state("after-3", user_metadata={"step": "3"}).result().path
    assert state == f"tinker://{tc.model_id}/weights/after-3", state
    named = tc.save_weights_for_sampler("sampler-3").result().path
    from_path = service.create_sampling_client(model_path=named).result()
    assert from_path.compute_logprobs(prompt).result() == logprobs

    # A sampler rebuilt from its handle joins the session for a fresh seq_id block.
    clone = tinker.SamplingClient.from_sampler_handle(sampler.get_sampler_handle())
    again = clone.sample(prompt, 2, types.SamplingParams(max_tokens=4, seed=0)).result()
    assert len(again.sequences) == 2

    resumed = service.create_training_client_from_state_with_optimizer(state).result()
    assert resumed.model_id == f"{service.holder.get_session_id()}:train:1", resumed.model_id
    fwd_a = tc.forward(data, "cross_entropy").result().metrics["loss:sum"]
    fwd_b = resumed.forward(data, "cross_entropy").result().metrics["loss:sum"]
    assert math.isclose(fwd_a, fwd_b, rel_tol=1e-6), (fwd_a, fwd_b)
    resumed.forward_backward(data, "cross_entropy").result()
    resumed.optim_step(types.AdamParams(learning_rate=2e-3)).result()
    weights_only = service.create_training_client_from_state(state).result()
    tc.load_state(state).result()  # deprecated, still served

    checkpoints = rest.list_checkpoints(tc.model_id).result().checkpoints
    kinds = sorted((c.checkpoint_type, c.checkpoint_id) for c in checkpoints)
    assert ("sampler", "sampler_weights/sampler-3") in kinds, kinds
    assert ("training", "weights/after-3") in kinds, kinds
    metadata = {c.checkpoint_id: c.user_metadata for c in checkpoints}
    assert metadata["weights/after-3"] == {"step": "3"}, metadata
    runs = rest.list_training_runs().result().training_runs
    assert {tc.model_id, resumed.model_id} <= {r.training_run_id for r in runs}
    info = rest.get_weights_info_by_tinker_path(state).result()
    assert info.lora_rank == 8 and info.is_lora

    service.close("success").result()
    return {
        "losses": losses,
        "forward_loss": forward.metrics["loss:sum"],
        "model_ids": [tc.model_id, resumed.model_id, weights_only.model_id],
        "state": state,
        "sampler": named,
        "sequence_ids": ids,
    }


async def async_flow(base_url: str) -> dict[str, Any]:
    service = tinker.ServiceClient(base_url=base_url)
    base = model_name(base_url)
    tc = await service.create_lora_training_client(base_model=base, rank=4, seed=2)
    tokenizer = tc.get_tokenizer()
    data = [sft_datum(tokenizer, QUESTION, " 42")]
    losses = []
    for _ in range(2):
        fb = tc.forward_backward(data, "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=2e-3))
        losses.append((await fb).metrics["loss:sum"])
        await opt
    sampler = await tc.save_weights_and_get_sampling_client()
    prompt = types.ModelInput.from_ints(tokenizer.encode(QUESTION))
    responses = await asyncio.gather(
        *(
            sampler.sample_async(prompt, 2, types.SamplingParams(max_tokens=4, seed=i))
            for i in range(4)
        )
    )
    ids = [seq.sequence_id for r in responses for seq in r.sequences]
    assert len(ids) == 8 and len(set(ids)) == 8, ids
    path = (await tc.save_state("async-1")).path
    named = (await tc.save_weights_for_sampler("async-sampler")).path
    resumed = await service.create_training_client_from_state(path)
    await resumed.forward_backward(data, "cross_entropy")
    await service.close("success")
    return {"losses": losses, "state": path, "sampler": named, "model_id": tc.model_id}


def provenance_datum(prompt: list[int], seq: Any, advantage: float) -> types.Datum:
    """One sampled sequence as a stable_reinforce datum, its positions attributed."""
    full = prompt + list(seq.tokens)
    n_sampled = len(seq.tokens)
    advantages = [0.0] * (len(prompt) - 1) + [advantage] * n_sampled
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={
            "target_tokens": types.TensorData(data=full[1:], dtype="int64", shape=[len(full) - 1]),
            "advantages": types.TensorData(
                data=advantages, dtype="float32", shape=[len(advantages)]
            ),
        },
    )
    sid = seq.sequence_id
    return datum.with_provenance(
        model_input=[
            types.PromptProvenanceSpan(sequence_id=sid, length=len(prompt)),
            types.SampledProvenanceSpan(sequence_id=sid, length=n_sampled - 1),
        ],
        loss_fn_inputs=[
            types.PromptProvenanceSpan(sequence_id=sid, offset=1, length=len(prompt) - 1),
            types.SampledProvenanceSpan(sequence_id=sid, length=n_sampled),
        ],
    )


def stable_reinforce_flow(base_url: str) -> dict[str, Any]:
    """StableReinforce as the hosted docs describe it: sample with record_stability_info,
    attribute each datum's tokens to its sequence_id, train with loss_fn_config."""
    service = tinker.ServiceClient(base_url=base_url)
    base = model_name(base_url)
    tc = service.create_lora_training_client(base_model=base, rank=4, seed=3).result()
    prompt = tc.get_tokenizer().encode(QUESTION)
    sampler = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=7)
    response = sampler.sample(types.ModelInput.from_ints(prompt), 4, params).result()
    # the first sequence (and any repeat of it) is trained up, the others down
    signs = [
        1.0 if seq.tokens == response.sequences[0].tokens else -1.0 for seq in response.sequences
    ]
    assert -1.0 in signs, "the four samples should not all be the same"
    mean = sum(signs) / len(signs)
    data = [
        provenance_datum(prompt, seq, sign - mean)
        for seq, sign in zip(response.sequences, signs, strict=True)
    ]
    config = {"kl_coeff": 0.01}
    first = tc.forward_backward(data, "stable_reinforce", loss_fn_config=config).result()
    tc.optim_step(types.AdamParams(learning_rate=2e-3)).result()
    for _ in range(2):
        tc.forward_backward(data, "stable_reinforce", loss_fn_config=config).result()
        tc.optim_step(types.AdamParams(learning_rate=2e-3)).result()
    last = tc.forward(data, "stable_reinforce", loss_fn_config=config).result()

    def sampled_logprob(out: Any, i: int) -> float:
        n = len(response.sequences[i].tokens)
        return float(sum(out.loss_fn_outputs[i]["logprobs"].tolist()[-n:]))

    gains = [sampled_logprob(last, i) - sampled_logprob(first, i) for i in range(4)]
    assert math.isfinite(first.metrics["loss:sum"]), first.metrics
    up = [g for g, sign in zip(gains, signs, strict=True) if sign > 0]
    down = [g for g, sign in zip(gains, signs, strict=True) if sign < 0]
    # the trained-up sequence became likelier, and more so than any trained-down one
    assert min(up) > 0 and min(up) > max(down), (gains, signs)

    messages: dict[str, str] = {}
    plain = types.Datum(model_input=data[0].model_input, loss_fn_inputs=data[0].loss_fn_inputs)
    try:
        tc.forward_backward([plain], "stable_reinforce").result()
    except Exception as exc:
        messages["no_provenance"] = f"{type(exc).__name__}: {exc}"
    unrecorded_sampler = tc.save_weights_and_get_sampling_client().result()
    other = unrecorded_sampler.sample(types.ModelInput.from_ints(prompt), 1, params).result()
    try:
        tc.forward_backward(
            [provenance_datum(prompt, other.sequences[0], 1.0)], "stable_reinforce"
        ).result()
    except Exception as exc:
        messages["unrecorded"] = f"{type(exc).__name__}: {exc}"
    service.close("success").result()
    return {
        "gains": gains,
        "signs": signs,
        "first_loss": first.metrics["loss:sum"],
        "messages": messages,
    }


def error_flow(base_url: str) -> dict[str, Any]:
    """Options the local server does not implement fail with a clear message."""
    service = tinker.ServiceClient(base_url=base_url)
    base = model_name(base_url)
    tc = service.create_lora_training_client(base_model=base, rank=4).result()
    tokenizer = tc.get_tokenizer()
    prompt = types.ModelInput.from_ints(tokenizer.encode(QUESTION))
    sampler = tc.save_weights_and_get_sampling_client().result()
    messages: dict[str, str] = {}

    def failure(name: str, call: Any) -> None:
        try:
            call()
        except Exception as exc:
            messages[name] = f"{type(exc).__name__}: {exc}"
        else:
            raise AssertionError(f"{name} should have failed")

    params = types.SamplingParams(max_tokens=2)
    failure(
        "topk_sample_logprobs",
        lambda: sampler.sample(prompt, 1, params, topk_sample_logprobs=2).result(),
    )
    failure(
        "prompt_alt_tokens_k",
        lambda: sampler.sample(prompt, 1, params, prompt_alt_tokens_k=2).result(),
    )
    failure(
        "dimuon",
        lambda: service.create_lora_training_client(
            base_model=base, rank=4, optimizer=types.DimuonOptimizerConfig()
        ).result(),
    )
    service.close("success").result()
    return {"messages": messages}


def hosted_flow(base_url: str) -> dict[str, Any]:
    """Against ``--service tinker`` with one sampling slot: concurrent samples all complete
    (their polls get 408s while queued, which the SDK re-polls), and a loss_fn_config key
    hosted Tinker does not take fails at once, naming it."""
    service = tinker.ServiceClient(base_url=base_url)
    base = model_name(base_url)
    sampler = service.create_sampling_client(base_model=base)
    prompt = types.ModelInput.from_ints([1, 60, 70, 80])
    params = types.SamplingParams(max_tokens=2, seed=0)
    futures = [sampler.sample(prompt, 1, params) for _ in range(8)]
    assert all(len(f.result().sequences) == 1 for f in futures)
    tc = service.create_lora_training_client(base_model=base, rank=4).result()
    targets = [61, 62]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([60, 61]),
        loss_fn_inputs={
            "target_tokens": types.TensorData(data=targets, dtype="int64", shape=[2]),
            "logprobs": types.TensorData(data=[-1.0, -1.0], dtype="float32", shape=[2]),
            "advantages": types.TensorData(data=[1.0, 1.0], dtype="float32", shape=[2]),
        },
    )
    try:
        tc.forward_backward([datum], "importance_sampling", {"tis_cap": 2.0}).result()
    except Exception as exc:
        refused = f"{type(exc).__name__}: {exc}"
    else:
        raise AssertionError("tis_cap should have been refused")
    service.close("success").result()
    return {"samples": len(futures), "refused": refused}


def main() -> None:
    base_url, scenario = sys.argv[1], sys.argv[2]
    if scenario == "sync":
        report = sync_flow(base_url)
    elif scenario == "async":
        report = asyncio.run(async_flow(base_url))
    elif scenario == "errors":
        report = error_flow(base_url)
    elif scenario == "stable_reinforce":
        report = stable_reinforce_flow(base_url)
    elif scenario == "hosted":
        report = hosted_flow(base_url)
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    report["tinker_version"] = tinker.__version__
    print(json.dumps(report))


if __name__ == "__main__":
    main()
