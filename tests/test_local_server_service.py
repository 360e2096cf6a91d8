"""Service profiles of the local server (``--service local|mint|tinker``): the losses and
loss_fn_config keys each accepts (the rest a 400 naming them), MinT's session-level
rollout correction (its formula on small tensors, then over the wire), the sampling
slots with their backpressure 408s (raw HTTP, then the unmodified SDK under a saturated
queue) and the rate limit. Raw HTTP runs ``serve_local`` in the test's event loop."""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx
import mint
import pytest
import torch
from mint import types

from benchmarks.quickstart_loop import run_quickstart_loop
from engine.local import LocalServer, RunningServer, serve_local
from engine.local.__main__ import main as local_main
from engine.local.compute.losses import LOSSES
from engine.local.compute.rollout_correction import RolloutCorrectionError, loss, parse
from engine.local.config import Limits, ServerConfig
from engine.local.operations.sampling_gate import QueueFull, SamplingGate
from engine.local.profiles import SERVICES, profile_of
from tests.engine_support import API_KEY, quickstart_task_knobs

BACKPRESSURE = {"X-Tinker-Sampling-Backpressure": "1"}
MIS = {
    "rollout_is": "sequence",
    "rollout_is_threshold": 1.1,
    "rollout_rs": "seq_sum_k1",
    "rollout_rs_threshold": "0.5_2.0",
    "bypass_mode": True,
    "loss_type": "reinforce",
}
"""The config MinT's advanced/validate_mis_rollout_correction.py sends."""


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# ---- the rollout correction's formula, by hand ----------------------------------------

# four response tokens: log ratios lr = logp - q = 0.3, -0.2, 0, 1.5
LOGP = [-1.0, -2.0, -0.5, -0.2]
Q = [-1.3, -1.8, -0.5, -1.7]
ADV = [1.0, 1.0, -2.0, -1.0]
LR = [p - q for p, q in zip(LOGP, Q, strict=True)]


def gradient(config: dict[str, Any]) -> list[float]:
    """d loss / d logp of the corrected importance_sampling loss on the tokens above."""
    logp = torch.tensor(LOGP, requires_grad=True)
    inputs = {"logprobs": torch.tensor(Q), "advantages": torch.tensor(ADV)}
    loss(logp, inputs, parse(config)).backward()
    assert logp.grad is not None
    return [float(g) for g in logp.grad]


def test_reinforce_weights_each_token_by_its_truncated_ratio() -> None:
    """TIS: w = min(exp(lr), U), gradient -w * A."""
    weights = [min(math.exp(lr), 1.2) for lr in LR]
    expected = [-w * a for w, a in zip(weights, ADV, strict=True)]
    config = {"rollout_is": "token", "rollout_is_threshold": 1.2, "bypass_mode": True}
    assert gradient({**config, "loss_type": "reinforce"}) == pytest.approx(expected, rel=1e-5)


def test_sequence_weights_and_icepop_bounds() -> None:
    seq = min(math.exp(sum(LR)), 2.0)  # exp(1.6) = 4.95, truncated at 2
    config = {"rollout_is": "sequence", "rollout_is_threshold": 2.0}
    expected = [-seq * a for a in ADV]
    assert gradient({**config, "bypass_mode": True, "loss_type": "reinforce"}) == pytest.approx(
        expected, rel=1e-5
    )
    # "L_U": weights outside [L, U] are zeroed (IcePop), not truncated
    icepop = [math.exp(lr) if 0.8 <= math.exp(lr) <= 1.25 else 0.0 for lr in LR]
    config = {"rollout_is": "token", "rollout_is_threshold": "0.8_1.25", "bypass_mode": True}
    assert gradient({**config, "loss_type": "reinforce"}) == pytest.approx(
        [-w * a for w, a in zip(icepop, ADV, strict=True)], rel=1e-5, abs=1e-7
    )


