"""Batched sampling: asample requests that pile up while the compute thread is busy run
together in one ``backend.sample`` call.

RL loops fire many small sample requests at once (one per problem); running them one by
one would serialise the whole rollout phase behind per-call overhead. The batcher waits
for the thread it samples on, then takes everything queued by that moment (up to a cap).

When the backend can sample apart from training (``Backend.samples_apart``), the batches
run on a sampler thread of their own, started and stopped with the batcher, so sampling
never waits behind a forward_backward, as on the hosted service (separate samplers).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from engine.local.compute.backend_types import SampledSequences, SampleJob
from engine.local.compute.thread import ComputeThread

SampleOutcome = SampledSequences | Exception


class SamplerQueueFull(Exception):
    """Too many asample requests are waiting; the client should back off (429)."""


@dataclass
class PendingSample:
    job: SampleJob
    deliver: Callable[[SampleOutcome], None]
    """Called on the event loop with the result, or the exception for this job."""


class SampleBatcher:
    """Owns the bounded queue of asample jobs and the loop that drains it."""

    def __init__(
        self,
        compute: ComputeThread,
        sample: Callable[[list[SampleJob]], Sequence[SampledSequences]],
        *,
        max_batch: int,
        max_queued: int,
        window_s: float = 0.0,
        apart: bool = False,
    ) -> None:
        """``apart``: run the batches on a thread of their own, not on ``compute``."""
        self._compute = compute
        self._apart = apart
        self.thread: ComputeThread | None = None
        """The sampler thread while ``run`` runs with ``apart`` (for stats)."""
        self._sample = sample
        self._max_batch = max_batch
        self._window_s = window_s
        self._send: MemoryObjectSendStream[PendingSample]
        self._receive: MemoryObjectReceiveStream[PendingSample]
        self._send, self._receive = anyio.create_memory_object_stream[PendingSample](max_queued)
        self.batches = 0
        self.requests = 0
        self.largest_batch = 0

    def submit(self, item: PendingSample) -> None:
        try:
            self._send.send_nowait(item)
        except anyio.WouldBlock:
            raise SamplerQueueFull(
                "the local sampler queue is full; back off and retry the sample"
            ) from None

    async def run(self) -> None:
        """Drain the queue until cancelled (server shutdown)."""
        if not self._apart:
            await self._drain(self._compute)
            return
        self.thread = ComputeThread("engine.local-sample")
        try:
            await self._drain(self.thread)
        finally:
            with anyio.CancelScope(shield=True):
                await self.thread.aclose()

    async def _drain(self, compute: ComputeThread) -> None:
        async with self._receive:
            async for first in self._receive:
                if self._window_s > 0:
                    await anyio.sleep(self._window_s)
                batch: list[PendingSample] = [first]

                def prepare(
                    batch: list[PendingSample] = batch,
                ) -> Callable[[], list[SampleOutcome]]:
                    while len(batch) < self._max_batch:
                        try:
                            batch.append(self._receive.receive_nowait())
                        except (anyio.WouldBlock, anyio.EndOfStream):
                            break
                    jobs = [p.job for p in batch]
                    return lambda: self._run_isolated(jobs)

                try:
                    outcomes = await compute.run_prepared(prepare, "asample")
                except Exception as exc:  # compute thread closed: fail the whole batch
                    outcomes = [exc] * len(batch)
                self.batches += 1
                self.requests += len(batch)
                self.largest_batch = max(self.largest_batch, len(batch))
                for pending, outcome in zip(batch, outcomes, strict=True):
                    pending.deliver(outcome)

    def _run_isolated(self, jobs: list[SampleJob]) -> list[SampleOutcome]:
        """Compute (or sampler) thread: run the batch; if it fails, run each job alone so
        one bad request cannot fail the requests batched with it."""
        try:
            results = list(self._sample(jobs))
            if len(results) != len(jobs):
                raise RuntimeError(
                    f"backend.sample returned {len(results)} results for {len(jobs)} jobs"
                )
            return list(results)
        except Exception as exc:
            if len(jobs) == 1:
                return [exc]
        outcomes: list[SampleOutcome] = []
        for job in jobs:
            try:
                (result,) = self._sample([job])
                outcomes.append(result)
            except Exception as exc:
                outcomes.append(exc)
        return outcomes


def generated_tokens(result: SampledSequences) -> int:
    """Length of the longest generated sequence (what per-token latency is charged on)."""
    return max((len(s.tokens) for s in result.sequences), default=0)
