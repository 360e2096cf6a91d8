"""The session seam: what the pipeline asks of a MinT session, in the engine's own types.

Why a Protocol: the pipeline (sampling, scoring, training) is the engine's logic; the
SDK calls behind it are I/O. :class:`Session` is everything the pipeline and the
engine's supervision need from the service, typed with plain engine values
(:class:`~engine.core.datums.Datum`, :class:`SamplingParams`, :class:`SamplerHandle`...), so no
SDK type crosses it. :class:`engine.session.mint.MintSession` (the ``mint`` SDK, tinker 0.22) and
:class:`engine.session.tinker.TinkerSession` (tinker >= 0.38) implement it over the
SDK; tests implement it with a fake (``tests/fake_session.py``) and an injected clock.

A train step is submitted in parts and awaited later, so the trainer can submit step
``s+1`` while step ``s``'s results are still outstanding:

* :meth:`Session.submit_forward_backward` (one or more chunks) and
  :meth:`Session.submit_optim_step` fix the step's place in the model's sequence;
* :meth:`Session.submit_snapshot` reserves the place of the sampler snapshot of the
  weights after that step (the next version) right behind it;
* :meth:`Session.submit_checkpoint` reserves a checkpoint (``save_state`` and sampler
  weights) of those same weights there too, so a periodic checkpoint never makes the
  trainer wait for a server round;
* :meth:`Session.submit_forward_backward_custom` submits a step's forward_backward
  with a loss the client computes (:class:`CustomLoss`, ``--objective dpo``): the
  policy's logprobs come back first, and the backward is sent once the loss's gradients
  are known (two server rounds, not one);
* :meth:`Session.finish_train_step`, :meth:`Session.finish_snapshot` and
  :meth:`Session.finish_checkpoint` await them.

Each ``submit_*`` returns once the request's place is fixed; its failure (or the failure
of awaiting it) raises :class:`~engine.errors.StepOutcomeUnknown` (or
:class:`~engine.errors.PermanentServiceError` for a refused request).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from engine.core.datums import Completion, Datum

__all__ = [
    "CustomLoss",
    "CustomLossValue",
    "LossSpec",
    "PendingCheckpoint",
    "PendingSnapshot",
    "SampleResult",
    "SamplerHandle",
    "SamplingParams",
    "ServerInfo",
    "Session",
    "StepTicket",
    "TrainResult",
]


@dataclass(frozen=True)
class ServerInfo:
    """Where the session goes and what it trains."""

    base_url: str
    base_model: str
    local: bool
    supported_models: tuple[str, ...]
    max_context: int | None = None
    """The base model's context length in tokens, when the server says (prompt plus
    response must fit in it)."""


@dataclass(frozen=True)
class SamplingParams:
    """What every sample request of a run asks for."""

    max_tokens: int
    temperature: float
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    """The task's stop strings; when set they are sent instead of ``stop_token_ids``
    (the SDK takes one kind), with the EOS token's text among them."""


@dataclass(frozen=True)
class LossSpec:
    """The loss ``forward_backward`` applies: its name and ``loss_fn_config``."""

    name: str
    config: dict[str, float] | None = None


@dataclass(frozen=True)
class CustomLossValue:
    """A client-side loss at the policy's logprobs: its value, its gradient with respect
    to each datum's logprobs (one array per datum, the shape of its ``target_tokens``)
    and metrics."""

    loss: float
    gradients: list[np.ndarray]
    metrics: dict[str, float] = field(default_factory=dict)


class CustomLoss(Protocol):
    """A loss computed on the client from the training policy's logprob of each target
    token of each datum (``Session.submit_forward_backward_custom``)."""

    def __call__(self, logprobs: Sequence[np.ndarray]) -> CustomLossValue: ...


@dataclass(frozen=True)
class SamplerHandle:
    """A frozen snapshot of the policy, usable for sampling. ``version`` counts the train
    steps applied before the snapshot (0 = the initial weights); ``client`` is the
    session's own handle (opaque to the pipeline)."""

    version: int
    client: object = field(repr=False, compare=False)


@dataclass(frozen=True)
class SampleResult:
    """The responses of one sample request, tagged with the policy version that made
    them; ``retries`` counts the request's retries."""

    version: int
    completions: tuple[Completion, ...]
    retries: int = 0


@dataclass(frozen=True)
class TrainResult:
    """What a train step returned: the training policy's logprobs of every position of
    each datum (in datum order), the loss metrics summed over its forward_backward calls,
    and the optimizer's metrics."""

    logprobs: list[Sequence[float]]
    metrics: dict[str, float]
    optim_metrics: dict[str, float]


@dataclass
class StepTicket:
    """One train step's submitted calls whose results are still pending. ``handles`` are
    the session's own (opaque); ``datums`` counts the datums of each forward_backward."""

    step: int
    handles: list[object] = field(default_factory=list)
    datums: list[int] = field(default_factory=list)
    optim: object | None = None

    @property
    def submitted(self) -> bool:
        return bool(self.handles) or self.optim is not None


