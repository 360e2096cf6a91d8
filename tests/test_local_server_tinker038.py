"""tinker 0.38 clients against the local server, next to 0.22 (``mint``) clients.

The SDK tests run the unmodified tinker 0.38 SDK from ``.venv-tinker`` (made by
``scripts/bootstrap_tinker.sh``; skipped without it, failed under CI) as a subprocess
(``tests/tinker038_client.py``) against a server started here, alone and while a 0.22
client trains on the same server. The wire tests speak 0.38's protobuf directly (the
vendored schema) and need only the main environment: protobuf and zstd bodies, protobuf
results on request, dedupe of resubmitted protobuf requests, and clear errors.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import mint
import numpy as np
import pytest
import zstandard
from mint import types

from engine.local import LocalServer
from engine.local.config import ServerConfig
from engine.local.http.tinker_proto import PROTO_CONTENT_TYPE, encode_result, sample_response
from engine.local.http.tinker_proto import tinker_public_pb2 as pb
from tests import tinker_env

CLIENT = Path(__file__).resolve().parent / "tinker038_client.py"
TML_KEY = "tml-local-tinker038-test"
QUESTION = "Question: What is 12 + 30?\nAnswer:"
CLIENT_TIMEOUT_S = 900  # a loaded 2-core machine; the flows take well under a minute idle


@pytest.fixture(scope="module")
def server() -> Iterator[LocalServer]:
    with LocalServer(api_key=TML_KEY) as running:
        yield running


@pytest.fixture(scope="module")
def tinker_python() -> Path:
    return tinker_env.tinker_python()  # skipped without .venv-tinker; under CI, failed


def client_command(python: Path, server: LocalServer, scenario: str) -> list[str]:
    return [str(python), str(CLIENT), server.base_url, scenario]


def client_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TINKER_", "MINT_"))}
    env.pop("PYTHONPATH", None)  # the engine (and its tinker 0.22) must stay invisible
    env.update(TINKER_API_KEY=TML_KEY, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


def report_of(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert done.returncode == 0, f"tinker 0.38 client failed:\n{done.stderr[-6000:]}"
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["tinker_version"] == "0.38.0"
    return report


def run_client(python: Path, server: LocalServer, scenario: str) -> dict[str, Any]:
    done = subprocess.run(
        client_command(python, server, scenario),
        env=client_env(),
        capture_output=True,
        text=True,
        timeout=CLIENT_TIMEOUT_S,
    )
    return report_of(done)


def sft_datum(tokenizer: Any, prompt: str, answer: str) -> types.Datum:
    prompt_tokens = tokenizer.encode(prompt)
    full = tokenizer.encode(prompt + answer)
    weights = [0.0] * (len(prompt_tokens) - 1) + [1.0] * (len(full) - len(prompt_tokens))
    return types.Datum(
        model_input=types.ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={"target_tokens": full[1:], "weights": weights},
    )


# ---- the tinker 0.38 SDK ---------------------------------------------------------------


def test_sync_training_sampling_checkpoints_and_resume(
    server: LocalServer, tinker_python: Path
) -> None:
    before = server.stats
    report = run_client(tinker_python, server, "sync")
    trained, resumed, weights_only = report["model_ids"]
    assert resumed.endswith(":train:1") and weights_only.endswith(":train:2")
    assert (server.data_dir / trained / "weights" / "after-3").is_dir()
    assert (server.data_dir / resumed).is_dir()  # the resumed run is a training run too
    after = server.stats
    applied = {k: after.applied.get(k, 0) - before.applied.get(k, 0) for k in after.applied}
    assert applied["forward_backward"] == 4 and applied["optim_step"] == 4
    assert applied["forward"] == 3  # forward_only requests on /forward_backward
    # ServiceClient.close finished the session: what it held was released.
    held = set(after.held["models"])
    assert not held & {trained, resumed, weights_only}


def test_async_calls(server: LocalServer, tinker_python: Path) -> None:
    report = run_client(tinker_python, server, "async")
    assert len(report["losses"]) == 2
    assert report["state"] == f"tinker://{report['model_id']}/weights/async-1"


def test_unsupported_options_fail_with_a_clear_message(
    server: LocalServer, tinker_python: Path
) -> None:
    messages = run_client(tinker_python, server, "errors")["messages"]
    assert "topk_sample_logprobs" in messages["topk_sample_logprobs"]
    assert "not supported by the local server" in messages["prompt_alt_tokens_k"]
    assert "implements only AdamW" in messages["dimuon"]


def test_stable_reinforce_trains_on_recorded_samples(
    server: LocalServer, tinker_python: Path
) -> None:
    """record_stability_info at sampling, Datum.with_provenance, loss_fn_config kl_coeff:
    the sequences with positive advantage grow likelier than those with negative; a datum
    without provenance, or naming an unrecorded sequence, fails with a clear message."""
    report = run_client(tinker_python, server, "stable_reinforce")
    up = [g for g, sign in zip(report["gains"], report["signs"], strict=True) if sign > 0]
    down = [g for g, sign in zip(report["gains"], report["signs"], strict=True) if sign < 0]
    assert min(up) > 0 and min(up) > max(down), report
    assert "has no provenance" in report["messages"]["no_provenance"]
    assert "has no stability record" in report["messages"]["unrecorded"]


def test_the_tinker_profile_queues_samples_and_refuses_local_keys(tinker_python: Path) -> None:
    """``--service tinker`` with one sampling slot and simulated sampling time: the 0.38
    SDK's concurrent samples all complete through the queue's 408s, and a local-only
    loss_fn_config key fails at once, naming it (docs/local-server.md, "Service profiles")."""
    config = ServerConfig(
        api_key=TML_KEY,
        service="tinker",
        sampling_slots=1,
        latency="sample_request_s=0.4,sample_token_s=0",
    )
    with LocalServer(config=config) as hosted:
        report = run_client(tinker_python, hosted, "hosted")
        queue = hosted.stats.sampling_queue
    assert report["samples"] == 8
    assert "BadRequestError" in report["refused"] and "'tis_cap'" in report["refused"]
    assert queue["waited_total"] >= 1 and queue["told_to_wait"] >= 1 and queue["waiting"] == 0


def test_a_022_and_a_038_client_share_one_server_at_once(
    server: LocalServer, tinker_python: Path
) -> None:
    """The 0.38 client's full flow runs while a 0.22 client trains and samples; then each
    uses what the other saved (the checkpoints are the same on disk)."""
    child = subprocess.Popen(
        client_command(tinker_python, server, "sync"),
        env=client_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    outputs: list[tuple[str, str]] = []
    reader = threading.Thread(target=lambda: outputs.append(child.communicate()), daemon=True)
    reader.start()
    try:
        service = mint.ServiceClient(base_url=server.base_url, api_key=TML_KEY)
        tc = service.create_lora_training_client(base_model=server.model_name, rank=8, seed=3)
        tokenizer = tc.get_tokenizer()
        data = [sft_datum(tokenizer, QUESTION, " 42")]
        losses = []
        for _ in range(3):
            fb = tc.forward_backward(data, "cross_entropy")
            opt = tc.optim_step(types.AdamParams(learning_rate=5e-3))
            losses.append(fb.result().metrics["loss:sum"])
            opt.result()
        assert losses[-1] < losses[0]
        prompt = types.ModelInput.from_ints(tokenizer.encode(QUESTION))
        sampler = tc.save_weights_and_get_sampling_client()
        response = sampler.sample(prompt, 2, types.SamplingParams(max_tokens=4, seed=0)).result()
        assert len(response.sequences) == 2
        state_022 = tc.save_state("from-022").result().path
    finally:
        reader.join(timeout=CLIENT_TIMEOUT_S)
        if reader.is_alive():
            child.kill()
            reader.join()
    stdout, stderr = outputs[0]
    report = report_of(subprocess.CompletedProcess(child.args, child.wait(), stdout, stderr))

    # 0.22 uses what 0.38 saved, and the other way round.
    from_038 = service.create_sampling_client(model_path=report["sampler"])
    assert len(from_038.compute_logprobs(prompt).result()) == len(prompt.to_ints())
    resumed = service.create_training_client_from_state_with_optimizer(report["state"])
    assert resumed.forward(data, "cross_entropy").result().metrics["loss:sum"] > 0
    assert state_022.startswith("tinker://")


# ---- the protobuf wire, spoken directly -----------------------------------------------


@pytest.fixture(scope="module")
def model(server: LocalServer) -> tuple[str, list[int]]:
    """A model created by a 0.22 client; the wire tests number its seq_ids themselves."""
    service = mint.ServiceClient(base_url=server.base_url, api_key=TML_KEY)
    tc = service.create_lora_training_client(base_model=server.model_name, rank=4, seed=5)
    full = tc.get_tokenizer().encode(QUESTION + " 42")
    return tc.model_id, full


def fb_request(model_id: str, seq_id: int, tokens: list[int], *, forward_only: bool) -> bytes:
    msg = pb.ForwardBackwardRequest(
        model_id=model_id, seq_id=seq_id, loss_fn="cross_entropy", forward_only=forward_only
    )
    datum = msg.data.add()
    datum.model_input.add().encoded_text.tokens = np.asarray(tokens[:-1], "<i4").tobytes()
    targets, weights = np.asarray(tokens[1:], "<i8"), np.ones(len(tokens) - 1, "<f4")
    datum.loss_fn_inputs["target_tokens"].CopyFrom(
        pb.Tensor(dense=targets.tobytes(), dtype=pb.DTYPE_INT64, shape=[len(targets)])
    )
    datum.loss_fn_inputs["weights"].CopyFrom(
        pb.Tensor(dense=weights.tobytes(), dtype=pb.DTYPE_FLOAT32, shape=[len(weights)])
    )
    return msg.SerializeToString()


def post(server: LocalServer, path: str, body: bytes, **headers: str) -> httpx.Response:
    return httpx.post(
        f"{server.base_url}/api/v1/{path}",
        content=body,
        headers={"X-API-Key": TML_KEY, **headers},
        timeout=120,
    )


def result(server: LocalServer, request_id: str, *, proto: bool) -> httpx.Response:
    headers = {"Accept": PROTO_CONTENT_TYPE} if proto else {}
    while True:
        answer = post(
            server, "retrieve_future", json.dumps({"request_id": request_id}).encode(), **headers
        )
        assert answer.status_code == 200, answer.text
        if "json" not in answer.headers["content-type"] or answer.json().get("type") != "try_again":
            return answer


def test_protobuf_forward_backward_plain_and_zstd_with_protobuf_results(
    server: LocalServer, model: tuple[str, list[int]]
) -> None:
    model_id, tokens = model
    proto = {"Content-Type": PROTO_CONTENT_TYPE}
    plain = post(
        server, "forward_backward", fb_request(model_id, 1, tokens, forward_only=True), **proto
    )
    packed = zstandard.ZstdCompressor().compress(fb_request(model_id, 2, tokens, forward_only=True))
    zstd = post(server, "forward_backward", packed, **proto, **{"Content-Encoding": "zstd"})
    assert plain.status_code == zstd.status_code == 200, (plain.text, zstd.text)

    as_json = result(server, plain.json()["request_id"], proto=False).json()
    assert "error" not in as_json, as_json
    as_proto = result(server, zstd.json()["request_id"], proto=True)
    assert as_proto.headers["content-type"] == PROTO_CONTENT_TYPE
    out = pb.ForwardBackwardOutput.FromString(as_proto.content)
    assert dict(out.metrics) == pytest.approx(as_json["metrics"])
    (record,) = out.loss_fn_outputs
    assert record.num_datums == 1
    logprobs = np.frombuffer(record.fields["logprobs"].data, "<f4")
    assert logprobs.tolist() == pytest.approx(as_json["loss_fn_outputs"][0]["logprobs"]["data"])

    # A resubmission (same seq_id and body) answers the same future; a different body
    # under a used seq_id is refused.
    again = post(server, "forward_backward", packed, **proto, **{"Content-Encoding": "zstd"})
    assert again.json()["request_id"] == zstd.json()["request_id"]
    other = fb_request(model_id, 2, tokens[:-1], forward_only=True)
    clash = post(server, "forward_backward", other, **proto)
    assert (
        "already used by a different request"
        in result(server, clash.json()["request_id"], proto=True).json()["error"]
    )


def test_bad_protobuf_bodies_are_clear_4xx(
    server: LocalServer, model: tuple[str, list[int]]
) -> None:
    model_id, tokens = model
    proto = {"Content-Type": PROTO_CONTENT_TYPE}
    bad_zstd = post(
        server, "forward_backward", b"not zstd", **proto, **{"Content-Encoding": "zstd"}
    )
    assert bad_zstd.status_code == 400 and "not valid zstd" in bad_zstd.json()["error"]
    garbage = post(server, "forward_backward", b"\xff\xff\xff", **proto)
    assert garbage.status_code == 400 and "ForwardBackwardRequest" in garbage.json()["error"]
    elsewhere = post(
        server, "optim_step", fb_request(model_id, 9, tokens, forward_only=False), **proto
    )
    assert elsewhere.status_code == 415 and "forward_backward only" in elsewhere.json()["error"]
    gzip = post(server, "forward_backward", b"x", **proto, **{"Content-Encoding": "gzip"})
    assert gzip.status_code == 400 and "zstd only" in gzip.json()["error"]


def test_the_newer_session_calls(server: LocalServer) -> None:
    def json_post(path: str, body: dict[str, Any]) -> httpx.Response:
        return post(server, path, json.dumps(body).encode(), **{"Content-Type": "application/json"})

    dynamic = json_post("client/dynamic_config", {"sdk_version": "0.38.0"})
    assert dynamic.status_code == 200 and dynamic.json()["sample_cancel_enabled"] is False
    session = json_post("create_session", {"tags": [], "sdk_version": "0.38.0"}).json()[
        "session_id"
    ]
    sampler = json_post(
        "create_sampling_session",
        {"session_id": session, "sampling_session_seq_id": 0, "base_model": server.model_name},
    ).json()["sampling_session_id"]
    counters = [
        json_post("join_sampling_session", {"sampling_session_id": sampler}).json()[
            "client_counter"
        ]
        for _ in range(2)
    ]
    assert counters == [1, 2]
    assert json_post("join_sampling_session", {"sampling_session_id": "nope"}).status_code == 404
    finished = json_post(f"sessions/{session}/finish", {"reason": {"type": "success"}})
    assert finished.status_code == 200
    gone = json_post("join_sampling_session", {"sampling_session_id": sampler})
    assert gone.status_code == 404 and "finished by the client" in gone.json()["error"]


def test_sample_results_as_protobuf() -> None:
    payload = {
        "type": "sample",
        "sequences": [
            {"tokens": [5, 6], "logprobs": [-0.5, -1.0], "stop_reason": "stop"},
            {"tokens": [7], "logprobs": [-2.0], "stop_reason": "length"},
        ],
        "prompt_logprobs": [None, -1.5, -0.25],
        "topk_prompt_logprobs": [None, [[3, -0.1], [4, -2.0]], [[9, -0.3]]],
    }
    encoded = encode_result("asample", payload)
    assert encoded is not None and encode_result("optim_step", {"metrics": {}}) is None
    assert encode_result("asample", {"error": "x", "category": "user"}) is None
    msg = pb.SampleResponse.FromString(encoded)
    assert msg == sample_response(payload)
    assert [np.frombuffer(s.tokens, "<i4").tolist() for s in msg.sequences] == [[5, 6], [7]]
    assert [s.stop_reason for s in msg.sequences] == [pb.STOP_REASON_STOP, pb.STOP_REASON_LENGTH]
    prompt = np.frombuffer(msg.prompt_logprobs, "<f4")
    assert np.isnan(prompt[0]) and prompt[1:].tolist() == [-1.5, -0.25]
    topk = msg.topk_prompt_logprobs
    assert (topk.length, topk.k) == (3, 2)
    ids = np.frombuffer(topk.token_ids, "<i4").reshape(3, 2).tolist()
    assert ids == [[0, 0], [3, 4], [9, 0]]  # empty cells: id 0 with the sentinel logprob
    assert np.frombuffer(topk.logprobs, "<f4").reshape(3, 2)[2, 1] == -99999.0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q", "-n0"]))
