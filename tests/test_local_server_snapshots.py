"""Sampler snapshot bounds (--max-samplers) never break a live client: beyond a bound the
server evicts a snapshot no live client may still sample from (a superseded one, least
recently used first), never a training client's newest or one with sample requests
queued, and refuses a new snapshot (429) when every one held is in use. Over real HTTP
against an in-process server with an injected clock."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Sequence
from typing import Any

import anyio
import httpx
import pytest

from engine.local import Limits, RunningServer, serve_local
from engine.local.compute.backend_types import SampledSequences, SampleJob
from engine.local.config import ServerConfig
from engine.local.operations.registry import ModelState, Registry
from tests.clock import SetTime
from tests.raw_client import RawClient

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Client(RawClient):
    """The raw calls these tests need: snapshots saved, sampling clients opened on them,
    sample requests."""

    def __init__(self, server: RunningServer, http: httpx.AsyncClient) -> None:
        super().__init__(server, http)
        self.sampling_seq = 0

    async def save_named(self, model_id: str, name: str) -> str:
        saved = await self.result("save_weights_for_sampler", self.op_body(model_id, path=name))
        path: str = saved["path"]
        return path

    async def save_in_memory(self, model_id: str) -> str:
        """save_weights_and_get_sampling_client: a new sampling session on the weights."""
        self.sampling_seq += 1
        body = self.op_body(model_id, sampling_session_seq_id=self.sampling_seq)
        saved = await self.result("save_weights_for_sampler", body)
        sampler_id: str = saved["sampling_session_id"]
        return sampler_id

    async def open_sampler(self, **source: str) -> httpx.Response:
        self.sampling_seq += 1
        return await self.http.post(
            "/api/v1/create_sampling_session",
            json={"session_id": "s", "sampling_session_seq_id": self.sampling_seq, **source},
        )

    async def sampler(self, **source: str) -> str:
        answer = await self.open_sampler(**source)
        assert answer.status_code == 200, answer.text
        sampler_id: str = answer.json()["sampling_session_id"]
        return sampler_id

    async def submit_sample(self, sampler_id: str) -> str:
        answer = await self.http.post(
            "/api/v1/asample",
            json={
                "sampling_session_id": sampler_id,
                "num_samples": 1,
                "prompt": {"chunks": [{"tokens": [1, 60, 70], "type": "encoded_text"}]},
                "sampling_params": {"max_tokens": 2, "temperature": 1.0, "seed": 1},
            },
        )
        assert answer.status_code == 200, answer.text
        request_id: str = answer.json()["request_id"]
        return request_id

    async def sample(self, sampler_id: str) -> dict[str, Any]:
        return await self.wait(await self.submit_sample(sampler_id))


@pytest.fixture
async def clock() -> SetTime:
    return SetTime()


@pytest.fixture
async def server(clock: SetTime) -> AsyncIterator[RunningServer]:
    limits = Limits(max_models=4, max_named_samplers=2, max_ephemeral_samplers=2)
    config = ServerConfig(long_poll_s=1, limits=limits)
    async with serve_local(config, now=clock) as running:
        yield running


@pytest.fixture
async def client(server: RunningServer) -> AsyncIterator[Client]:
    async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
        yield Client(server, http)


def _sampled(answer: dict[str, Any]) -> bool:
    return "error" not in answer and len(answer["sequences"]) == 1


async def test_another_runs_snapshots_never_evict_a_live_clients_newest(
    client: Client, clock: SetTime
) -> None:
    # Run A samples from its newest snapshot; run B then saves snapshot after snapshot.
    run_a = await client.model()
    sampler_a = await client.sampler(model_path=await client.save_named(run_a, "a1"))
    assert _sampled(await client.sample(sampler_a))
    clock.now += 10
    run_b = await client.model()
    sampler_b1 = await client.sampler(model_path=await client.save_named(run_b, "b1"))
    assert _sampled(await client.sample(sampler_b1))
    clock.now += 10
    await client.save_named(run_b, "b2")  # three held, bound 2: one goes
    # Not A's newest (least recently used, but A may sample from it at any time):
    # B's superseded b1.
    assert _sampled(await client.sample(sampler_a))
    gone = await client.sample(sampler_b1)
    assert "was released" in gone["error"] and "--max-samplers" in gone["error"]
    assert client.server.stats.held["checkpoint_snapshots"] == 2


async def test_a_snapshot_with_queued_sample_requests_is_not_evicted(
    client: Client, server: RunningServer, clock: SetTime, monkeypatch: pytest.MonkeyPatch
) -> None:
    # K=1: the sampler still has requests queued on version 1 when version 2 opens.
    run = await client.model()
    sampler_v1 = await client.sampler(model_path=await client.save_named(run, "v1"))
    path_v2 = await client.save_named(run, "v2")
    batcher = server.service.sampling.batcher
    run_batch = batcher._sample
    started, release = threading.Event(), threading.Event()

    def held_open(jobs: list[SampleJob]) -> Sequence[SampledSequences]:
        if not started.is_set():
            started.set()
            release.wait(30)
        return run_batch(jobs)

    monkeypatch.setattr(batcher, "_sample", held_open)
    base = await client.sampler(base_model=server.model_name)
    running = await client.submit_sample(base)  # the compute thread runs this batch
    await anyio.to_thread.run_sync(started.wait, 30)
    queued = await client.submit_sample(sampler_v1)  # waits for the next batch
    clock.now += 10
    await client.sampler(model_path=path_v2)  # v2 was sampled from more recently
    # Room for one more snapshot: neither v1 (requests queued) nor v2 (the newest) goes.
    made_room = server.service.resources.limit_snapshots(room=1)
    release.set()
    assert _sampled(await client.wait(running))
    answer = await client.wait(queued)
    assert _sampled(answer), answer  # not "unknown sampler"
    assert made_room is False
    assert server.stats.held["checkpoint_snapshots"] == 2


async def test_a_new_snapshot_is_refused_when_every_one_held_is_in_use(
    client: Client, server: RunningServer
) -> None:
    run_a, run_b = await client.model(), await client.model()
    await client.save_named(run_a, "a1")
    await client.save_named(run_b, "b1")
    state = await client.result("save_weights", client.op_body(run_a, path="state"))
    # Both held snapshots are a live client's newest: a third to load is refused ...
    refused = await client.open_sampler(model_path=state["path"])
    assert refused.status_code == 429, refused.text
    assert "--max-samplers" in refused.json()["error"]
    assert int(refused.headers["retry-after"]) >= 1
    # ... as is a third run's snapshot, before it is taken.
    run_c = await client.model()
    saved = await client.http.post(
        "/api/v1/save_weights_for_sampler", json=client.op_body(run_c, path="c1")
    )
    assert saved.status_code == 429, saved.text
    assert "live clients may still sample from" in saved.json()["error"]
    # A run's own next snapshot supersedes its newest, so it always has room.
    await client.save_named(run_a, "a2")
    assert server.stats.held["checkpoint_snapshots"] == 2
    assert server.stats.held["released"]["named_samplers"] == 1


async def test_in_memory_snapshots_spare_each_live_clients_newest(
    client: Client, server: RunningServer
) -> None:
    run_a, run_b = await client.model(), await client.model()
    sampler_a = await client.save_in_memory(run_a)
    sampler_b1 = await client.save_in_memory(run_b)
    sampler_b2 = await client.save_in_memory(run_b)  # three held, bound 2
    assert _sampled(await client.sample(sampler_a))
    assert _sampled(await client.sample(sampler_b2))
    gone = await client.sample(sampler_b1)
    assert "was released" in gone["error"] and "keeps at most 2" in gone["error"]
    run_c = await client.model()
    refused = await client.http.post(
        "/api/v1/save_weights_for_sampler",
        json=client.op_body(run_c, sampling_session_seq_id=99),
    )
    assert refused.status_code == 429, refused.text
    assert server.stats.sampling_sessions == 2


def test_eviction_order_prefers_released_runs_then_least_recently_used() -> None:
    clock = SetTime()
    registry = Registry(clock)
    for model_id in ("live", "gone"):
        registry.add_model(ModelState(model_id, None, None, None, "m", clock()))  # type: ignore[arg-type]
    for key, model_id in (("live-1", "live"), ("gone-1", "gone"), ("live-2", "live")):
        clock.now += 1
        registry.add_snapshot(key, model_id, saved=True)
    clock.now += 1
    registry.add_snapshot("loaded", "live", saved=False)
    registry.release_model("gone", "test")
    clock.now += 1
    registry.sampling_started("live-1")  # used last, but only once its request is done
    keys = ["live-1", "gone-1", "live-2", "loaded"]
    # live-2 is the live run's newest; live-1 has a request queued.
    assert registry.eviction_order(keys, frozenset()) == ["gone-1", "loaded"]
    assert registry.sampling_ended("live-1")
    assert registry.eviction_order(keys, frozenset({"loaded"})) == ["gone-1", "live-1"]
    assert registry.in_use("live-2") and not registry.in_use("live-2", superseded_by="live")