def test_rejection_drops_tokens_and_sequences_outside_the_bounds() -> None:
    # token_k1 keeps log(0.9) <= -lr <= log(1.1): only the token with lr = 0
    config = {"rollout_rs": "token_k1", "rollout_rs_threshold": "0.9_1.1", "bypass_mode": True}
    assert gradient({**config, "loss_type": "reinforce"}) == pytest.approx(
        [0.0, 0.0, 2.0, 0.0], abs=1e-7
    )
    # seq_sum_k1: sum(-lr) = -1.6 < log(0.5): the whole sequence is rejected
    rejected = gradient({**MIS, "rollout_is": None})
    assert rejected == pytest.approx([0.0] * 4, abs=1e-7)
    # with bounds that hold it (k1 with one number U: [1/U, U]), plain REINFORCE
    kept = gradient({**MIS, "rollout_is": None, "rollout_rs_threshold": 6.0})
    assert kept == pytest.approx([-a for a in ADV], rel=1e-6)
    # k2 / k3 take an upper bound on lr^2 / 2 and exp(lr) - 1 - lr
    k2 = gradient(
        {
            "rollout_rs": "token_k2",
            "rollout_rs_threshold": 0.03,
            "loss_type": "reinforce",
            "bypass_mode": True,
        }
    )
    assert k2 == pytest.approx([0.0, -1.0, 2.0, 0.0], abs=1e-7)


def test_ppo_clip_clips_against_the_sampler_and_dual_clips_negative_advantages() -> None:
    """verl's bypass ppo_clip: r = exp(logp - q), clip [0.8, 1.2], dual clip 3 for A < 0;
    a clipped token has no gradient, an unclipped one -r * A."""
    ratios = [math.exp(lr) for lr in LR]
    # token 0: r = 1.35, A > 0, clipped; token 3: r = 4.48, A = -1, dual clip -3 -> 0
    expected = [0.0, -ratios[1] * ADV[1], -ratios[2] * ADV[2], 0.0]
    config = {"rollout_is": "token", "bypass_mode": True, "loss_type": "ppo_clip"}
    assert gradient(config) == pytest.approx(expected, rel=1e-5, abs=1e-7)


def test_without_bypass_the_gradient_is_reinforces_weighted_by_w() -> None:
    weights = [min(math.exp(lr), 2.0) for lr in LR]
    config = {"rollout_is": "token", "rollout_is_threshold": 2.0, "bypass_mode": False}
    assert gradient(config) == pytest.approx(
        [-w * a for w, a in zip(weights, ADV, strict=True)], rel=1e-5
    )


def test_prompt_positions_and_padding_are_outside_the_sequence() -> None:
    """Positions where logprobs and advantages are both 0 (the prompt, the padding) add
    nothing, not even to a sequence's ratio: a padded batch row equals the bare datum."""
    rc = parse({**MIS, "rollout_rs": None})
    bare = loss(
        torch.tensor(LOGP), {"logprobs": torch.tensor(Q), "advantages": torch.tensor(ADV)}, rc
    )
    zeros = [0.0, 0.0]
    padded = loss(
        torch.tensor([[-3.0, *LOGP, *zeros]]),
        {
            "logprobs": torch.tensor([[0.0, *Q, *zeros]]),
            "advantages": torch.tensor([[0.0, *ADV, *zeros]]),
        },
        rc,
    )
    assert float(padded[0]) == pytest.approx(float(bare), rel=1e-6)


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"rollout_is": "sequence", "veto": 1e-4}, "'veto'"),
        ({"rollout_is": "geometric"}, "rollout_is"),
        ({"rollout_is_threshold": "2_1"}, "rollout_is_threshold"),
        ({"rollout_rs": "seq_sum_k1"}, "rollout_rs_threshold"),
        ({"rollout_rs": "token_k2", "rollout_rs_threshold": "0.5_2"}, "token_k2"),
        ({"loss_type": "dpo"}, "loss_type"),
        ({"bypass_mode": "yes"}, "bypass_mode"),
    ],
)
def test_a_bad_config_names_the_key(config: dict[str, Any], named: str) -> None:
    with pytest.raises(RolloutCorrectionError, match=named):
        parse(config)


def test_every_profile_accepts_only_losses_and_keys_the_local_server_has() -> None:
    for name in SERVICES:
        for loss_fn, keys in (profile_of(name).losses or {}).items():
            assert keys <= set(LOSSES[loss_fn].config), (name, loss_fn)


# ---- over the wire --------------------------------------------------------------------


@asynccontextmanager
async def serving(service: str, **settings: Any) -> AsyncIterator[tuple[RunningServer, Any]]:
    config = ServerConfig(service=service, long_poll_s=0.2, seq_gap_timeout_s=60, **settings)
    async with (
        serve_local(config) as server,
        httpx.AsyncClient(base_url=server.base_url, timeout=60) as http,
    ):
        yield server, http