@dataclass(frozen=True)
class PendingSnapshot:
    """A sampler snapshot whose place in the model's sequence is fixed; ``handle`` is the
    session's own."""

    version: int
    handle: object = field(repr=False, compare=False)


@dataclass(frozen=True)
class PendingCheckpoint:
    """A checkpoint (``save_state`` and sampler weights of the same weights) whose place
    in the model's sequence is fixed: it holds the ``step`` optimizer steps submitted
    before it. ``handle`` is the session's own."""

    step: int
    handle: object = field(repr=False, compare=False)


@runtime_checkable
class Session(Protocol):
    """What the pipeline and the engine's supervision ask of a MinT session."""

    @property
    def info(self) -> ServerInfo: ...

    @property
    def model_id(self) -> str | None:
        """The server's id of the model this session trains (it changes when a checkpoint
        is restored; None before the model exists)."""
        ...

    @property
    def tokenizer(self) -> Any:
        """The served model's tokenizer (Hugging Face interface: ``encode``, ``decode``,
        ``eos_token_id``, ``eos_token``, ``chat_template``, ``apply_chat_template``);
        :class:`~engine.tasks.render.PromptRenderer` is its one user."""
        ...

    async def sample(
        self,
        sampler: SamplerHandle,
        prompt_tokens: Sequence[int],
        num_samples: int,
        settings: SamplingParams,
    ) -> SampleResult:
        """``num_samples`` responses to one prompt (retried on transient errors)."""
        ...

    async def prompt_logprobs(
        self, sampler: SamplerHandle, tokens: Sequence[int]
    ) -> list[float | None]:
        """``sampler``'s logprob of each of ``tokens`` given those before it (the first:
        None): what a held-out supervised loss is computed from (retried)."""
        ...

    async def submit_forward_backward(
        self, ticket: StepTicket, datums: Sequence[Datum], loss: LossSpec
    ) -> None: ...

    @property
    def custom_loss_refusal(self) -> str | None:
        """Why this session cannot train with a :class:`CustomLoss` (None: it can)."""
        ...

    async def submit_forward_backward_custom(
        self, ticket: StepTicket, datums: Sequence[Datum], loss: CustomLoss
    ) -> None:
        """Submit one forward_backward of ``ticket``'s step whose loss ``loss`` computes
        from the policy's logprobs of ``datums`` (each has ``target_tokens`` and
        ``weights``): a forward pass, then, once its logprobs are back, the backward pass
        of the loss's gradients. Returns once the backward's place is fixed."""
        ...

    async def submit_optim_step(self, ticket: StepTicket, learning_rate: float) -> None: ...

    async def submit_snapshot(self, version: int) -> PendingSnapshot:
        """Reserve a snapshot of the weights as they stand after everything submitted so
        far; it becomes sampler ``version``."""
        ...

    async def submit_checkpoint(self, step: int, name: str) -> PendingCheckpoint:
        """Reserve ``save_state`` and sampler weights (both named ``name``) of the weights
        after everything submitted so far, the ``step`` optimizer steps; never repeated
        (a new submission would save later weights)."""
        ...

    async def delivered(self, step: int) -> None:
        """Return once every training call submitted so far (through train step ``step``'s)
        has reached the server; their results may still be pending."""
        ...

    async def finish_train_step(self, ticket: StepTicket) -> TrainResult: ...

    async def finish_snapshot(self, pending: PendingSnapshot) -> SamplerHandle: ...

    async def finish_checkpoint(self, pending: PendingCheckpoint) -> tuple[str, str]:
        """Await a reserved checkpoint (one bounded attempt); returns the ``tinker://``
        paths of its state and sampler weights."""
        ...

    async def open_sampler(self, version: int, sampler_path: str) -> SamplerHandle:
        """A sampling client on saved sampler weights (a checkpoint's), as ``version``."""
        ...

    async def open_base_sampler(self) -> SamplerHandle:
        """A sampling client on the base model, as version 0: a fresh LoRA's weights (its
        update starts at zero), without a server round to save them first."""
        ...

    async def open_teacher(self, source: str) -> tuple[SamplerHandle, Any]:
        """A sampling client on ``source`` (``tinker://`` sampler weights, or a base
        model's name) for ``--objective distill``, and its tokenizer (the student's
        tokenizer itself when the teacher has the student's base model)."""
        ...

    async def save_checkpoint(
        self, state_name: str, sampler_name: str, *, once_within: float | None = None
    ) -> tuple[str, str]:
        """``save_state`` (with optimizer) and sampler weights of the same weights;
        returns their ``tinker://`` paths. ``once_within``: one bounded attempt each."""
        ...

    async def restore(self, state_path: str | None, *, optimizer: bool = True) -> None:
        """Replace the training client by one loaded from ``state_path`` (None: a fresh
        LoRA client); ``optimizer=False`` loads its weights only, with a fresh optimizer
        (as ``--init-from`` does)."""
        ...
