"""The local server's operations: its protocol logic, independent of HTTP, split by
concern.

``LocalService`` wires the parts together and runs the background work; the HTTP layer
(:mod:`engine.local.http.app`) calls the parts directly:

- ``core.py``: shared state (config, backend, compute thread, futures, registry, stats)
  and the helpers to answer with a future and run a job on the compute thread;
- ``registry.py``: sessions and the training clients / sampling sessions they hold;
- ``training.py``: create_model, get_info and the seq_id-ordered training operations;
- ``sampling.py``: sampling sessions and asample (where sample requests are checked);
- ``checkpoints.py``: training runs and checkpoints on disk (TTLs, publishing,
  deletion, archives, uploads);
- ``management.py``: the REST management API over them;
- ``resources.py``: heartbeat expiry and the model / snapshot budgets;
- ``futures.py`` (request ids, held long-polls), ``jobs.py`` (what a training operation
  runs on the compute thread), ``sequencer.py`` (seq_id order and exactly-once),
  ``batcher.py`` (merged sample requests) and ``sampling_gate.py`` (a hosted profile's
  sampling queue).
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import TaskStatus

from engine.local.compute.backend import Backend
from engine.local.compute.backend_types import BackendError
from engine.local.compute.thread import ComputeThread
from engine.local.config import ServerConfig
from engine.local.faults import FaultInjector
from engine.local.http.tinker_proto import zstd_available
from engine.local.http.wire import RetrieveFutureW, WeightsInfoW
from engine.local.operations.checkpoints import CheckpointStore
from engine.local.operations.core import Core, HttpError, ModelCard, sync_parse
from engine.local.operations.futures import FutureStore
from engine.local.operations.management import ManagementApi
from engine.local.operations.resources import Resources
from engine.local.operations.resume import ResumeOps
from engine.local.operations.sampling import SamplingOps
from engine.local.operations.sampling_gate import POLL_HOLD_S
from engine.local.operations.session_ops import SessionOps
from engine.local.operations.training import TrainingOps
from engine.local.stats import Stats, StatsSnapshot

__all__ = ["HttpError", "LocalService"]


class LocalService:
    """State and request handling of one local server (event-loop only)."""

    def __init__(
        self,
        config: ServerConfig,
        backend: Backend,
        compute: ComputeThread,
        data_dir: Path,
        *,
        now: Callable[[], float] = time.time,
        tokenizer_dir: Path | None = None,
    ) -> None:
        """``tokenizer_dir``: where clients load the tokenizer from (the model directory
        when None; see ``engine.local.models.tokenizer_cache``)."""
        self.core = Core(config, backend, compute, data_dir, now, tokenizer_dir)
        self.checkpoints = CheckpointStore(self.core)
        self.resources = Resources(self.core)
        self.sampling = SamplingOps(self.core, self.checkpoints, self.resources)
        self.training = TrainingOps(
            self.core, self.checkpoints, self.resources, self.sampling.on_sampler_saved
        )
        self.management = ManagementApi(self.core, self.checkpoints)
        self.resume = ResumeOps(self.core, self.checkpoints, self.resources)
        self.session_ops = SessionOps(self.core, self.resources)

    @property
    def config(self) -> ServerConfig:
        return self.core.config

    @property
    def data_dir(self) -> Path:
        return self.core.data_dir

    @property
    def backend(self) -> Backend:
        return self.core.backend

    @property
    def compute(self) -> ComputeThread:
        return self.core.compute

    @property
    def futures(self) -> FutureStore:
        return self.core.futures

    @property
    def faults(self) -> FaultInjector:
        return self.core.faults

    @property
    def stats(self) -> Stats:
        return self.core.stats

    @property
    def card(self) -> ModelCard:
        return self.core.card

    # ---- lifecycle ------------------------------------------------------------------

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Run the sampler loop, the latency clock, housekeeping and every queued
        operation until cancelled. Operations are tasks of this task group, so none
        outlives the server."""
        async with anyio.create_task_group() as tg:
            self.core.tg = tg
            try:
                tg.start_soon(self.sampling.batcher.run)
                if self.core.clock is not None:
                    tg.start_soon(self.core.clock.run)
                tg.start_soon(self._housekeeping)
                task_status.started()
                await anyio.sleep_forever()
            finally:
                self.core.tg = None  # a request from now on is refused (503), not lost

    async def _housekeeping(self) -> None:
        while True:
            await anyio.sleep(self.config.housekeeping_interval_s)
            self.housekeeping()

    def housekeeping(self) -> None:
        """Release silent sessions and delete expired checkpoints and archive URLs."""
        self.resources.expire_silent_sessions()
        self.checkpoints.sweep()

    def close(self) -> None:
        """Release held long-polls so the HTTP server can stop at once."""
        self.core.futures.close()

    # ---- sessions -------------------------------------------------------------------

    def create_session(self, body: Any) -> dict[str, Any]:
        session_id = f"session-{uuid.uuid4().hex}"
        self.core.registry.open_session(session_id)
        return {"type": "create_session", "session_id": session_id}

    def heartbeat(self, body: Any) -> dict[str, Any]:
        session_id = body.get("session_id") if isinstance(body, dict) else None
        if isinstance(session_id, str):
            self.core.registry.heartbeat(session_id)
        return {"type": "session_heartbeat"}

    def client_config(self, body: Any) -> dict[str, Any]:
        limits = self.config.limits
        sdk_version = body.get("sdk_version") if isinstance(body, dict) else None
        return {
            "pjwt_auth_enabled": True,
            "credential_default_source": "api_key",
            "parallel_fwdbwd_chunks": False,
            "use_pyqwest_transport": keeps_redirects_off_pyqwest(sdk_version),
            # tinker 0.22 then sends forward_backward as protobuf too (uncompressed): for
            # 256 datums its JSON costs the client and this server ~15-20 ms more.
            "proto_write_fwdbwd": True,
            "sample_no_retries": False,
            # tinker >= 0.38: forward_backward arrives as zstd-compressed protobuf, in
            # chunks the server's limits accept (the byte estimate is pre-compression).
            "proto_compress_fwdbwd": zstd_available(),
            "fwdbwd_max_chunk_len": limits.max_datums,
            "fwdbwd_max_chunk_bytes_count": min(5_000_000, limits.max_body_bytes),
            "sample_use_retrieve_futures": False,
            "sample_join_sampling_session": True,
            "custom_loss_server_side": False,
        }

    def capabilities(self) -> dict[str, Any]:
        return {"supported_models": [self.core.card.entry]}

    async def weights_info(self, body: Any) -> dict[str, Any]:
        req = sync_parse(WeightsInfoW, body, "weights_info")
        path, _ = self.checkpoints.find(req.tinker_path)
        directory = path.directory(self.core.data_dir)
        try:
            info = await self.core.compute.run(lambda: Backend.read_state_info(directory))
        except BackendError as exc:
            raise HttpError(400, str(exc)) from None
        answer = {"base_model": self.core.card.name, "is_lora": True}
        answer.update({k: v for k, v in info.items() if _is_json_scalar(v)})
        return answer

    def failed_future(self, endpoint: str, message: str) -> dict[str, Any]:
        return self.core.failed_future(endpoint, message)

    async def retrieve_future(self, body: Any) -> dict[str, Any]:
        core = self.core
        req = sync_parse(RetrieveFutureW, body, "retrieve_future")
        entry = core.futures.get(req.request_id)
        if entry is None:
            raise HttpError(
                410,
                f"request {req.request_id!r} is unknown or its result has expired (results "
                "are kept in memory only; a restarted server has none)",
                category="server",
            )
        if core.faults.poll_fault(entry.endpoint):
            # A future expires after its result existed: the operation is applied, and
            # only then is the answer lost (never 410 while it may still not run).
            entry.expires = True
        hold = self.config.long_poll_s
        gate = self.sampling.gate
        if gate.backpressured(entry.request_id):
            # Held a moment (an SDK re-polls a 408 at once), then a 408 with the
            # request's place in the queue unless it started meanwhile.
            began = anyio.current_time()
            await gate.wait_left(entry.request_id, min(hold, POLL_HOLD_S))
            status = gate.status(entry.request_id)
            if status is not None:
                gate.told_to_wait += 1
                raise HttpError(
                    408,
                    f"request {entry.request_id} waits for a sampling slot",
                    category="server",
                    headers=status.headers(),
                    body=status.body(entry.request_id),
                )
            hold = max(0.0, hold - (anyio.current_time() - began))
        payload = await core.futures.wait(entry, hold)
        if payload is None:
            return {"type": "try_again", "request_id": entry.request_id, "queue_state": "active"}
        if entry.expires:
            raise HttpError(
                410, "injected fault: this future expired (fault injection)", category="server"
            )
        return payload

    def snapshot(self) -> StatsSnapshot:
        core = self.core
        s = core.stats
        batcher = self.sampling.batcher
        sampler = batcher.thread
        return StatsSnapshot(
            requests=dict(s.requests),
            applied=dict(s.applied),
            optimizer_steps=dict(s.optimizer_steps),
            dedupe_hits=dict(s.dedupe_hits),
            faults_injected=dict(core.faults.injected),
            sample_batches=batcher.batches,
            sample_requests=batcher.requests,
            largest_sample_batch=batcher.largest_batch,
            cycles_started=core.clock.started if core.clock else 0,
            op_cycles={m: list(ops) for m, ops in s.op_cycles.items()},
            seq_gap_timeouts=sum(m.seq.gap_timeouts for m in core.registry.models.values()),
            futures_pending=core.futures.pending,
            futures_retained=core.futures.retained,
            polls_held=core.futures.held,
            compute_busy_s=core.compute.busy_s + (sampler.busy_s if sampler else 0.0),
            compute_jobs=sorted(
                [*core.compute.jobs, *(sampler.jobs if sampler else ())], key=lambda job: job[1]
            ),
            cycle_starts=list(core.clock.ticks) if core.clock else [],
            models=len(core.registry.models),
            sampling_sessions=len(core.registry.samplers),
            held=self.resources.held(),
            sampling_queue=self.sampling.gate.stats(),
        )


def _is_json_scalar(value: Any) -> bool:
    return value is None or isinstance(value, str | int | float | bool)


PYQWEST_FROM = (0, 38)
"""The first tinker SDK release the server lets use its pyqwest transport."""


def keeps_redirects_off_pyqwest(sdk_version: object) -> bool:
    """Whether an SDK of this version may use pyqwest, its default transport (far less
    CPU per request than httpx's pool). pyqwest follows redirects by itself, and the
    checkpoint-archive request must see its 302: tinker 0.38 sends such requests through
    httpx, tinker 0.22 (the ``mint`` SDK) through pyqwest too, where
    ``get_checkpoint_archive_url`` then fails. Unknown versions get httpx."""
    found = re.match(r"(\d+)\.(\d+)", sdk_version) if isinstance(sdk_version, str) else None
    return found is not None and (int(found[1]), int(found[2])) >= PYQWEST_FROM
