"""The MinT session: the adapter for tinker 0.22 under the ``mint`` SDK (mindlab-toolkit).

What is SDK-neutral lives elsewhere: the session logic both adapters share in
:mod:`engine.session.adapter`, the plain-HTTP preflight and recommended profile in
:mod:`engine.session.preflight`, launching the local server and picking the adapter in
:mod:`engine.session.opening`. This module makes the 0.22 calls.

Two tinker 0.22 facts shape it (docs/architecture.md, "Wire facts"):

* The ``_async`` training calls need two awaits: ``fut = await tc.forward_backward_async
  (...)`` submits (and fixes the request's place in the model's sequence), ``await fut``
  waits for the result.
* ``save_weights_for_sampler[_async]`` takes its place in the model's sequence late
  (:func:`reserve_sampler_snapshot`), and ``save_weights_and_get_sampling_client``
  blocks the calling thread.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import httpx
import mint
import pyqwest
import tinker
from pyqwest.httpx import AsyncPyqwestTransport
from tinker import types
from tinker._base_client import AsyncHttpxClientWrapper
from tinker._constants import DEFAULT_TIMEOUT
from tinker.lib.api_future_impl import _APIFuture
from tinker.lib.client_connection_pool_type import ClientConnectionPoolType
from tinker.lib.queue_state_logger import QueueStateLogger

from engine.common.net import is_loopback_host
from engine.config import HOSTED_BASE_URL
from engine.session.adapter import SNAPSHOT_TTL_S, SdkSession
from engine.session.api import LossSpec, SamplerHandle, SamplingParams
from engine.session.queue_watch import QueueObserver, follow_queue_states
from engine.session.retry import SDK_MAX_RETRIES
from engine.session.sdk_calls import (
    LoraSpec,
    sdk_sampling_retry_config,
    settled,
    snapshot_name,
    to_sdk_datum,
)

__all__ = [
    "MintSession",
    "reserve_sampler_snapshot",
    "sdk_sampling_retry_config",
    "snapshot_name",
    "to_sdk_datum",
]


class MintSession(SdkSession):
    """A connected training session over tinker 0.22 (``mint``)."""

    sdk = "mint"
    sdk_version = tinker.__version__
    default_base_url = HOSTED_BASE_URL

    @staticmethod
    def _sdk_service(
        base_url: str, api_key: str | None, queue: QueueObserver | None = None
    ) -> tinker.ServiceClient:
        return service_client(base_url, api_key, queue, max_retries=SDK_MAX_RETRIES)

    async def _sdk_supported_models(
        self, base_url: str, api_key: str | None
    ) -> dict[str, int | None]:
        caps = await self._service.get_server_capabilities_async()
        return {m.model_name: m.max_context_length for m in caps.supported_models if m.model_name}

    async def _sdk_sample(
        self,
        client: tinker.SamplingClient,
        prompt: types.ModelInput,
        num_samples: int,
        settings: SamplingParams,
    ) -> types.SampleResponse:
        return await client.sample_async(
            prompt=prompt, num_samples=num_samples, sampling_params=sampling_params(settings)
        )

    async def _sdk_prompt_logprobs(
        self, client: tinker.SamplingClient, prompt: types.ModelInput
    ) -> list[Any]:
        return list(await client.compute_logprobs_async(prompt))

    async def _sdk_forward_backward(
        self, training: tinker.TrainingClient, batch: list[types.Datum], loss: LossSpec
    ) -> Any:
        return await training.forward_backward_async(
            batch,
            loss.name,  # type: ignore[arg-type]  # validated against LOSSES by the config
            loss.config,
        )

    async def _sdk_forward_backward_custom(
        self, training: tinker.TrainingClient, batch: list[types.Datum], loss_fn: Any
    ) -> Any:
        # 0.22 awaits the forward pass's logprobs here (a server round) and then submits
        # the backward; its combined future has no concurrent future to await, so it is
        # awaited on the SDK's loop as one.
        combined = await training.forward_backward_custom_async(batch, loss_fn)
        return training.holder.run_coroutine_threadsafe(combined.result_async())

    async def _sdk_optim_step(
        self, training: tinker.TrainingClient, params: types.AdamParams
    ) -> Any:
        return await training.optim_step_async(params)

    async def _sdk_save_state(self, training: tinker.TrainingClient, name: str) -> Any:
        return await training.save_state_async(name, overwrite=True)

    async def _sdk_save_sampler(self, training: tinker.TrainingClient, name: str) -> Any:
        return await training.save_weights_for_sampler_async(name)

    def _sdk_reserve_snapshot(self, training: tinker.TrainingClient, version: int) -> Any:
        return reserve_sampler_snapshot(training, snapshot_name(version))

    def _sdk_reserve_sampler_save(self, training: tinker.TrainingClient, name: str) -> Any:
        return reserve_sampler_snapshot(training, name, ttl_seconds=None)

    async def _sdk_finish_snapshot(self, version: int, reserved: Any) -> SamplerHandle:
        """Await the snapshot's path (under the step's deadline), then open a sampling
        client on it (idempotent and retried)."""

        async def saved() -> str:
            return str((await settled(reserved)).path)

        path = await self._step_call(version, saved, completes=False)
        return await self.open_sampler(version, path)

    async def _sdk_sampling_client(
        self, path: str | None, base_model: str | None = None
    ) -> tinker.SamplingClient:
        client = await self._service.create_sampling_client_async(
            model_path=path, base_model=base_model, retry_config=self._sampling_retry_config()
        )
        if not hooks_http_client(self.info.base_url):
            # The SDK's own HTTP client there: the queue's answers are followed as the
            # SDK reports them, without place or ETA.
            follow_queue_states(client, self.queue)
        return client

    async def _sdk_new_training(self, lora: LoraSpec) -> tinker.TrainingClient:
        """A new training client: a fresh LoRA, or one loaded from ``--init-from`` (its
        weights, and with ``--init-from-optimizer`` its optimizer state)."""
        service = self._service
        if lora.rollout_correction is not None:
            return await self._corrected_training(lora)
        if lora.init_from is not None:
            if lora.init_with_optimizer:
                return await service.create_training_client_from_state_with_optimizer_async(
                    lora.init_from
                )
            return await service.create_training_client_from_state_async(lora.init_from)
        return await service.create_lora_training_client_async(
            base_model=lora.base_model,
            rank=lora.rank,
            seed=lora.seed,
            train_mlp=True,
            train_attn=True,
            train_unembed=True,
        )

    async def _sdk_load_training(self, state_path: str) -> tinker.TrainingClient:
        if self._lora.rollout_correction is not None:
            restored = dataclasses.replace(
                self._lora, init_from=state_path, init_with_optimizer=True
            )
            return await self._corrected_training(restored)
        return await self._service.create_training_client_from_state_with_optimizer_async(
            state_path
        )

    async def _corrected_training(self, lora: LoraSpec) -> tinker.TrainingClient:
        """A training client whose ``create_model`` carries ``lora.rollout_correction``
        (MinT's session-level correction, which the SDK has no parameter for): the SDK's
        own create_model request with the field added to its body, then (``init_from``)
        the saved state loaded into it, as the SDK's ``create_training_client_from_state``
        does. A correction applies to the model it was created with, so a restored run
        sends it again."""
        service = self._service
        holder = service.holder
        base_model, rank = lora.base_model, lora.rank
        if lora.init_from is not None:
            info = await service.create_rest_client().get_weights_info_by_tinker_path(
                lora.init_from
            )
            base_model, rank = info.base_model, info.lora_rank or rank
        model_seq_id = holder.get_training_client_id()
        request = types.CreateModelRequest(
            session_id=holder.get_session_id(),
            model_seq_id=model_seq_id,
            base_model=base_model,
            lora_config=types.LoraConfig(rank=rank, seed=lora.seed),
        )
        correction = {"rollout_correction_config": dict(lora.rollout_correction or {})}

        async def create() -> types.CreateModelResponse:  # on the SDK's own event loop
            start = time.time()
            with holder.aclient(ClientConnectionPoolType.TRAIN) as client:
                future = await client.models.create(request=request, extra_body=correction)
            return await _APIFuture(
                types.CreateModelResponse,
                holder,
                future,
                request_start_time=start,
                request_type="CreateModel",
                queue_state_observer=QueueStateLogger(base_model, "Model creation"),
            ).result_async()

        created = await holder.run_coroutine_threadsafe(create()).result_async()
        training = tinker.TrainingClient(
            holder, model_seq_id=model_seq_id, model_id=created.model_id
        )
        if lora.init_from is not None:
            load = (
                training.load_state_with_optimizer_async
                if lora.init_with_optimizer
                else training.load_state_async
            )
            await (await load(lora.init_from)).result_async()
        return training

    async def _sdk_close(self, failed: bool) -> None:
        # Stops the SDK's session heartbeat (it would outlive a local server). tinker
        # 0.22 has no public close; tests/test_session_sdks.py fails if this changes.
        self._service.holder.close()


LOOPBACK_IDLE_CONNECTIONS = 64
"""Idle connections kept open to a server on this machine: enough for a burst of samples
and their answers, so a step's requests reuse connections instead of each opening and
closing one (which costs both processes CPU; docs/performance.md, item 12)."""


def hooks_http_client(base_url: str) -> bool:
    """Whether the SDK is given the engine's HTTP client (:func:`loopback_http_client`)
    for ``base_url``: a server on this machine."""
    return is_loopback_host(httpx.URL(base_url).host)


def loopback_http_client(
    base_url: str, queue: QueueObserver | None = None
) -> httpx.AsyncClient | None:
    """For a server on this machine, the HTTP client tinker 0.22 would build itself (same
    class and timeout), shared by all of the SDK's internal clients, on pyqwest (the
    SDK's own default transport: far less CPU per request than httpx's pool) with
    LOOPBACK_IDLE_CONNECTIONS idle connections; None (the SDK's own) for any other
    server. The transport follows no redirects itself: httpx follows them as each
    request asks, so ``get_checkpoint_archive_url`` still sees its 302 (the SDK's own
    pyqwest transport follows them, which is why the local server keeps tinker 0.22 on
    httpx). ``queue`` sees every response (:func:`queue_hooks`)."""
    if not hooks_http_client(base_url):
        return None
    transport = AsyncPyqwestTransport(
        transport=pyqwest.HTTPTransport(
            follow_redirects=False, pool_max_idle_per_host=LOOPBACK_IDLE_CONNECTIONS
        )
    )
    return AsyncHttpxClientWrapper(
        base_url=base_url,
        timeout=DEFAULT_TIMEOUT,
        transport=transport,
        event_hooks=queue_hooks(queue),
    )


def queue_hooks(queue: QueueObserver | None) -> dict[str, list[Any]]:
    """httpx ``event_hooks`` that show ``queue`` each response (none without one)."""
    return {} if queue is None else {"response": [queue.hook]}


def service_client(
    base_url: str, api_key: str | None, queue: QueueObserver | None = None, **options: Any
) -> tinker.ServiceClient:
    """``mint.ServiceClient(base_url, api_key, **options)`` (it may block), with
    :func:`loopback_http_client`'s HTTP client (and ``queue``'s hook) for a server on
    this machine. A remote server keeps the HTTP clients the SDK builds itself: they
    follow the server's transport switch (``use_pyqwest_transport``), which a client
    passed in would override, so ``queue`` sees nothing there."""
    pool = loopback_http_client(base_url, queue)
    if pool is not None:
        options["http_client"] = pool
    return mint.ServiceClient(base_url=base_url, api_key=api_key, **options)


def sampling_params(settings: SamplingParams) -> types.SamplingParams:
    return types.SamplingParams(
        max_tokens=settings.max_tokens,
        temperature=settings.temperature,
        seed=settings.seed,
        stop=list(settings.stop_strings) or list(settings.stop_token_ids) or None,
    )


def reserve_sampler_snapshot(
    training: tinker.TrainingClient, name: str, ttl_seconds: int | None = SNAPSHOT_TTL_S
) -> Any:
    """``save_weights_for_sampler(name)`` (kept for ``ttl_seconds``, None: for good)
    with its place in the model's sequence taken NOW; returns the SDK future of its
    response.

    Why not the public method: tinker 0.22's ``save_weights_for_sampler[_async]`` takes
    its ``seq_id`` only once the SDK's own event loop runs the request, so a
    ``forward_backward`` called right after it (which, like ``optim_step`` and
    ``save_state``, takes its ``seq_id`` at once) can overtake it, and the snapshot would
    hold a later step's weights. The method the public one wraps takes it at once
    (tests/test_session_sdks.py fails if its signature changes)."""
    return training._save_weights_for_sampler_impl(name, ttl_seconds)