async def post(http: httpx.AsyncClient, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = await http.post(f"/api/v1/{path}", json=body)
    assert response.status_code == 200, response.text
    data: dict[str, Any] = response.json()
    return data


async def result(http: httpx.AsyncClient, request_id: str) -> dict[str, Any]:
    while True:
        answer = await post(http, "retrieve_future", {"request_id": request_id})
        if answer.get("type") != "try_again":
            return answer


MODEL_SEQ = itertools.count()


async def create_model(
    http: httpx.AsyncClient, server: RunningServer, **extra: Any
) -> dict[str, Any]:
    ref = await post(
        http,
        "create_model",
        {
            "session_id": "s",
            "model_seq_id": next(MODEL_SEQ),
            "base_model": server.model_name,
            "lora_config": {"rank": 4, "seed": 0},
            **extra,
        },
    )
    return await result(http, ref["request_id"])


def rl_datum(q: list[float], adv: list[float]) -> dict[str, Any]:
    """Prompt token 10, then len(q) - 1 response tokens (position 0 is the prompt's)."""
    n = len(q)
    tokens = [10 + i for i in range(n + 1)]

    def floats(values: list[float]) -> dict[str, Any]:
        return {"data": values, "dtype": "float32", "shape": [n]}

    return {
        "model_input": {"chunks": [{"tokens": tokens[:-1], "type": "encoded_text"}]},
        "loss_fn_inputs": {
            "target_tokens": {"data": tokens[1:], "dtype": "int64", "shape": [n]},
            "logprobs": floats(q),
            "advantages": floats(adv),
        },
    }


def fb_body(
    model_id: str, seq_id: int, loss_fn: str, config: dict[str, Any] | None
) -> dict[str, Any]:
    return {
        "model_id": model_id,
        "seq_id": seq_id,
        "forward_backward_input": {
            "data": [rl_datum([0.0, -1.0, -1.0], [0.0, 1.0, -1.0])],
            "loss_fn": loss_fn,
            "loss_fn_config": config,
        },
    }


REFUSED: dict[str, list[tuple[str, dict[str, float] | None, str]]] = {
    "mint": [
        ("importance_sampling", {"tis_cap": 2.0}, "'tis_cap'"),
        ("importance_sampling", {"temperature": 0.7}, "'temperature'"),
        ("ppo", {"mask_low": 0.5, "mask_high": 2.0}, "'mask_high', 'mask_low'"),
        ("gspo", None, "loss_fn 'gspo'"),
        ("stable_reinforce", {"kl_coeff": 0.01}, "loss_fn 'stable_reinforce'"),
    ],
    "tinker": [
        ("importance_sampling", {"tis_cap": 2.0}, "'tis_cap'"),
        ("ppo", {"temperature": 0.7}, "'temperature'"),
        ("stable_reinforce", {"ratio_cap": 3.0}, "'ratio_cap'"),
    ],
}
ACCEPTED: list[tuple[str, dict[str, float] | None]] = [
    ("importance_sampling", None),
    ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
    ("dro", {"beta": 0.05}),
]


@pytest.mark.anyio
@pytest.mark.parametrize("service", ["mint", "tinker"])
async def test_a_hosted_profile_refuses_local_options_with_a_400_naming_them(service: str) -> None:
    async with serving(service) as (server, http):
        model_id = (await create_model(http, server))["model_id"]
        seq = 0
        for loss_fn, config, named in REFUSED[service]:
            seq += 1
            response = await http.post(
                "/api/v1/forward_backward", json=fb_body(model_id, seq, loss_fn, config)
            )
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert named in error and f"--service {service}" in error
        for loss_fn, config in ACCEPTED:  # later seq_ids are not held up by the refused ones
            seq += 1
            ref = await post(http, "forward_backward", fb_body(model_id, seq, loss_fn, config))
            assert "loss:sum" in (await result(http, ref["request_id"]))["metrics"]
        caps = (await http.get("/api/v1/get_server_capabilities")).json()
        recommended = caps["supported_models"][0]["engine_recommended"]
        assert recommended["service"] == service and recommended["loss_temperature"] == "off"


@pytest.mark.anyio
async def test_the_local_profile_keeps_every_option() -> None:
    async with serving("local") as (server, http):
        model_id = (await create_model(http, server))["model_id"]
        body = fb_body(model_id, 1, "importance_sampling", {"tis_cap": 2.0, "temperature": 0.7})
        assert (
            "loss:sum"
            in (await result(http, (await post(http, "forward_backward", body))["request_id"]))[
                "metrics"
            ]
        )
        caps = (await http.get("/api/v1/get_server_capabilities")).json()
        recommended = caps["supported_models"][0]["engine_recommended"]
        assert recommended["service"] == "local" and recommended["loss_temperature"] == "sampling"


@pytest.mark.anyio
async def test_mints_session_rollout_correction_applies_to_every_importance_sampling_call() -> None:
    """MinT's validate_mis_rollout_correction config on create_model; the later
    importance_sampling calls send no config and get the corrected loss: datum 1 (its
    sequence ratio within seq_sum_k1's [0.5, 2]) counts with weight min(exp(sum lr), 1.1),
    datum 2 (ratio e^1.2, rejected) counts 0."""
    async with serving("mint") as (server, http):
        plain = (await create_model(http, server))["model_id"]
        corrected = (await create_model(http, server, rollout_correction_config=MIS))["model_id"]
        probe = {
            "model_id": plain,
            "seq_id": 1,
            "forward_input": {
                "data": [rl_datum([0.0, -1.0, -1.0, -1.0], [0.0, 1.0, 1.0, 1.0])],
                "loss_fn": "importance_sampling",
            },
        }
        logp = (await result(http, (await post(http, "forward", probe))["request_id"]))[
            "loss_fn_outputs"
        ][0]["logprobs"]["data"]
        # same seed and rank: both models start from the same weights
        adv = [0.0, 1.0, -0.5, 2.0]
        q_kept = [0.0, *(p + 0.05 for p in logp[1:])]  # lr = -0.05 a token: ratio e^-0.15
        q_rejected = [0.0, *(p - 0.4 for p in logp[1:])]  # lr = 0.4: ratio e^1.2 > 2
        body = {
            "model_id": corrected,
            "seq_id": 1,
            "forward_backward_input": {
                "data": [rl_datum(q_kept, adv), rl_datum(q_rejected, adv)],
                "loss_fn": "importance_sampling",
            },
        }
        answer = await result(http, (await post(http, "forward_backward", body))["request_id"])
        outputs = [o["logprobs"]["data"] for o in answer["loss_fn_outputs"]]
        lr = sum(p - q for p, q in zip(outputs[0][1:], q_kept[1:], strict=True))
        weight = min(math.exp(lr), 1.1)
        expected = -sum(weight * a * p for a, p in zip(adv[1:], outputs[0][1:], strict=True))
        assert answer["metrics"]["loss:sum"] == pytest.approx(expected, rel=1e-4)
        # the plain model's importance_sampling is Tinker's -sum(r * A)
        body["model_id"], body["seq_id"] = plain, 2
        answer = await result(http, (await post(http, "forward_backward", body))["request_id"])
        ratios = [math.exp(p - q) for p, q in zip(outputs[0][1:], q_kept[1:], strict=True)]
        ratios2 = [math.exp(p - q) for p, q in zip(outputs[1][1:], q_rejected[1:], strict=True)]
        plain_loss = -sum(r * a for r, a in zip(ratios + ratios2, adv[1:] * 2, strict=True))
        assert answer["metrics"]["loss:sum"] == pytest.approx(plain_loss, rel=1e-4)

        bad = await create_model(http, server, rollout_correction_config={**MIS, "veto": 1})
        assert "'veto'" in bad["error"]
    async with serving("tinker") as (server, http):
        refused = await create_model(http, server, rollout_correction_config=MIS)
        assert "rollout_correction_config" in refused["error"]
        assert "--service tinker" in refused["error"]


async def sampling_session(http: httpx.AsyncClient, server: RunningServer) -> str:
    answer = await post(
        http,
        "create_sampling_session",
        {"session_id": "s", "sampling_session_seq_id": 0, "base_model": server.model_name},
    )
    sid: str = answer["sampling_session_id"]
    return sid


def sample_body(sid: str, seq_id: int) -> dict[str, Any]:
    return {
        "sampling_session_id": sid,
        "seq_id": seq_id,
        "num_samples": 1,
        "prompt": {"chunks": [{"tokens": [1, 60, 70, 80], "type": "encoded_text"}]},
        "sampling_params": {"max_tokens": 3, "temperature": 1.0, "seed": seq_id},
    }


@asynccontextmanager
async def sampler_held(server: RunningServer) -> AsyncIterator[None]:
    """The thread samples run on is busy until the block ends: an admitted request keeps
    its slot meanwhile."""
    started, release = threading.Event(), threading.Event()

    def occupy() -> None:
        started.set()
        release.wait(60)

    sampling = server.service.sampling.batcher.thread or server.service.compute
    async with anyio.create_task_group() as tg:
        tg.start_soon(sampling.run, occupy)
        await anyio.to_thread.run_sync(started.wait, 60)
        try:
            yield
        finally:
            release.set()


@pytest.mark.anyio
async def test_a_queued_backpressure_sample_gets_408_with_its_place_then_its_result() -> None:
    async with serving("mint", sampling_slots=1) as (server, http):
        sid = await sampling_session(http, server)
        async with sampler_held(server):
            running = await post(http, "asample", sample_body(sid, 1))  # holds the one slot
            queued = (
                await http.post("/api/v1/asample", json=sample_body(sid, 2), headers=BACKPRESSURE)
            ).json()
            quiet = await post(http, "asample", sample_body(sid, 3))  # no header
            poll = await http.post(
                "/api/v1/retrieve_future", json={"request_id": queued["request_id"]}
            )
            assert poll.status_code == 408, poll.text
            headers, body = poll.headers, poll.json()
            assert int(headers["Retry-After"]) >= 1
            assert headers["X-Queue-Depth"] == "2" and headers["X-Queue-Position"] == "1"
            assert float(headers["X-Queue-ETA-S"]) > 0 and headers["X-Queue-Status"] == "queued"
            assert body["request_id"] == queued["request_id"]
            assert body["queue_state"] == "paused_capacity"
            assert body["queue_position"] == 1 and body["queue_depth"] == 2
            assert body["estimated_wait_s"] > 0 and body["retry_after_s"] >= 1
            assert body["progress"] == 0.0
            # without the header a poll long-waits as before (try_again after long_poll_s)
            answer = await post(http, "retrieve_future", {"request_id": quiet["request_id"]})
            assert answer["type"] == "try_again"
            assert server.service.snapshot().sampling_queue["waiting"] == 2
        for ref in (running, queued, quiet):
            done = await result_through_408s(http, ref["request_id"])
            assert len(done["sequences"]) == 1
        stats = server.service.snapshot().sampling_queue
        assert stats["waited_total"] == 2 and stats["told_to_wait"] >= 1 and stats["waiting"] == 0


async def result_through_408s(http: httpx.AsyncClient, request_id: str) -> dict[str, Any]:
    while True:
        response = await http.post("/api/v1/retrieve_future", json={"request_id": request_id})
        if response.status_code == 408:
            continue
        assert response.status_code == 200, response.text
        if response.json().get("type") != "try_again":
            answer: dict[str, Any] = response.json()
            return answer


@pytest.mark.anyio
async def test_a_full_sampling_queue_and_a_rate_limit_answer_429_with_retry_after() -> None:
    async with serving("mint", sampling_slots=1, limits=Limits(max_queued_samples=1)) as (
        server,
        http,
    ):
        sid = await sampling_session(http, server)
        async with sampler_held(server):
            refs = [await post(http, "asample", sample_body(sid, n)) for n in (1, 2)]
            full = await http.post("/api/v1/asample", json=sample_body(sid, 3))
            assert full.status_code == 429 and int(full.headers["Retry-After"]) >= 1
            assert "sampling queue is full" in full.json()["error"]
        for ref in refs:
            assert "sequences" in await result(http, ref["request_id"])
    async with serving("local", rate_limit=0.01) as (server, http):
        first = await post(http, "create_session", {"tags": [], "user_metadata": {}})
        again = await http.post("/api/v1/create_session", json={"tags": [], "user_metadata": {}})
        assert again.status_code == 429, again.text
        assert int(again.headers["Retry-After"]) >= 60  # a token every 100 s
        assert "rate limit" in again.json()["error"]
        other_key = await http.post("/api/v1/create_session", json={}, headers={"X-API-Key": "k2"})
        assert other_key.status_code == 200  # per key
        assert "session_id" in first
        heartbeat = await http.post(
            "/api/v1/session_heartbeat", json={"session_id": first["session_id"]}
        )
        assert heartbeat.status_code == 200  # not counted


def test_sampling_gate_eta_progress_and_bound() -> None:
    now = [0.0]
    gate = SamplingGate(2, 3, max_retry_after_s=20.0, clock=lambda: now[0])
    started: list[str] = []

    def start(name: str) -> Callable[[], None]:
        return lambda: started.append(name)

    for name in "abcde":
        gate.admit(name, start(name), backpressure=True)
    assert started == ["a", "b"] and gate.depth == 3
    with pytest.raises(QueueFull):
        gate.admit("f", start("f"), backpressure=False)
    last = gate.status("e")
    assert last is not None and (last.position, last.depth, last.progress) == (3, 3, 0.0)
    assert last.eta_s == pytest.approx(2.0)  # two rounds of 1 s (no request finished yet)
    now[0] = 3.0
    gate.release("a")  # took 3 s: the mean moves 20% of the way
    assert started == ["a", "b", "c"]
    status = gate.status("e")
    assert status is not None and status.position == 2 and status.progress == pytest.approx(0.5)
    assert status.eta_s == pytest.approx(1.4) and status.retry_after_s == 2
    assert gate.status("c") is None and gate.started_at("c") == 3.0


# ---- the unmodified SDK ---------------------------------------------------------------


def test_the_unmodified_sdk_completes_every_sample_under_a_saturated_queue() -> None:
    """One slot and simulated sampling time: most requests wait, their polls get 408s
    (the SDK re-polls them), and every sample completes."""
    config = ServerConfig(
        service="mint", sampling_slots=1, latency="sample_request_s=0.4,sample_token_s=0"
    )
    with LocalServer(config=config) as server:
        service = mint.ServiceClient(base_url=server.base_url, api_key="tml-service-test")
        sampler = service.create_sampling_client(base_model=server.model_name)
        prompt = types.ModelInput.from_ints([1, 60, 70, 80])
        params = types.SamplingParams(max_tokens=2, seed=0)
        futures = [sampler.sample(prompt, 1, params) for _ in range(8)]
        results = [f.result() for f in futures]
        assert all(len(r.sequences) == 1 for r in results)
        queue = server.stats.sampling_queue
        assert queue["waited_total"] >= 1 and queue["told_to_wait"] >= 1
        assert queue["running"] == 0 and queue["waiting"] == 0


@pytest.mark.parametrize(
    "argv",
    [["--service", "hosted"], ["--sampling-slots", "-1"], ["--rate-limit", "0"]],
)
def test_bad_service_options_are_one_line_and_exit_2(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        local_main(argv)
    assert exit_info.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


# ---- upstream MinT clients ------------------------------------------------------------


def validation_datum() -> dict[str, Any]:
    """The datum MinT's advanced/validate_mis_rollout_correction.py trains on."""
    tokens = [10, 11, 12, 13, 14, 15]

    def tensor(values: Sequence[float], dtype: str = "float32") -> dict[str, Any]:
        return {"data": values, "shape": [len(values)], "dtype": dtype}

    return {
        "model_input": {"chunks": [{"type": "encoded_text", "tokens": tokens[:-1]}]},
        "loss_fn_inputs": {
            "target_tokens": tensor(tokens[1:], "int64"),
            "weights": tensor([0.0, 1.0, 1.0, 1.0, 1.0]),
            "logprobs": tensor([0.0] * 5),
            "advantages": tensor([0.0, 1.0, -1.5, 0.7, -0.2]),
        },
    }


@pytest.mark.anyio
async def test_mints_rollout_correction_validation_flow_passes_on_the_mint_profile() -> None:
    """Its wire calls: create_model with the session config and only a LoRA rank, then a
    forward_backward without a seq_id (MinT takes the model's next one); the local
    profile keeps requiring seq_ids."""
    for service in ("mint", "local"):
        async with serving(service) as (server, http):
            created = await create_model(
                http, server, lora_config={"rank": 8}, rollout_correction_config=MIS
            )
            body = {
                "model_id": created["model_id"],
                "forward_backward_input": {
                    "data": [validation_datum()],
                    "loss_fn": "importance_sampling",
                },
            }
            answer = await result(http, (await post(http, "forward_backward", body))["request_id"])
            if service == "mint":
                assert "error" not in answer and len(answer["loss_fn_outputs"]) == 1
            else:
                assert "seq_id (an integer >= 1) is required" in answer["error"]


def test_the_quickstart_loop_runs_unchanged_on_the_mint_profile() -> None:
    """The MinT quickstart's custom_reward loop, call for call (benchmarks/quickstart_loop),
    against the hosted profile with its latency and sampling slots."""
    config = ServerConfig(service="mint", latency="mint:scale=0.01")
    with LocalServer(config=config) as server:
        run = run_quickstart_loop(
            base_url=server.base_url,
            api_key=API_KEY,
            base_model=server.model_name,
            rank=8,
            steps=2,
            batch=3,
            group=4,
            lr=3e-3,
            max_tokens=6,
            **quickstart_task_knobs(server),
        )
        assert len(run.lines) == 2 and all(line.startswith("Step ") for line in run.lines)
        assert run.saved_path.startswith("tinker://")
        assert server.stats.sampling_queue["slots"] == 8
