"""Unit tests of the local server's building blocks (no model, no HTTP): fault and
latency grammars, the training clock, per-model ordering and dedupe, futures, auth,
checkpoint paths and the compute thread."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import anyio
import anyio.lowlevel
import jwt
import pytest

from engine.basemodels.catalogue import AGENT_MODEL_DIR, DEFAULT_MODEL_DIR
from engine.common.net import is_loopback_host
from engine.local import launch
from engine.local.__main__ import GIL_SWITCH_INTERVAL_S
from engine.local.__main__ import build_parser as build_local_parser
from engine.local.__main__ import main as cli_main
from engine.local.compute.backend_types import BackendError
from engine.local.compute.thread import ComputeThread
from engine.local.config import (
    Limits,
    ServerConfig,
    ServerConfigError,
    flag_values,
    server_flags,
)
from engine.local.faults import FaultInjector, FaultSpec, FaultSpecError
from engine.local.http.auth import VERIFIED_TOKENS_KEPT, Authenticator
from engine.local.http.middleware import endpoint_name
from engine.local.http.wire import SampleW, WireError, parse
from engine.local.latency import LatencyProfile, LatencyProfileError, TrainingClock
from engine.local.models.storage import BadPath, TinkerPath, check_name
from engine.local.models.tokenizer_cache import register_tokenizer
from engine.local.operations.core import ModelCard
from engine.local.operations.futures import FutureStore, TooManyPending
from engine.local.operations.sampling import sample_job_of
from engine.local.operations.sequencer import ModelSequencer, SeqRejected


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# ---- fault spec ----------------------------------------------------------------------


def test_fault_spec_parses_rules_options_and_round_trips() -> None:
    spec = FaultSpec.parse(
        "seed=7, 500:0.02, drop~after@forward_backward|optim_step:at=3+5, "
        "429@asample:1, slow_s=0.5, retry_after_s=0.25, 410@asample:0.1"
    )
    assert spec.seed == 7 and spec.slow_s == 0.5 and spec.retry_after_s == 0.25
    kinds = [(r.kind, r.phase) for r in spec.rules]
    assert kinds == [("500", "before"), ("drop", "after"), ("429", "before"), ("410", "before")]
    drop = spec.rules[1]
    assert drop.endpoints == {"forward_backward", "optim_step"} and drop.at == {3, 5}
    assert FaultSpec.parse(str(spec)) == spec
    assert not FaultSpec.parse("off").enabled and not FaultSpec.parse("").enabled


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("boom:0.1", "unknown fault kind 'boom'"),
        ("500:1.5", "rate must be in [0, 1]"),
        ("500", "needs a trigger"),
        ("500:at=0", "request numbers start at 1"),
        ("500:at=x", "at=3 or at=2+5"),
        ("fail~after:0.1", "fail has no 'after' variant"),
        ("drop~during:0.1", "phase must be 'before' or 'after'"),
        ("seed=x", "seed must be an integer"),
        ("bogus=1", "unknown fault option 'bogus'"),
        ("500:0.1,,503:0.1", "empty item"),
        ("500@:0.1", "endpoints are names"),
    ],
)
def test_fault_spec_errors_are_one_clear_line(text: str, message: str) -> None:
    with pytest.raises(FaultSpecError, match=None) as info:
        FaultSpec.parse(text)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_fault_injector_at_numbers_count_per_matching_request() -> None:
    injector = FaultInjector(FaultSpec.parse("503@optim_step:at=2,drop@forward_backward:at=1"))
    decisions = [
        (endpoint, rule.kind if (rule := injector.http_fault(endpoint)) else None)
        for endpoint in ["forward_backward", "optim_step", "forward_backward", "optim_step"]
    ]
    assert decisions == [
        ("forward_backward", "drop"),
        ("optim_step", None),
        ("forward_backward", None),
        ("optim_step", "503"),
    ]
    assert injector.injected["drop"] == 1 and injector.injected["503@optim_step"] == 1
    assert injector.http_fault("healthz") is None


def test_fault_injector_rates_are_deterministic_per_seed() -> None:
    def run(seed: int) -> list[bool]:
        injector = FaultInjector(FaultSpec.parse(f"seed={seed},500:0.3"))
        return [injector.http_fault("asample") is not None for _ in range(200)]

    first = run(1)
    assert first == run(1)
    assert first != run(2)
    assert 30 < sum(first) < 90  # about 30% of 200


def test_future_kinds_are_decided_separately_from_http_kinds() -> None:
    injector = FaultInjector(FaultSpec.parse("fail@forward_backward:at=1,410@asample:at=2"))
    assert injector.http_fault("forward_backward") is None
    assert injector.submit_fault("forward_backward") is True
    assert injector.submit_fault("forward_backward") is False
    assert [injector.poll_fault("asample") for _ in range(3)] == [False, True, False]


# ---- latency profile & clock ------------------------------------------------------------


def test_latency_profile_parsing() -> None:
    assert LatencyProfile.parse("off") is None and LatencyProfile.parse(None) is None
    mint = LatencyProfile.parse("mint")
    assert mint is not None and mint.cycle_s == 10 and mint.cycle == pytest.approx(0.5)
    fast = LatencyProfile.parse("mint:scale=0.01, cycle_s=20")
    assert fast is not None and fast.name == "mint" and fast.cycle == pytest.approx(0.2)
    custom = LatencyProfile.parse("cycle_s=2,gather_s=1")
    assert custom is not None and custom.cycle == 2 and custom.sample_time(10) == pytest.approx(1.2)
    for bad, message in [
        ("warp", "unknown latency profile 'warp'"),
        ("mint:", "nothing after ':'"),
        ("mint:speed=2", "KEY=SECONDS"),
        ("mint:scale=fast", "not a number"),
        ("mint:scale=-1", "must be a number >= 0"),
        ("mint:scale=0", "cycle_s * scale must be > 0"),
    ]:
        with pytest.raises(LatencyProfileError) as info:
            LatencyProfile.parse(bad)
        assert message in str(info.value)


@pytest.mark.anyio
async def test_training_clock_back_to_back_shares_a_cycle_awaited_costs_two_more() -> None:
    clock = TrainingClock(cycle=0.05, gather=0.05)
    async with anyio.create_task_group() as tg:
        tg.start_soon(clock.run)
        # Back to back: both submitted before the cycle starts -> same cycle.
        fwd, opt = clock.assign(), clock.assign()
        assert fwd == opt == 1
        await clock.wait_start(fwd)
        await clock.wait_end(opt)
        # Awaited: the next op is submitted only after the result was released, which
        # happens at the start of the following cycle -> it lands one cycle later still.
        nxt = clock.assign()
        assert nxt == fwd + 2
        await clock.wait_end(nxt)
        # One empty cycle does not pause the clock: the next op lands in the cycle after.
        later = clock.assign()
        await clock.wait_end(later)
        assert later == nxt + 2
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_training_clock_keeps_its_grid_through_one_empty_cycle() -> None:
    # A loop that trains every other cycle must meet the next grid tick, not pay the
    # restart lead (gather, here 40 cycles) as it would if one empty cycle paused the clock.
    clock = TrainingClock(cycle=0.05, gather=2.0)
    async with anyio.create_task_group() as tg:
        tg.start_soon(clock.run)
        first = clock.assign()
        await clock.wait_end(first)  # cycle first + 1 starts empty
        second = clock.assign()
        assert second == first + 2
        await clock.wait_end(second)
        ticks = dict(clock.ticks)
        assert ticks[second] - ticks[first] < 2.0  # a paused clock restarts >= gather later
        tg.cancel_scope.cancel()


# ---- sequencer ------------------------------------------------------------------------


@pytest.mark.anyio
async def test_sequencer_runs_in_seq_order_whatever_the_arrival_order() -> None:
    seq = ModelSequencer(gap_timeout=30, dedupe_window=16, max_seq_gap=4)
    applied: list[int] = []

    async def op(n: int) -> None:
        async with seq.turn(n):
            applied.append(n)

    async with anyio.create_task_group() as tg:
        for n in (3, 1, 4, 2):
            seq.claim(n, f"req{n}")
            tg.start_soon(op, n)
    assert applied == [1, 2, 3, 4]
    assert seq.next_seq == 5 and seq.queued == 0


def test_sequencer_dedupes_and_refuses_passed_seq_ids() -> None:
    seq = ModelSequencer(gap_timeout=30, dedupe_window=2, max_seq_gap=4)
    assert seq.lookup(1) is None
    seq.claim(1, "req-a", "digest-a")
    assert seq.lookup(1) == ("req-a", "digest-a")
    with pytest.raises(SeqRejected, match="already submitted"):
        seq.claim(1, "req-b")


# ---- futures --------------------------------------------------------------------------


@pytest.mark.anyio
async def test_future_store_long_poll_retention_and_limits() -> None:
    store = FutureStore(max_pending=2, max_retained=2)
    a = store.create("asample")
    assert await store.wait(a, 0.01) is None  # still pending: caller answers try_again
    b = store.create("asample")
    with pytest.raises(TooManyPending, match="limit 2"):
        store.create("asample")
    store.resolve(a, {"x": 1})
    assert await store.wait(a, 10) == {"x": 1}
    assert await store.wait(a, 10) == {"x": 1}  # kept for re-polls
    store.fail(b, "bad input")
    assert b.payload == {"error": "bad input", "category": "user"}
    c = store.create("forward")
    store.resolve(c, {"y": 2})
    assert store.get(a.request_id) is None  # oldest finished result was dropped
    assert store.get(c.request_id) is c
    with pytest.raises(ValueError, match="must not carry an 'error' key"):
        store.resolve(store.create("x"), {"error": "oops"})


def test_request_ids_are_unique_within_a_store_and_across_restarts() -> None:
    """A client may retry retrieve_future with an id from before a restart: the new
    server must not answer it with one of its own futures."""
    before, after = (FutureStore(max_pending=8, max_retained=8) for _ in range(2))
    ids = [store.create("asample").request_id for store in (before, after) for _ in range(3)]
    assert len(set(ids)) == len(ids)
    assert after.get(ids[0]) is None


@pytest.mark.anyio
async def test_future_store_close_releases_held_polls() -> None:
    store = FutureStore(max_pending=4, max_retained=4)
    entry = store.create("optim_step")
    async with anyio.create_task_group() as tg:
        results: list[object] = []

        async def poll() -> None:
            results.append(await store.wait(entry, 60))

        tg.start_soon(poll)
        await anyio.lowlevel.checkpoint()
        store.close()
    # A failure, not a try_again: the client would re-poll it at once until the port closes.
    stopped = {
        "error": "the local server stopped before this request finished",
        "category": "server",
    }
    assert results == [stopped]
    late = store.create("asample")  # a request that got in as the server was closing
    assert await store.wait(late, 60) == stopped


# ---- auth -----------------------------------------------------------------------------


def test_authenticator_accepts_raw_key_and_its_own_jwts_only() -> None:
    auth = Authenticator("sk-secret", jwt_ttl_s=3600)
    token = auth.issue()
    claims = jwt.decode(token, options={"verify_signature": False})
    assert isinstance(claims["exp"], int) and claims["exp"] > time.time()
    assert auth.check("sk-secret") is None
    assert auth.check(token) is None
    assert Authenticator("sk-secret", jwt_ttl_s=3600).check(token) is None  # same key
    assert "not issued by this server" in (
        Authenticator("sk-other", jwt_ttl_s=3600).check(token) or ""
    )
    assert auth.check(None) == "missing API key: send it in the X-API-Key header"
    assert auth.check("sk-wrong") == "invalid API key"
    expired = jwt.encode(
        {"iss": "engine.local", "exp": int(time.time()) - 10}, auth._secret, algorithm="HS256"
    )
    assert "expired" in (auth.check(expired) or "")
    open_auth = Authenticator(None, jwt_ttl_s=3600)
    assert not open_auth.required and open_auth.check(None) is None


def test_a_verified_jwt_is_remembered_until_it_expires_and_the_memory_is_bounded() -> None:
    now = [time.time()]
    auth = Authenticator("sk-secret", jwt_ttl_s=60, clock=lambda: now[0])
    token = auth.issue()
    assert auth.check(token) is None
    assert auth.check(token) is None  # remembered: no second decode needed
    now[0] += 61
    assert "expired" in (auth.check(token) or "")

    def behind(seconds: int) -> Callable[[], float]:
        return lambda: time.time() - seconds

    for i in range(VERIFIED_TOKENS_KEPT + 10):
        other = Authenticator("sk-secret", jwt_ttl_s=3600, clock=behind(i))
        assert auth.check(other.issue()) is None
    assert len(auth._verified) == VERIFIED_TOKENS_KEPT
    assert "not issued by this server" in (auth.check(token[:-2] + "xx") or "")


# ---- paths & config -------------------------------------------------------------------


def test_tinker_paths_map_into_the_data_dir_and_reject_escapes(tmp_path: Path) -> None:
    path = TinkerPath.parse("tinker://model-abc/weights/step-3")
    assert path.directory(tmp_path) == tmp_path / "model-abc" / "weights" / "step-3"
    assert str(path) == "tinker://model-abc/weights/step-3"
    for bad in [
        "tinker://model-abc/weights/../../etc",
        "tinker://model-abc/other/x",
        "tinker://../weights/x",
        "file:///etc/passwd",
        "tinker://m/weights/a/b",
        "tinker://m/weights/.hidden",
    ]:
        with pytest.raises(BadPath):
            TinkerPath.parse(bad)
    for bad_name in ["", "/abs", "a/b", "..", "a..b", "x" * 200, "sp ace"]:
        with pytest.raises(BadPath):
            check_name(bad_name)
    assert check_name("ckpt_1.v2-final") == "ckpt_1.v2-final"


def test_config_validation() -> None:
    assert is_loopback_host("127.0.0.1") and is_loopback_host("::1")
    assert is_loopback_host("localhost") and not is_loopback_host("0.0.0.0")
    with pytest.raises(ServerConfigError, match="without an API key"):
        ServerConfig(host="0.0.0.0")
    assert ServerConfig(host="0.0.0.0", api_key="tml-x").host == "0.0.0.0"
    with pytest.raises(ServerConfigError, match="port"):
        ServerConfig(port=70000)
    with pytest.raises(ServerConfigError, match="max_datums"):
        Limits(max_datums=0)
    with pytest.raises(ServerConfigError, match="long_poll_s must be a number of seconds > 0"):
        ServerConfig(long_poll_s=0)
    with pytest.raises(ServerConfigError, match="long_pol is not a setting of the local server"):
        ServerConfig(**{"long_pol": 1})
    with pytest.raises(ServerConfigError, match="service must be one of local, mint, tinker"):
        ServerConfig(service="hosted")
    with pytest.raises(FaultSpecError, match="rate must be in"):
        ServerConfig(faults="500:7")


def test_every_flag_is_one_declared_setting_and_sets_it() -> None:
    """A setting declared on ServerConfig or Limits (with a description) is a flag of
    python -m engine.local, and the flag sets that field: nothing else to edit."""
    parser = build_local_parser()
    declared = {field.flag for _, field in server_flags()}
    flags = {max(a.option_strings, key=len) for a in parser._actions if a.option_strings}
    assert flags - declared == {"--help", "--version", "--ephemeral", "--log-level"}
    assert declared <= flags
    argv = ["--max-samplers", "3", "--max-adapter-memory", "2", "--long-poll", "1.5"]
    argv += ["--model-alias", "a", "--model-alias", "b", "--sampling-slots", "0"]
    argv += ["--model", "tiny-agent-2", "--sampling-queue", "7"]
    config = ServerConfig(**flag_values(parser.parse_args(argv), {}))
    assert config.limits.max_named_samplers == config.limits.max_ephemeral_samplers == 3
    assert config.limits.max_adapter_bytes == 2 << 20 and config.limits.max_queued_samples == 7
    assert config.long_poll_s == 1.5 and config.model_aliases == ("a", "b")
    assert config.sampling_slots == 0 and config.slots is None
    assert config.model_dir == AGENT_MODEL_DIR
    assert config.limits.max_datums == Limits().max_datums  # not given: the default
    environ = {"ENGINE_LOCAL_API_KEY": "tml-env"}
    assert flag_values(parser.parse_args([]), environ) == {"api_key": "tml-env"}
    with_flag = flag_values(parser.parse_args(["--api-key", "tml-flag"]), environ)
    assert with_flag == {"api_key": "tml-flag"}


def test_endpoint_names_drop_ids() -> None:
    assert endpoint_name("/api/v1/forward_backward") == "forward_backward"
    assert endpoint_name("/api/v1/samplers/sampler-123") == "samplers"
    assert endpoint_name("/api/v1/client/config") == "client/config"
    assert endpoint_name("/api/v1/training_runs/x/checkpoints") == "training_runs"


# ---- compute thread -------------------------------------------------------------------


@pytest.mark.anyio
async def test_compute_thread_runs_everything_on_one_thread_in_order() -> None:
    compute = ComputeThread()
    seen: list[tuple[int, int]] = []

    def job(n: int) -> int:
        seen.append((n, threading.get_ident()))
        return n * n

    async with anyio.create_task_group() as tg:
        for n in range(5):
            tg.start_soon(compute.run, lambda n=n: job(n))
    assert sorted(n for n, _ in seen) == list(range(5))
    assert {ident for _, ident in seen} == {compute.ident}
    assert compute.ident != threading.get_ident()
    assert await compute.run(lambda: job(7)) == 49

    def boom() -> None:
        raise KeyError("nope")

    with pytest.raises(KeyError, match="nope"):
        await compute.run(boom)
    await compute.aclose()


def test_the_tokenizer_is_filed_under_the_model_name_and_never_shadows_a_real_entry(
    tmp_path: Path,
) -> None:
    from transformers import AutoTokenizer

    cache = tmp_path / "hub"
    snapshot = register_tokenizer("engine-local/tiny-arith", DEFAULT_MODEL_DIR, cache)
    assert snapshot is not None and (snapshot / "tokenizer.json").is_file()
    loaded = AutoTokenizer.from_pretrained("engine-local/tiny-arith", cache_dir=cache)
    direct = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    assert loaded.encode("What is 1 + 2?") == direct.encode("What is 1 + 2?")
    assert register_tokenizer("engine-local/tiny-arith", DEFAULT_MODEL_DIR, cache) == snapshot
    real = cache / "models--Qwen--Qwen3-0.6B"
    real.mkdir(parents=True)
    assert register_tokenizer("Qwen/Qwen3-0.6B", DEFAULT_MODEL_DIR, cache) is None
    assert list(real.iterdir()) == []
    assert register_tokenizer("/some/dir", DEFAULT_MODEL_DIR, cache) is None
    assert register_tokenizer("../x", DEFAULT_MODEL_DIR, cache) is None


def test_a_real_download_over_a_filed_name_is_never_shadowed_afterwards(tmp_path: Path) -> None:
    """An alias names a hosted model: once the real one is downloaded into the cache
    over the entry a server filed (a snapshot of its own, refs/main to it), the next
    server leaves the entry alone."""
    cache = tmp_path / "hub"
    ours = register_tokenizer("Qwen/Qwen3-0.6B", DEFAULT_MODEL_DIR, cache)
    assert ours is not None
    repo = cache / "models--Qwen--Qwen3-0.6B"
    real = repo / "snapshots" / ("f" * 40)  # what huggingface_hub downloads
    real.mkdir()
    (real / "tokenizer.json").write_text("{}")
    (repo / "refs" / "main").write_text("f" * 40)
    assert register_tokenizer("Qwen/Qwen3-0.6B", DEFAULT_MODEL_DIR, cache) is None
    assert (repo / "refs" / "main").read_text() == "f" * 40
    assert register_tokenizer("engine-local/tiny-arith", DEFAULT_MODEL_DIR, cache) is not None


@pytest.mark.parametrize("model_dir", [DEFAULT_MODEL_DIR, AGENT_MODEL_DIR])
def test_an_engine_models_filed_tokenizer_loads_as_its_own_without_the_model_classes(
    model_dir: Path, tmp_path: Path
) -> None:
    """The filed config names only the tokenizer class: loading the tokenizer from the
    snapshot (what ``get_info`` gives clients) must not import the model's configuration
    class and everything behind it (~1 s of client start-up), and must give the same
    tokenizer as the model directory."""
    snapshot = register_tokenizer("engine-local/filed", model_dir, tmp_path / "hub")
    assert snapshot is not None
    assert json.loads((snapshot / "config.json").read_text()) == {
        "tokenizer_class": "TokenizersBackend"
    }
    probe = textwrap.dedent(
        f"""
        import json, sys
        from transformers import AutoTokenizer
        chat = [{{"role": "user", "content": "What is 1 + 2?"}}]
        def describe(where):
            tok = AutoTokenizer.from_pretrained(where)
            ids = tok.encode("Question: What is 12 + 30?\\nAnswer: 42</s>")
            return [type(tok).__name__, ids, tok.decode(ids), tok.vocab_size,
                    tok.bos_token_id, tok.eos_token_id, tok.pad_token_id,
                    tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)]
        filed = describe({str(snapshot)!r})
        light = "transformers.models.llama.configuration_llama" not in sys.modules
        print(json.dumps([light, filed, describe({str(model_dir)!r})]))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=300
    )
    light, filed, direct = json.loads(out.stdout.strip().splitlines()[-1])
    assert light, "loading the filed tokenizer imported the model's configuration class"
    assert filed == direct


