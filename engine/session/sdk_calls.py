"""What both adapters share below the session: the SDK calls each makes its own way
(:class:`SdkCalls`, the methods :class:`~engine.session.adapter.SdkSession` is built on)
and small pieces of SDK plumbing: engine datums as SDK datums, a custom
loss as the SDK's loss function, sampler snapshot names, awaiting an SDK future without
cancelling its call, the sampling clients' retry config, importing the tokenizer library
off the event loop, and a sampler's tokenizer."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import anyio
import numpy as np
from tinker import types
from tinker.lib.retry_handler import RetryConfig

from engine.common.sdks import SdkName
from engine.core.datums import Datum
from engine.session.api import CustomLoss, LossSpec, SamplingParams
from engine.session.queue_watch import QueueObserver
from engine.session.retry import RetryPolicy

__all__ = [
    "LoraSpec",
    "SdkCalls",
    "custom_loss_refusal",
    "import_tokenizer_library",
    "sampler_tokenizer",
    "sdk_sampling_retry_config",
    "settled",
    "snapshot_name",
    "to_sdk_datum",
    "torch_loss",
]


@dataclass(frozen=True)
class LoraSpec:
    """The LoRA adapter a session's training client is created with."""

    base_model: str
    rank: int
    seed: int | None
    init_from: str | None = None  # saved weights the fresh client starts from
    init_with_optimizer: bool = False
    rollout_correction: Mapping[str, Any] | None = None
    """MinT's ``rollout_correction_config`` sent with ``create_model`` (None: none)."""


async def import_tokenizer_library() -> None:
    """Import what ``get_tokenizer`` imports (Hugging Face ``transformers``), in a worker
    thread; abandoned (left to finish) if the setup fails first."""

    def load() -> None:
        with contextlib.suppress(ImportError):  # get_tokenizer will say what is missing
            import transformers.models.auto.tokenization_auto  # noqa: F401

    await anyio.to_thread.run_sync(load, abandon_on_cancel=True)


async def sampler_tokenizer(client: Any, base_model: str, tokenizer: Any) -> Any:
    """The tokenizer of a sampling client's base model: ``tokenizer`` (the student's)
    when that is ``base_model``, else the SDK's own, loaded in a worker thread."""
    base = await anyio.to_thread.run_sync(client.get_base_model, abandon_on_cancel=True)
    if base == base_model:
        return tokenizer
    return await anyio.to_thread.run_sync(client.get_tokenizer, abandon_on_cancel=True)


def to_sdk_datum(datum: Datum) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens=datum.model_input.tolist()),
        loss_fn_inputs={
            key: types.TensorData.from_numpy(value) for key, value in datum.loss_fn_inputs.items()
        },
    )


def custom_loss_refusal(sdk: str, version: str) -> str | None:
    """Why ``forward_backward_custom`` cannot run here (None: it can): the SDK hands the
    loss the policy's logprobs as torch tensors and differentiates it with torch on the
    client, and says "PyTorch is not installed" when its module found no torch."""
    from tinker.lib.public_interfaces import training_client

    if getattr(training_client, "torch", None) is not None:
        return None
    return (
        f"the {sdk} SDK (tinker {version}) runs a custom loss through forward_backward_custom, "
        "which differentiates it with torch on the client, and torch is not installed in "
        "this environment (pip install torch)"
    )


def torch_loss(loss: CustomLoss) -> Callable[[list[types.Datum], list[Any]], tuple[Any, Any]]:
    """``loss`` as the SDK's custom loss function: it gets each datum's logprobs as torch
    tensors and returns a tensor whose gradient with respect to them is ``loss``'s
    gradients and whose value is ``loss``'s (a linear term around the logprobs the
    forward pass returned). torch is imported here only: a refusal says when it is
    missing (:func:`custom_loss_refusal`)."""
    import torch

    def fn(data: list[types.Datum], logprobs: list[Any]) -> tuple[Any, Any]:
        value = loss([np.asarray(lp.detach().cpu().numpy(), dtype=np.float64) for lp in logprobs])
        linear = torch.stack(
            [
                (lp * torch.as_tensor(g, dtype=lp.dtype)).sum()
                for lp, g in zip(logprobs, value.gradients, strict=True)
            ]
        ).sum()
        return linear - linear.detach() + value.loss, dict(value.metrics)

    return fn


def snapshot_name(version: int) -> str:
    """The sampler weights' name of policy ``version``: the snapshot lives at
    ``tinker://<model id>/sampler_weights/<name>``."""
    return f"sampler-v{version}"


