"""The REST management API through the unmodified SDK (``RestClient``, sync and async):
training runs and checkpoints with cursors, TTLs on an injected clock, publish,
delete (refused while in use), archive download, upload-and-resume, sessions, the
sampler's base model name, and bounded resources (heartbeat expiry, memory budget)."""

from __future__ import annotations

import io
import tarfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import anyio
import httpx
import mint
import pytest
from mint import types

from engine.local import Limits, LocalServer

KEY = "tml-local-rest-test"
QUESTION = "Question: What is 12 + 30?\nAnswer:"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(scope="module")
def server(clock: FakeClock) -> Iterator[LocalServer]:
    with LocalServer(api_key=KEY, now=clock) as running:
        yield running


@pytest.fixture(scope="module")
def service(server: LocalServer) -> mint.ServiceClient:
    return mint.ServiceClient(base_url=server.base_url, api_key=KEY)


def datum(tokenizer) -> types.Datum:
    full = tokenizer.encode(QUESTION + " 42")
    return types.Datum(
        model_input=types.ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={"target_tokens": full[1:], "weights": [1.0] * (len(full) - 1)},
    )


def train_one_step(tc) -> None:
    tc.forward_backward([datum(tc.get_tokenizer())], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()


def test_runs_checkpoints_publish_ttl_and_delete(
    server: LocalServer, service: mint.ServiceClient, clock: FakeClock
) -> None:
    rest = service.create_rest_client()
    tc = service.create_lora_training_client(
        base_model=server.model_name, rank=4, user_metadata={"purpose": "rest"}
    )
    train_one_step(tc)
    state = tc.save_state("s1").result().path
    clock.now += 1
    sampler_path = tc.save_weights_for_sampler("w1").result().path
    clock.now += 10
    later = tc.save_state("s2", ttl_seconds=60).result().path

    run = rest.get_training_run(tc.model_id).result()
    assert run.training_run_id == tc.model_id and run.base_model == server.model_name
    assert run.lora_rank == 4 and run.is_lora and run.user_metadata == {"purpose": "rest"}
    assert run.last_checkpoint is not None and run.last_checkpoint.tinker_path == later
    assert run.last_sampler_checkpoint is not None
    assert rest.get_training_run_by_tinker_path(state).result().training_run_id == tc.model_id

    listed = rest.list_checkpoints(tc.model_id).result().checkpoints
    assert [c.tinker_path for c in listed] == [state, sampler_path, later]
    assert {c.checkpoint_type for c in listed} == {"training", "sampler"}
    assert all(c.size_bytes and c.size_bytes > 0 for c in listed)
    assert listed[2].expires_at is not None and listed[0].expires_at is None

    # publish / unpublish, with the service's 409 for a no-op (checked over plain HTTP:
    # the SDK retries a 409 for 5 minutes before it raises ConflictError)
    checkpoint_url = f"/training_runs/{tc.model_id}/checkpoints/weights/s1"
    rest.publish_checkpoint_from_tinker_path(state).result()
    assert rest.list_checkpoints(tc.model_id).result().checkpoints[0].public
    assert _http(server, "POST", checkpoint_url + "/publish") == (409, "already public")
    rest.unpublish_checkpoint_from_tinker_path(state).result()
    assert _http(server, "DELETE", checkpoint_url + "/publish") == (409, "already private")

    # TTLs really expire: s2 (60 s) goes when the clock passes it; s1 gets one too
    rest.set_checkpoint_ttl_from_tinker_path(state, 3600).result()
    clock.now += 61
    paths = [c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints]
    assert paths == [state, sampler_path]
    with pytest.raises(mint.RequestFailedError, match="not found"):
        tc.load_state(later).result()
    rest.set_checkpoint_ttl_from_tinker_path(state, None).result()  # TTL removed
    clock.now += 7200
    assert rest.list_checkpoints(tc.model_id).result().checkpoints[0].tinker_path == state
    with pytest.raises(mint.BadRequestError, match="ttl_seconds"):
        rest.set_checkpoint_ttl_from_tinker_path(state, 0).result()

    # delete: refused while a sampling client samples from it, then done
    sampling = service.create_sampling_client(model_path=sampler_path)
    assert sampling.get_base_model() == server.model_name
    in_use = _http(server, "DELETE", f"/training_runs/{tc.model_id}/checkpoints/sampler_weights/w1")
    assert in_use == (409, "in use")
    rest.delete_checkpoint_from_tinker_path(state).result()
    with pytest.raises(mint.NotFoundError):
        rest.delete_checkpoint_from_tinker_path(state).result()
    with pytest.raises(mint.NotFoundError):
        rest.get_training_run("model-does-not-exist").result()
    with pytest.raises(mint.BadRequestError, match="may only use"):
        rest.delete_checkpoint(tc.model_id, "weights/-bad").result()


def test_cursors_user_checkpoints_and_sessions(
    server: LocalServer, service: mint.ServiceClient
) -> None:
    rest = service.create_rest_client()
    tc = service.create_lora_training_client(base_model=server.model_name, rank=2)
    for i in range(3):
        tc.save_state(f"c{i}").result()
    runs = rest.list_training_runs(limit=1).result()
    assert len(runs.training_runs) == 1 and runs.cursor.total_count >= 1
    assert runs.cursor.limit == 1 and runs.cursor.offset == 0
    everything = rest.list_training_runs(limit=100).result()
    assert tc.model_id in [r.training_run_id for r in everything.training_runs]
    page = rest.list_user_checkpoints(limit=2, offset=1).result()
    assert len(page.checkpoints) == 2 and page.cursor is not None
    assert page.cursor.offset == 1 and page.cursor.total_count >= 3
    newest = rest.list_user_checkpoints(limit=1).result().checkpoints[0]
    assert newest.tinker_path == f"tinker://{tc.model_id}/weights/c2"
    with pytest.raises(mint.BadRequestError, match="limit"):
        rest.list_user_checkpoints(limit=0).result()

    session_id = service.holder.get_session_id()
    assert session_id in rest.list_sessions(limit=100).result().sessions
    sampler = tc.save_weights_and_get_sampling_client()
    info = rest.get_session(session_id).result()
    assert tc.model_id in info.training_run_ids
    assert sampler._sampling_session_id in info.sampler_ids
    with pytest.raises(mint.NotFoundError):
        rest.get_session("session-unknown").result()


def test_archive_download_then_upload_and_resume(
    server: LocalServer, service: mint.ServiceClient, tmp_path: Path
) -> None:
    rest = service.create_rest_client()
    tc = service.create_lora_training_client(base_model=server.model_name, rank=4, seed=3)
    train_one_step(tc)
    state = tc.save_state("to-export").result().path
    url = rest.get_checkpoint_archive_url_from_tinker_path(state).result().url
    with urllib.request.urlopen(url) as answer:  # no API key: the URL is the credential
        archive = answer.read()
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        assert {"meta.json", "adapter.safetensors", "checkpoint_complete"} <= set(tar.getnames())

    uploaded = _upload(server, archive, "exported.tar.gz")
    assert uploaded["path"].startswith("tinker://upload-") and uploaded["path"].endswith(
        "/weights/exported"
    )
    resumed = service.create_training_client_from_state_with_optimizer(uploaded["path"])
    data = [datum(tc.get_tokenizer())]
    original = tc.forward(data, "cross_entropy").result().metrics["loss:sum"]
    restored = resumed.forward(data, "cross_entropy").result().metrics["loss:sum"]
    assert restored == pytest.approx(original, rel=1e-6)
    assert server.backend_call(lambda b: b.optimizer_steps(resumed.model_id)) == 1
    run = rest.get_training_run_by_tinker_path(uploaded["path"]).result()
    assert run.base_model == server.model_name

    bad = io.BytesIO()
    with tarfile.open(fileobj=bad, mode="w:gz") as tar:
        evil = tarfile.TarInfo("../escape.json")
        tar.addfile(evil, io.BytesIO(b""))
    with pytest.raises(RuntimeError, match=r"400.*may only hold"):
        _upload(server, bad.getvalue(), "evil.tar.gz")


def _http(server: LocalServer, method: str, path: str) -> tuple[int, str]:
    """(status, the first matching phrase of the error) of a plain HTTP call."""
    answer = httpx.request(method, f"{server.base_url}/api/v1{path}", headers={"X-API-Key": KEY})
    error = answer.json().get("error", "") if answer.content else ""
    phrase = next((p for p in ("already public", "already private", "in use") if p in error), "")
    return answer.status_code, phrase


def _upload(server: LocalServer, archive: bytes, filename: str) -> dict[str, str]:
    answer = httpx.post(
        f"{server.base_url}/api/v1/checkpoints/upload",
        headers={"X-API-Key": KEY},
        files={"file": (filename, archive, "application/gzip")},
    )
    if answer.status_code != 200:
        raise RuntimeError(f"{answer.status_code}: {answer.text}")
    return dict(answer.json())


def test_async_rest_calls(server: LocalServer) -> None:
    async def flow() -> None:
        service = mint.ServiceClient(base_url=server.base_url, api_key=KEY)
        rest = service.create_rest_client()
        tc = await service.create_lora_training_client_async(base_model=server.model_name, rank=2)
        saved = await (await tc.save_state_async("async-1"))
        run = await rest.get_training_run_async(tc.model_id)
        assert run.last_checkpoint is not None and run.last_checkpoint.tinker_path == saved.path
        assert (await rest.get_training_run_by_tinker_path_async(saved.path)).lora_rank == 2
        listed = await rest.list_checkpoints_async(tc.model_id)
        assert [c.tinker_path for c in listed.checkpoints] == [saved.path]
        assert (await rest.list_training_runs_async(limit=1)).cursor.limit == 1
        assert (await rest.list_user_checkpoints_async(limit=1)).checkpoints
        await rest.publish_checkpoint_from_tinker_path_async(saved.path)
        await rest.unpublish_checkpoint_from_tinker_path_async(saved.path)
        await rest.set_checkpoint_ttl_from_tinker_path_async(saved.path, 100)
        url = await rest.get_checkpoint_archive_url_from_tinker_path_async(saved.path)
        assert "/archives/" in url.url
        session_id = service.holder.get_session_id()
        assert session_id in (await rest.list_sessions_async(limit=1000)).sessions
        assert tc.model_id in (await rest.get_session_async(session_id)).training_run_ids
        await rest.delete_checkpoint_from_tinker_path_async(saved.path)
        assert not (await rest.list_checkpoints_async(tc.model_id)).checkpoints

    anyio.run(flow)


def test_sampler_reports_the_name_the_client_used(
    server: LocalServer, service: mint.ServiceClient
) -> None:
    tc = service.create_lora_training_client(base_model=server.model_name, rank=2)
    sampler = tc.save_weights_and_get_sampling_client()
    assert sampler.get_base_model() == server.model_name
    assert sampler.get_tokenizer().encode(QUESTION) == tc.get_tokenizer().encode(QUESTION)
    by_dir = service.create_sampling_client(base_model=str(server.running.model_dir))
    assert by_dir.get_base_model() == str(server.running.model_dir)


def test_silent_sessions_release_their_models(server: LocalServer, clock: FakeClock) -> None:
    service = mint.ServiceClient(base_url=server.base_url, api_key=KEY)
    tc = service.create_lora_training_client(base_model=server.model_name, rank=2)
    sampler = tc.save_weights_and_get_sampling_client()
    prompt = types.ModelInput.from_ints(tc.get_tokenizer().encode(QUESTION))
    data = [datum(tc.get_tokenizer())]
    session_id = service.holder.get_session_id()
    held = server.stats.held
    assert tc.model_id in held["models"]

    def silence_only_this_session() -> None:  # on the server's loop: no heartbeat between
        registry = server.running.service.core.registry
        clock.now += 601
        for other in list(registry.sessions):
            if other != session_id:
                registry.heartbeat(other)
        server.running.service.housekeeping()

    server.call(silence_only_this_session)
    assert tc.model_id not in server.stats.held["models"]
    with pytest.raises(mint.RequestFailedError, match="sent no heartbeat"):
        tc.forward(data, "cross_entropy").result()
    with pytest.raises(Exception, match="sent no heartbeat"):
        sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2)).result()


def test_the_memory_budget_evicts_snapshots_then_idle_models() -> None:
    with LocalServer(limits=Limits(max_adapter_bytes=1)) as tiny_budget:
        service = mint.ServiceClient(base_url=tiny_budget.base_url, api_key=KEY)
        first = service.create_lora_training_client(base_model=tiny_budget.model_name, rank=2)
        data = [datum(first.get_tokenizer())]
        second = service.create_lora_training_client(base_model=tiny_budget.model_name, rank=2)
        assert tiny_budget.stats.held["models"] == [second.model_id]  # the new one stays
        with pytest.raises(mint.RequestFailedError, match="within 1 bytes"):
            first.forward(data, "cross_entropy").result()
        assert second.forward(data, "cross_entropy").result().metrics["loss:sum"] > 0