def test_a_model_not_made_by_the_engine_files_its_own_config(tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        (model_dir / name).write_bytes((DEFAULT_MODEL_DIR / name).read_bytes())
    snapshot = register_tokenizer("someone/model", model_dir, tmp_path / "hub")
    assert snapshot is not None
    assert (snapshot / "config.json").read_bytes() == (model_dir / "config.json").read_bytes()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"prompt": []}, "prompt must contain at least one token"),
        ({"prompt": [1, 100000]}, "outside the model's vocabulary"),
        ({"num_samples": 0}, "num_samples must be in 1..128"),
        ({"sampling_params": {"max_tokens": 0}}, "max_tokens must be set to an integer >= 1"),
        ({"sampling_params": {"max_tokens": 10_000}}, "exceeds the model's max_context_length"),
        ({"sampling_params": {"max_tokens": 4, "temperature": -0.1}}, "temperature must be >= 0"),
        ({"sampling_params": {"max_tokens": 4, "top_p": 0.0}}, "top_p must be in (0, 1]"),
        ({"sampling_params": {"max_tokens": 4, "top_k": -2}}, "top_k must be -1"),
        ({"sampling_params": {"max_tokens": 4, "stop": [""]}}, "stop strings must be non-empty"),
        ({"sampling_params": {"max_tokens": 4, "seed": 2**64}}, "seed must be in 0..2^63-1"),
        ({"sampling_params": {"max_tokens": 4, "seed": -1}}, "seed must be in 0..2^63-1"),
        ({"topk_prompt_logprobs": 21}, "topk_prompt_logprobs must be in 0..20"),
    ],
)
def test_sample_requests_are_checked_in_one_place(change: dict[str, object], message: str) -> None:
    card = ModelCard("tiny", DEFAULT_MODEL_DIR, 256, None, 1000, {}, DEFAULT_MODEL_DIR)
    body: dict[str, object] = {
        "prompt": {"chunks": [{"tokens": [1, 2, 3], "type": "encoded_text"}]},
        "sampling_params": {"max_tokens": 4},
        "num_samples": 1,
    }
    good = sample_job_of(parse(SampleW, body, "asample"), None, card, Limits())
    assert good.prompt == [1, 2, 3] and good.max_tokens == 4
    if "prompt" in change:
        change = {"prompt": {"chunks": [{"tokens": change["prompt"], "type": "encoded_text"}]}}
    with pytest.raises(WireError, match=re.escape(message)):
        sample_job_of(parse(SampleW, body | change, "asample"), None, card, Limits())


