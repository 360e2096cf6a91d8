"""Wire-level tests of the local server: raw HTTP (httpx) against ``serve_local`` running
in the test's event loop, with the real backend and the packaged model. They check what
the SDK hides: seq ordering, (model_id, seq_id) dedupe, long-polls, auth, size limits,
batching and the error shapes."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import pytest

from engine.local import Limits, RunningServer, ServerConfig, serve_local

pytestmark = pytest.mark.anyio

KEY = "tml-protocol-test"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def server() -> AsyncIterator[RunningServer]:
    async with serve_local(
        ServerConfig(api_key=KEY, long_poll_s=0.2, seq_gap_timeout_s=60)
    ) as running:
        yield running


@pytest.fixture
async def http(server: RunningServer) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(
        base_url=server.base_url, headers={"X-API-Key": KEY}, timeout=60
    ) as client:
        yield client


async def post(http: httpx.AsyncClient, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = await http.post(f"/api/v1/{path}", json=body)
    assert response.status_code == 200, response.text
    data: dict[str, Any] = response.json()
    return data


async def result(http: httpx.AsyncClient, request_id: str) -> dict[str, Any]:
    """Poll a future until it is no longer try_again (as the SDK does)."""
    while True:
        answer = await post(http, "retrieve_future", {"request_id": request_id})
        if answer.get("type") != "try_again":
            return answer


async def new_model(http: httpx.AsyncClient, server: RunningServer, seq: int = 0) -> str:
    session = (await post(http, "create_session", {"tags": [], "user_metadata": {}}))["session_id"]
    ref = await post(
        http,
        "create_model",
        {
            "session_id": session,
            "model_seq_id": seq,
            "base_model": server.model_name,
            "lora_config": {"rank": 4, "seed": 0},
        },
    )
    model_id: str = (await result(http, ref["request_id"]))["model_id"]
    return model_id


def datum(n: int = 6) -> dict[str, Any]:
    tokens = [10 + i for i in range(n + 1)]
    return {
        "model_input": {"chunks": [{"tokens": tokens[:-1], "type": "encoded_text"}]},
        "loss_fn_inputs": {
            "target_tokens": {"data": tokens[1:], "dtype": "int64", "shape": [n]},
            "weights": {"data": [1.0] * n, "dtype": "float32", "shape": [n]},
        },
    }


def fwd_bwd(model_id: str, seq_id: int, **overrides: Any) -> dict[str, Any]:
    body = {
        "forward_backward_input": {"data": [datum()], "loss_fn": "cross_entropy"},
        "model_id": model_id,
        "seq_id": seq_id,
    }
    body.update(overrides)
    return body


def optim(model_id: str, seq_id: int) -> dict[str, Any]:
    return {"adam_params": {"learning_rate": 1e-3}, "model_id": model_id, "seq_id": seq_id}


async def test_client_config_discovery_and_session_endpoints(
    server: RunningServer, http: httpx.AsyncClient
) -> None:
    config = await post(http, "client/config", {"sdk_version": "0.22.0"})
    assert config["pjwt_auth_enabled"] is True
    assert config["parallel_fwdbwd_chunks"] is False
    assert config["proto_write_fwdbwd"] is True  # forward_backward as protobuf from 0.22 too
    # tinker 0.22 sends the checkpoint-archive request through pyqwest too, which
    # follows the 302 that request must see: httpx for it, pyqwest from 0.38.
    assert config["use_pyqwest_transport"] is False
    newer = await post(http, "client/config", {"sdk_version": "0.38.0"})
    assert newer["use_pyqwest_transport"] is True
    assert (await post(http, "client/config", {}))["use_pyqwest_transport"] is False
    caps = (await http.get("/api/v1/get_server_capabilities")).json()
    assert caps["supported_models"][0]["model_name"] == server.model_name
    assert caps["supported_models"][0]["max_context_length"] > 0
    assert (await post(http, "telemetry", {"events": []})) == {"status": "accepted"}
    session = await post(http, "create_session", {"tags": []})
    assert session["session_id"].startswith("session-")
    assert await post(http, "session_heartbeat", {"session_id": session["session_id"]}) == {
        "type": "session_heartbeat"
    }
    async with httpx.AsyncClient(base_url=server.base_url) as anonymous:
        assert (await anonymous.get("/api/v1/healthz")).json() == {"status": "ok"}


async def test_auth_requires_the_key_or_an_issued_jwt(
    server: RunningServer, http: httpx.AsyncClient
) -> None:
    token = (await post(http, "auth/token", {}))["jwt"]
    async with httpx.AsyncClient(base_url=server.base_url) as anonymous:
        missing = await anonymous.post("/api/v1/create_session", json={})
        assert missing.status_code == 401
        assert "missing API key" in missing.json()["error"]
        wrong = await anonymous.post(
            "/api/v1/create_session", json={}, headers={"X-API-Key": "tml-wrong"}
        )
        assert wrong.status_code == 401 and "invalid API key" in wrong.json()["error"]
        with_jwt = await anonymous.post(
            "/api/v1/create_session", json={}, headers={"X-API-Key": token}
        )
        assert with_jwt.status_code == 200
        assert KEY not in missing.text + wrong.text  # the key never echoes back


async def test_operations_run_in_seq_order_even_when_posted_out_of_order(
    server: RunningServer, http: httpx.AsyncClient
) -> None:
    model_id = await new_model(http, server)
    # optim_step (seq 2) arrives first: it must wait for forward_backward (seq 1).
    opt_ref = await post(http, "optim_step", optim(model_id, 2))
    held = await post(http, "retrieve_future", {"request_id": opt_ref["request_id"]})
    assert held == {
        "type": "try_again",
        "request_id": opt_ref["request_id"],
        "queue_state": "active",
    }
    fb_ref = await post(http, "forward_backward", fwd_bwd(model_id, 1))
    fb = await result(http, fb_ref["request_id"])
    opt = await result(http, opt_ref["request_id"])
    assert fb["metrics"]["loss:sum"] > 0
    # Had the step run first there would have been no gradient yet.
    assert opt["metrics"]["grad_norm:mean"] > 0
    assert await server.backend_call(lambda b: b.optimizer_steps(model_id)) == 1


async def test_resubmitted_seq_id_returns_the_original_future_and_applies_once(
    server: RunningServer, http: httpx.AsyncClient
) -> None:
    model_id = await new_model(http, server)
    await result(http, (await post(http, "forward_backward", fwd_bwd(model_id, 1)))["request_id"])
    first = await post(http, "optim_step", optim(model_id, 2))
    again = await http.post(
        "/api/v1/optim_step", json=optim(model_id, 2), headers={"X-Idempotency-Key": "other"}
    )
    assert again.json()["request_id"] == first["request_id"]
    await result(http, first["request_id"])
    third = await post(http, "optim_step", optim(model_id, 2))  # after it was applied
    assert third["request_id"] == first["request_id"]
    assert await server.backend_call(lambda b: b.optimizer_steps(model_id)) == 1
    stats = server.stats
    assert stats.optimizer_steps[model_id] == 1
    assert stats.dedupe_hits["optim_step"] == 2


async def test_create_model_dedupes_on_session_and_model_seq_id(
    server: RunningServer, http: httpx.AsyncClient
) -> None:
    body = {
        "session_id": "session-x",
        "model_seq_id": 0,
        "base_model": server.model_name,
        "lora_config": {"rank": 2},
    }
    first = await post(http, "create_model", body)
    second = await post(http, "create_model", body)
    assert first["request_id"] == second["request_id"]
    await result(http, first["request_id"])
    assert server.stats.models == 1


async def test_bad_input_fails_its_future_but_keeps_the_models_order(
    server: RunningServer, http: httpx.AsyncClient
) -> None:
    model_id = await new_model(http, server)
    bad_loss = fwd_bwd(model_id, 1)
    bad_loss["forward_backward_input"]["loss_fn"] = "mse"
    failed = await result(http, (await post(http, "forward_backward", bad_loss))["request_id"])
    assert failed["category"] == "user" and "unsupported loss_fn 'mse'" in failed["error"]

    short = fwd_bwd(model_id, 2)
    short["forward_backward_input"]["data"][0]["loss_fn_inputs"]["weights"] = {
        "data": [1.0, 1.0],
        "dtype": "float32",
    }
    failed = await result(http, (await post(http, "forward_backward", short))["request_id"])
    assert "loss_fn_inputs.weights has shape [2] but must be [6]" in failed["error"]

    image = fwd_bwd(model_id, 3)
    image["forward_backward_input"]["data"][0]["model_input"]["chunks"].append(
        {"type": "image", "data": "AAAA", "format": "png"}
    )
    failed = await result(http, (await post(http, "forward_backward", image))["request_id"])
    assert "image chunk" in failed["error"] and "text-only" in failed["error"]

    out_of_vocab = fwd_bwd(model_id, 4)
    out_of_vocab["forward_backward_input"]["data"][0]["model_input"]["chunks"][0]["tokens"][0] = (
        10**6
    )
    failed = await result(http, (await post(http, "forward_backward", out_of_vocab))["request_id"])
    assert "token id 1000000, outside the model's vocabulary" in failed["error"]

    malformed = await post(http, "optim_step", {"model_id": model_id, "seq_id": 5})
    failed = await result(http, malformed["request_id"])
    assert failed["error"] == "invalid optim_step request: adam_params: Field required"

    # Every failure consumed its turn: the next operation is not blocked.
    ok = await result(
        http, (await post(http, "forward_backward", fwd_bwd(model_id, 6)))["request_id"]
    )
    assert "error" not in ok and len(ok["loss_fn_outputs"]) == 1
    logprobs = ok["loss_fn_outputs"][0]["logprobs"]
    assert logprobs["dtype"] == "float32" and logprobs["shape"] == [6]


async def test_unknown_ids_and_unsupported_endpoints_get_clear_errors(
    server: RunningServer, http: httpx.AsyncClient
) -> None:
    failed = await result(
        http, (await post(http, "forward_backward", fwd_bwd("model-nope", 1)))["request_id"]
    )
    assert failed["category"] == "user" and "unknown model_id 'model-nope'" in failed["error"]
    gone = await http.post("/api/v1/retrieve_future", json={"request_id": "req-nope"})
    assert gone.status_code == 410 and "unknown or its result has expired" in gone.json()["error"]
    info = await http.post("/api/v1/get_info", json={"model_id": "model-nope"})
    assert info.status_code == 404 and "unknown model_id" in info.json()["error"]
    sampler = await http.get("/api/v1/samplers/sampler-nope")
    assert sampler.status_code == 404
    kl = await post(http, "mint/forward_backward_reverse_kl", {"model_id": "x", "data": []})
    failed = await result(http, kl["request_id"])
    assert "not supported by the local server" in failed["error"]
    audit = await http.get("/api/v1/audit")
    assert audit.status_code == 400 and "not supported by the local server" in audit.json()["error"]
    unknown_base = await post(
        http,
        "create_model",
        {
            "session_id": "s",
            "model_seq_id": 9,
            "base_model": "Qwen/Qwen3-8B",
            "lora_config": {"rank": 4},
        },
    )
    failed = await result(http, unknown_base["request_id"])
    assert f"this local server serves {server.model_name!r}" in failed["error"]
    bad_json = await http.post(
        "/api/v1/create_session", content=b"{not json", headers={"Content-Type": "application/json"}
    )
    assert (
        bad_json.status_code == 400 and bad_json.json()["error"] == "request body is not valid JSON"
    )


async def test_checkpoint_names_and_paths_are_sanitised(
    server: RunningServer, http: httpx.AsyncClient
) -> None:
    model_id = await new_model(http, server)
    bad = await post(
        http, "save_weights", {"model_id": model_id, "path": "../../evil", "seq_id": 1}
    )
    failed = await result(http, bad["request_id"])
    assert "must be a plain name" in failed["error"]
    missing = await post(
        http,
        "load_weights",
        {"model_id": model_id, "path": f"tinker://{model_id}/weights/never", "seq_id": 2},
    )
    assert "not found" in (await result(http, missing["request_id"]))["error"]
    info = await http.post("/api/v1/weights_info", json={"tinker_path": "tinker://x/../y"})
    assert info.status_code == 400 and "must look like" in info.json()["error"]
    saved = await result(
        http,
        (await post(http, "save_weights", {"model_id": model_id, "path": "ok", "seq_id": 3}))[
            "request_id"
        ],
    )
    assert saved["path"] == f"tinker://{model_id}/weights/ok"
    assert (server.data_dir / model_id / "weights" / "ok").is_dir()
    again = await post(http, "save_weights", {"model_id": model_id, "path": "ok", "seq_id": 4})
    assert "already exists" in (await result(http, again["request_id"]))["error"]
    weights = await post(http, "weights_info", {"tinker_path": saved["path"]})
    assert weights["base_model"] == server.model_name and weights["lora_rank"] == 4


async def test_a_gap_is_never_skipped_and_far_future_seq_ids_are_refused() -> None:
    async with (
        serve_local(ServerConfig(long_poll_s=5, seq_gap_timeout_s=0.2)) as server,
        httpx.AsyncClient(base_url=server.base_url, timeout=60) as http,
    ):
        model_id = await new_model(http, server)
        stray = await post(http, "forward_backward", fwd_bwd(model_id, 10**9))
        refused = await result(http, stray["request_id"])
        assert "seq_id 1000000000 is implausible" in refused["error"]
        assert refused["category"] == "user"
        early = await post(http, "forward_backward", fwd_bwd(model_id, 2))
        timed_out = await result(http, early["request_id"])
        assert "waited 0.2 s for seq_id 1" in timed_out["error"]
        assert server.stats.seq_gap_timeouts == 1
        for seq_id in (1, 2):  # the client's own operations still run, seq_id 2 included
            ref = await post(http, "forward_backward", fwd_bwd(model_id, seq_id))
            assert "error" not in await result(http, ref["request_id"])


async def test_request_size_limits() -> None:
    async with (
        serve_local(
            ServerConfig(limits=Limits(max_body_bytes=2000, max_datums=2, max_request_tokens=10))
        ) as server,
        httpx.AsyncClient(base_url=server.base_url, timeout=60) as http,
    ):
        model_id = await new_model(http, server)
        big = fwd_bwd(model_id, 1)
        big["forward_backward_input"]["data"] = [datum(50)] * 4
        too_large = await http.post("/api/v1/forward_backward", json=big)
        assert too_large.status_code == 413
        assert "exceeds the local server's limit of 2000 bytes" in too_large.json()["error"]
        many = fwd_bwd(model_id, 1)
        many["forward_backward_input"]["data"] = [datum(2)] * 3
        failed = await result(http, (await post(http, "forward_backward", many))["request_id"])
        assert "at most 2 per request (its --max-datums)" in failed["error"]
        long = fwd_bwd(model_id, 2)
        long["forward_backward_input"]["data"] = [datum(6)] * 2
        failed = await result(http, (await post(http, "forward_backward", long))["request_id"])
        assert "got 12 model_input tokens in 2 datums" in failed["error"]
        assert "at most 10 per request (its --max-request-tokens)" in failed["error"]
        assert failed["category"] == "user"


async def sampling_session(http: httpx.AsyncClient, server: RunningServer) -> str:
    answer = await post(
        http,
        "create_sampling_session",
        {"session_id": "s", "sampling_session_seq_id": 0, "base_model": server.model_name},
    )
    sid: str = answer["sampling_session_id"]
    return sid


def sample_body(sid: str, seq_id: int, **params: Any) -> dict[str, Any]:
    return {
        "sampling_session_id": sid,
        "seq_id": seq_id,
        "num_samples": 2,
        "prompt": {"chunks": [{"tokens": [1, 60, 70, 80], "type": "encoded_text"}]},
        "sampling_params": {"max_tokens": 4, "temperature": 1.0, "seed": seq_id, **params},
    }


async def test_concurrent_sample_requests_run_as_one_batch(
    server: RunningServer, http: httpx.AsyncClient
) -> None:
    sid = await sampling_session(http, server)
    started, release = threading.Event(), threading.Event()

    def occupy(_backend: object) -> None:
        started.set()
        release.wait(30)

    # the thread samples run on: the sampler's own when sampling runs apart
    sampling = server.service.sampling.batcher.thread or server.service.compute
    async with anyio.create_task_group() as tg:
        tg.start_soon(sampling.run, lambda: occupy(None))
        await anyio.to_thread.run_sync(started.wait, 30)
        refs = [await post(http, "asample", sample_body(sid, n)) for n in range(6)]
        release.set()
    answers = [await result(http, ref["request_id"]) for ref in refs]
    for answer in answers:
        assert len(answer["sequences"]) == 2
        for seq in answer["sequences"]:
            assert 1 <= len(seq["tokens"]) <= 4 and len(seq["logprobs"]) == len(seq["tokens"])
    stats = server.stats
    assert stats.sample_requests == 6
    # All six arrived while the sampling thread was busy, so they ran as one batch.
    assert stats.sample_batches == 1 and stats.largest_sample_batch == 6


async def test_sample_validation_and_dedupe(server: RunningServer, http: httpx.AsyncClient) -> None:
    sid = await sampling_session(http, server)
    too_long = await post(http, "asample", sample_body(sid, 1, max_tokens=10_000))
    assert (
        "exceeds the model's max_context_length"
        in (await result(http, too_long["request_id"]))["error"]
    )
    image = sample_body(sid, 2)
    image["prompt"]["chunks"].append(
        {"type": "image_asset_pointer", "location": "x", "format": "png"}
    )
    assert (
        "image_asset_pointer chunk"
        in (await result(http, (await post(http, "asample", image))["request_id"]))["error"]
    )
    unknown = sample_body("sampler-nope", 3)
    assert (
        "unknown sampling_session_id"
        in (await result(http, (await post(http, "asample", unknown))["request_id"]))["error"]
    )
    first = await post(http, "asample", sample_body(sid, 4))
    again = await post(http, "asample", sample_body(sid, 4))
    assert first["request_id"] == again["request_id"]
    with_prompt_lp = sample_body(sid, 5)
    with_prompt_lp["prompt_logprobs"] = True
    answer = await result(http, (await post(http, "asample", with_prompt_lp))["request_id"])
    assert answer["prompt_logprobs"][0] is None and len(answer["prompt_logprobs"]) == 4


async def test_the_server_answers_while_the_compute_thread_is_busy(
    server: RunningServer, http: httpx.AsyncClient
) -> None:
    model_id = await new_model(http, server)
    started, release = threading.Event(), threading.Event()

    def occupy(_backend: object) -> None:
        started.set()
        release.wait(30)

    async with anyio.create_task_group() as tg:
        tg.start_soon(server.backend_call, occupy)
        await anyio.to_thread.run_sync(started.wait, 30)
        # Training work queues behind the busy thread, everything else still answers.
        ref = await post(http, "forward_backward", fwd_bwd(model_id, 1))
        pending = await post(http, "retrieve_future", {"request_id": ref["request_id"]})
        assert pending["type"] == "try_again"
        assert (await http.get("/api/v1/healthz")).json() == {"status": "ok"}
        assert await post(http, "session_heartbeat", {"session_id": "s"})
        assert (await http.get("/api/v1/get_server_capabilities")).status_code == 200
        release.set()
    assert "error" not in await result(http, ref["request_id"])


async def test_leaving_serve_local_releases_held_long_polls() -> None:
    answers: list[dict[str, Any]] = []

    async def poll(base_url: str, request_id: str) -> None:
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as own:
            answers.append(await post(own, "retrieve_future", {"request_id": request_id}))

    # The poll task outlives the server: contexts close right to left, server first.
    async with (
        anyio.create_task_group() as tg,
        serve_local(ServerConfig(long_poll_s=600, seq_gap_timeout_s=600)) as server,
        httpx.AsyncClient(base_url=server.base_url, timeout=60) as http,
    ):
        model_id = await new_model(http, server)
        ref = await post(http, "forward_backward", fwd_bwd(model_id, 2))  # waits for seq 1
        tg.start_soon(poll, server.base_url, ref["request_id"])
        await server.service.futures.next_hold()
        assert server.stats.polls_held == 1
        # Leaving the server block with the poll still held must not wait 600 s; the
        # step's result will never come, so the poll ends with a failure (a try_again
        # would be re-polled at once, in a loop, until the port closed).
    assert answers == [
        {"error": "the local server stopped before this request finished", "category": "server"}
    ]


async def test_a_cancelled_caller_is_still_served_while_it_winds_down() -> None:
    """An engine cancelled by its host still talks to its in-process server as it winds
    down (its stop checkpoint, its session's close): the server runs its operations, not
    only its HTTP front, until the block exits. A training step submitted then finishes."""
    async with (
        anyio.create_task_group() as host,
        serve_local(ServerConfig(long_poll_s=0.2)) as server,
    ):
        host.cancel_scope.cancel()
        with anyio.CancelScope(shield=True), anyio.fail_after(60):  # a hang guard
            async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
                model_id = await new_model(http, server)
                ref = await post(http, "forward_backward", fwd_bwd(model_id, 1))
                done = await result(http, ref["request_id"])
    assert "loss_fn_outputs" in done, done


async def test_in_memory_sampler_snapshots_are_bounded() -> None:
    async with (
        serve_local(ServerConfig(limits=Limits(max_ephemeral_samplers=2))) as server,
        httpx.AsyncClient(base_url=server.base_url, timeout=60) as http,
    ):
        model_id = await new_model(http, server)
        sessions = []
        for seq in range(1, 4):
            ref = await post(
                http,
                "save_weights_for_sampler",
                {"model_id": model_id, "seq_id": seq, "sampling_session_seq_id": seq},
            )
            sessions.append((await result(http, ref["request_id"]))["sampling_session_id"])
        oldest = await post(http, "asample", sample_body(sessions[0], 1))
        failed = await result(http, oldest["request_id"])
        assert "was released" in failed["error"] and "keeps at most 2" in failed["error"]
        newest = await post(http, "asample", sample_body(sessions[2], 2))
        assert len((await result(http, newest["request_id"]))["sequences"]) == 2
        assert server.stats.sampling_sessions == 2


async def test_a_reused_seq_id_with_a_different_body_is_refused_not_deduped(
    server: RunningServer, http: httpx.AsyncClient
) -> None:
    model_id = await new_model(http, server)
    first = await post(http, "forward_backward", fwd_bwd(model_id, 1))
    await result(http, first["request_id"])
    # A second client for the same model starting again at seq_id 1 with other data:
    other = fwd_bwd(model_id, 1)
    other["forward_backward_input"]["data"] = [datum(3)]
    clash = await post(http, "forward_backward", other)
    assert clash["request_id"] != first["request_id"]
    failed = await result(http, clash["request_id"])
    assert (
        "seq_id 1 of model" in failed["error"] and "already used by a different" in failed["error"]
    )
    assert server.stats.applied["forward_backward"] == 1


async def test_a_resubmitted_ephemeral_sampler_save_gets_the_original_future(
    server: RunningServer, http: httpx.AsyncClient
) -> None:
    # The SDK resubmits an ephemeral save_weights_for_sampler under the same seq_id but
    # with a fresh sampling_session_seq_id: still the same operation, answered once.
    model_id = await new_model(http, server)
    body = {"model_id": model_id, "seq_id": 1, "sampling_session_seq_id": 0}
    first = await post(http, "save_weights_for_sampler", body)
    again = await post(http, "save_weights_for_sampler", {**body, "sampling_session_seq_id": 1})
    assert again["request_id"] == first["request_id"]
    answer = await result(http, first["request_id"])
    assert "error" not in answer and answer["sampling_session_id"]
    assert server.stats.applied["save_weights_for_sampler"] == 1
    assert server.stats.dedupe_hits["save_weights_for_sampler"] == 1
