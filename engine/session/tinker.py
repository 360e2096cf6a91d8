"""The Tinker session: the adapter for the tinker SDK >= 0.38 (hosted Tinker, any
Tinker-compatible server, the local server).

The session logic is :mod:`engine.session.adapter`'s; this module makes the 0.38 calls.
What 0.38 changes for the engine:

* Training calls return their future at once and take their place in the model's
  sequence as they are called (``forward_backward``, ``optim_step``, ``save_state``);
  the ``*_async`` forms are deprecated.
* ``save_weights_and_get_sampling_client(kind="snapshot")`` takes its place at once
  too and no longer blocks: sampler snapshots need no private call (tinker 0.22 does,
  :func:`engine.session.mint.reserve_sampler_snapshot`). Its snapshots are ephemeral
  (no ``tinker://`` path); checkpoints still save named sampler weights.
* ``ServiceClient.close(status)`` finishes the server session (its heartbeat stops, the
  server releases what the session held); capabilities come from ``RestClient``.
* ServiceClient creates its server session on first use, which may block: the first
  calls run in a worker thread.
* ServiceClient takes no ``max_retries`` (it warns and ignores it): its HTTP layer keeps
  the SDK's 10 retries of a setup call (``engine.session.retry`` lowers it to 3 for
  0.22); the per-attempt deadlines of the reliability layer still bound every call.

Clients are typed ``Any`` here: the project's type check runs in the tinker 0.22
environment, whose signatures differ.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any, Final, TypeVar

import anyio
import tinker
from tinker import types
from tinker.lib.base_url import DEFAULT_BASE_URL

from engine.session.adapter import SdkSession
from engine.session.api import LossSpec, SamplerHandle, SamplingParams
from engine.session.provenance import SampledIndex, Span, datum_provenance
from engine.session.queue_watch import QueueObserver, follow_queue_states
from engine.session.sdk_calls import LoraSpec, settled

__all__ = ["CLOSE_TIMEOUT_S", "STABILITY_LOSSES", "TinkerSession"]

T = TypeVar("T")

STABILITY_LOSSES: Final = frozenset({"stable_reinforce"})
"""Losses that need samples recorded (``record_stability_info``) and datums attributed
to them (``Datum.with_provenance``, built by :mod:`engine.session.provenance`)."""

CLOSE_TIMEOUT_S: Final = 10.0
"""How long closing waits for the server to finish the session (best effort: a server
that is gone cannot answer, and the run's outcome is already decided)."""


async def _in_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    return await anyio.to_thread.run_sync(
        functools.partial(fn, *args, **kwargs), abandon_on_cancel=True
    )


class TinkerSession(SdkSession):
    """A connected training session over tinker >= 0.38."""

    sdk = "tinker"
    sdk_version = tinker.__version__
    default_base_url = DEFAULT_BASE_URL  # hosted Tinker

    @property
    def _records_stability(self) -> bool:
        return self.config.training.loss in STABILITY_LOSSES

    @functools.cached_property
    def _sampled(self) -> SampledIndex:
        """The responses sampled with stability info, to attribute datums to them."""
        return SampledIndex()

    @staticmethod
    def _sdk_service(
        base_url: str, api_key: str | None, queue: QueueObserver | None = None
    ) -> tinker.ServiceClient:
        # The SDK builds its own HTTP clients: the queue's answers are followed on each
        # sampling client instead (follow_queue_states).
        return tinker.ServiceClient(base_url=base_url, api_key=api_key)

    async def _sdk_supported_models(
        self, base_url: str, api_key: str | None
    ) -> dict[str, int | None]:
        rest_client = tinker.RestClient  # type: ignore[attr-defined]  # new in 0.38
        rest = await _in_thread(rest_client, base_url=base_url, api_key=api_key)
        caps = await rest.get_server_capabilities()
        return {m.model_name: m.max_context_length for m in caps.supported_models if m.model_name}

    async def _sdk_sample(
        self,
        client: Any,
        prompt: types.ModelInput,
        num_samples: int,
        settings: SamplingParams,
    ) -> types.SampleResponse:
        params = types.SamplingParams(
            max_tokens=settings.max_tokens,
            temperature=settings.temperature,
            seed=settings.seed,
            stop=list(settings.stop_strings) or list(settings.stop_token_ids) or None,
        )
        response = await client.sample(
            prompt=prompt, num_samples=num_samples, sampling_params=params
        )
        if self._records_stability:
            for seq in response.sequences:
                if seq.logprobs is not None:
                    self._sampled.add(seq.sequence_id, seq.tokens, seq.logprobs)
        return response

    async def _sdk_prompt_logprobs(self, client: Any, prompt: types.ModelInput) -> list[Any]:
        return list(await client.compute_logprobs(prompt))

    async def _sdk_forward_backward(
        self, training: Any, batch: list[types.Datum], loss: LossSpec
    ) -> Any:
        if loss.name in STABILITY_LOSSES:
            batch = [self._with_provenance(d, f"datum {i}") for i, d in enumerate(batch)]
        return training.forward_backward(
            batch,
            loss.name,  # type: ignore[arg-type]  # validated against LOSSES by the config
            loss.config,
        )

    async def _sdk_forward_backward_custom(
        self, training: Any, batch: list[types.Datum], loss_fn: Any
    ) -> Any:
        # 0.38 reserves both rounds' places at once and runs the forward, the loss and
        # the backward on its own loop: the future returns at once.
        return training.forward_backward_custom(batch, loss_fn)

    def _with_provenance(self, datum: Any, where: str) -> Any:
        inputs = datum.loss_fn_inputs
        model_input, loss_inputs = datum_provenance(
            self._sampled,
            inputs["target_tokens"].to_numpy(),
            inputs["logprobs"].to_numpy(),
            inputs["weights"].to_numpy(),
            where,
        )
        return datum.with_provenance(
            model_input=[_sdk_span(s) for s in model_input],
            loss_fn_inputs=[_sdk_span(s) for s in loss_inputs],
        )

    async def _sdk_optim_step(self, training: Any, params: types.AdamParams) -> Any:
        return training.optim_step(params)

    async def _sdk_save_state(self, training: Any, name: str) -> Any:
        return training.save_state(name, overwrite=True)

    async def _sdk_save_sampler(self, training: Any, name: str) -> Any:
        return training.save_weights_for_sampler(name)

    def _sdk_reserve_sampler_save(self, training: Any, name: str) -> Any:
        # The public save_weights_for_sampler takes its seq_id only once the SDK's loop
        # runs it (as in 0.22, see engine.session.mint.reserve_sampler_snapshot); the
        # method it wraps takes it at once (tests/test_session_sdks.py checks it).
        return training._save_weights_for_sampler_impl(name, None, None, "snapshot")

    def _sdk_reserve_snapshot(self, training: Any, version: int) -> Any:
        return training.save_weights_and_get_sampling_client(
            retry_config=self._sampling_retry_config(),
            kind="snapshot",
            record_stability_info=self._records_stability,
        )

    async def _sdk_finish_snapshot(self, version: int, reserved: Any) -> SamplerHandle:
        """The snapshot's sampling client, under the step's deadline (the snapshot and
        its sampling session are one call: not retried)."""
        client = await self._step_call(version, lambda: settled(reserved), completes=False)
        follow_queue_states(client, self.queue)
        return SamplerHandle(version, client)

    async def _sdk_sampling_client(
        self, path: str | None, base_model: str | None = None
    ) -> tinker.SamplingClient:
        future = await _in_thread(
            self._service.create_sampling_client,
            model_path=path,
            base_model=base_model,
            retry_config=self._sampling_retry_config(),
            record_stability_info=self._records_stability,
        )
        client = await future
        follow_queue_states(client, self.queue)
        return client  # type: ignore[no-any-return]

    async def _sdk_new_training(self, lora: LoraSpec) -> tinker.TrainingClient:
        """A new training client: a fresh LoRA, or one loaded from ``--init-from`` (its
        weights, and with ``--init-from-optimizer`` its optimizer state)."""
        service = self._service
        if lora.init_from is not None:
            load = (
                service.create_training_client_from_state_with_optimizer
                if lora.init_with_optimizer
                else service.create_training_client_from_state
            )
            return await (await _in_thread(load, lora.init_from))  # type: ignore[no-any-return]
        future = await _in_thread(
            service.create_lora_training_client,
            base_model=lora.base_model,
            rank=lora.rank,
            seed=lora.seed,
            train_mlp=True,
            train_attn=True,
            train_unembed=True,
        )
        return await future  # type: ignore[no-any-return]

    async def _sdk_load_training(self, state_path: str) -> tinker.TrainingClient:
        future = await _in_thread(
            self._service.create_training_client_from_state_with_optimizer, state_path
        )
        return await future  # type: ignore[no-any-return]

    async def _sdk_close(self, failed: bool) -> None:
        # Best effort: the run's outcome is decided; a server that is gone cannot answer.
        with anyio.move_on_after(CLOSE_TIMEOUT_S), contextlib.suppress(Exception):
            await settled(self._service.close("errored" if failed else "success"))


def _sdk_span(span: Span) -> Any:
    kind = types.SampledProvenanceSpan if span.kind == "sampled" else types.PromptProvenanceSpan  # type: ignore[attr-defined]  # new in 0.38
    return kind(sequence_id=span.sequence_id, offset=span.offset, length=span.length)