@pytest.mark.anyio
async def test_the_server_turns_nagles_algorithm_off_on_the_connections_it_accepts() -> None:
    """uvicorn serves on the socket ``_bind`` makes, through ``loop.create_server(sock=)``.
    With Nagle on, a response written in two parts on a kept-alive connection waited
    for the client's delayed ACK: every request after the first took ~40 ms."""
    import asyncio
    import socket

    from engine.local.launch import _bind

    listener = _bind("127.0.0.1", 0)
    nodelay: list[int] = []
    accepted = anyio.Event()

    class Record(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            sock = transport.get_extra_info("socket")
            nodelay.append(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            accepted.set()

    server = await asyncio.get_running_loop().create_server(Record, sock=listener)
    async with server:
        stream = await anyio.connect_tcp(*listener.getsockname()[:2])
        async with stream:
            await accepted.wait()
    assert nodelay and nodelay[0] != 0


@pytest.mark.anyio
async def test_a_response_written_in_parts_leaves_in_one_write_after_the_loop_turn() -> None:
    """uvicorn writes a response's head and body separately: one send each, and every
    send gives the GIL away; the server's transport passes a turn's writes on as one."""
    import asyncio

    from engine.common.http11 import GatheredWrites

    class Recording:
        def __init__(self) -> None:
            self.writes: list[bytes] = []
            self.closed = False

        def write(self, data: bytes) -> None:
            assert not self.closed
            self.writes.append(data)

        def is_closing(self) -> bool:
            return self.closed

        def close(self) -> None:
            self.closed = True

        def get_write_buffer_size(self) -> int:
            return 0

        def get_extra_info(self, name: str) -> str:
            return f"info {name}"

    real = Recording()
    gathered = GatheredWrites(real, asyncio.get_running_loop())  # type: ignore[arg-type]
    gathered.write(b"HTTP/1.1 200 OK\r\n\r\n")
    gathered.write(b"")
    gathered.write(b"{}")
    assert real.writes == [] and gathered.get_write_buffer_size() == 21
    await asyncio.sleep(0)
    assert real.writes == [b"HTTP/1.1 200 OK\r\n\r\n{}"]
    gathered.write(b"last")
    gathered.close()  # what was written before close still goes out, first
    assert real.writes[-1] == b"last" and real.closed
    assert gathered.get_extra_info("socket") == "info socket"
    await asyncio.sleep(0)
    assert len(real.writes) == 2


def test_the_server_cli_makes_waiting_threads_take_the_gil_within_a_millisecond(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """With the default 5 ms switch interval the server's event loop read a step's sample
    requests up to ~45 ms late, behind its compute threads (performance.md, item 15).
    ``serve_local`` itself never sets it: it also serves inside a user's process."""
    switched: list[float] = []
    served_with: list[list[float]] = []
    monkeypatch.setattr(sys, "setswitchinterval", switched.append)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    @contextlib.asynccontextmanager
    async def no_model(**_: object) -> AsyncIterator[None]:
        served_with.append(list(switched))
        raise BackendError("no model in this test")
        yield

    monkeypatch.setattr(launch, "serve_local", no_model)
    assert cli_main(["--ephemeral"]) == 1
    assert served_with == [[GIL_SWITCH_INTERVAL_S]] and GIL_SWITCH_INTERVAL_S <= 0.001
    assert "cannot load the model: no model in this test" in capsys.readouterr().err