async def settled(future: Any) -> Any:
    """The result of an SDK future (an ``APIFuture`` of a call on the model's sequence).
    Cancelling the wait abandons the result, never the call: the SDK would cancel its
    request after it took its place in the sequence, and every later call of the model
    would wait on the server for the place left empty."""
    return await asyncio.shield(asyncio.wrap_future(future.future()))


def sdk_sampling_retry_config(policy: RetryPolicy) -> RetryConfig:
    """``retry_config`` for sampling clients: the SDK's sampling retry loop (no attempt
    limit) gives up after ``policy.attempt_timeout`` without progress instead of 2 h,
    and uses the policy's backoff bounds."""
    base = RetryConfig()
    return RetryConfig(
        max_connections=base.max_connections,
        progress_timeout=policy.attempt_timeout or base.progress_timeout,
        retry_delay_base=max(policy.initial_wait, 0.01),
        retry_delay_max=max(policy.max_wait, policy.initial_wait, 0.01),
    )


class SdkCalls:
    """The SDK calls a session makes, each adapter its own way (tinker 0.22 under
    ``mint``, tinker >= 0.38): what a subclass of
    :class:`~engine.session.adapter.SdkSession` provides."""

    sdk: ClassVar[SdkName]
    """The adapter's name (``mint`` or ``tinker``)."""
    sdk_version: ClassVar[str]
    """The SDK's version, as its ``client/config`` request announces it."""
    default_base_url: ClassVar[str]
    """Where the session connects when an API key but no base URL is given."""

    @staticmethod
    def _sdk_service(base_url: str, api_key: str | None, queue: QueueObserver | None = None) -> Any:
        """A ServiceClient (runs in a worker thread: it may block) whose sampling queue
        answers ``queue`` sees."""
        raise NotImplementedError

    async def _sdk_supported_models(
        self, base_url: str, api_key: str | None
    ) -> dict[str, int | None]:
        """The server's models (its capabilities): name -> context length, if said."""
        raise NotImplementedError

    async def _sdk_sample(
        self, client: Any, prompt: types.ModelInput, num_samples: int, settings: SamplingParams
    ) -> types.SampleResponse:
        raise NotImplementedError

    async def _sdk_forward_backward(
        self, training: Any, batch: list[types.Datum], loss: LossSpec
    ) -> Any:
        """Submit; returns the SDK future of the result."""
        raise NotImplementedError

    async def _sdk_forward_backward_custom(
        self, training: Any, batch: list[types.Datum], loss_fn: Any
    ) -> Any:
        """Submit ``forward_backward_custom``; returns once the backward is submitted,
        with an SDK future of its result (one that :func:`settled` can await)."""
        raise NotImplementedError

    async def _sdk_prompt_logprobs(self, client: Any, prompt: types.ModelInput) -> list[Any]:
        """The sampler's logprob of each prompt token (the first: None)."""
        raise NotImplementedError

    async def _sdk_optim_step(self, training: Any, params: types.AdamParams) -> Any:
        raise NotImplementedError

    async def _sdk_save_state(self, training: Any, name: str) -> Any:
        """Submit ``save_state(name, overwrite=True)``; returns its SDK future."""
        raise NotImplementedError

    async def _sdk_save_sampler(self, training: Any, name: str) -> Any:
        """Submit ``save_weights_for_sampler(name)``; returns its SDK future."""
        raise NotImplementedError

    def _sdk_reserve_snapshot(self, training: Any, version: int) -> Any:
        """Take the place, in the model's sequence, of a sampler snapshot of the
        weights after everything submitted so far, NOW; returns what
        :meth:`_sdk_finish_snapshot` awaits."""
        raise NotImplementedError

    def _sdk_reserve_sampler_save(self, training: Any, name: str) -> Any:
        """``save_weights_for_sampler(name)`` (kept) with its place in the model's
        sequence taken NOW; returns its SDK future."""
        raise NotImplementedError

    async def _sdk_finish_snapshot(self, version: int, reserved: Any) -> Any:
        """A sampling client on a reserved snapshot (run under the step's deadline)."""
        raise NotImplementedError

    async def _sdk_sampling_client(self, path: str | None, base_model: str | None = None) -> Any:
        """A sampling client on saved sampler weights, or (``path`` None) on the base
        model."""
        raise NotImplementedError

    async def _sdk_new_training(self, lora: LoraSpec) -> Any:
        """A fresh LoRA training client (or one from ``--init-from``)."""
        raise NotImplementedError

    async def _sdk_load_training(self, state_path: str) -> Any:
        """A training client loaded from a saved state, with its optimizer."""
        raise NotImplementedError

    async def _sdk_close(self, failed: bool) -> None:
        """End the SDK's session (its heartbeat would outlive a local server)."""
        raise NotImplementedError
