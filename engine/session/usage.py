"""The tokens a run's server calls bill, counted at each call and charged to the step it
serves.

Hosted services bill three kinds of tokens (Tinker's price list names them: prefill,
sample, train). :class:`MeteredSession` wraps the run's session and counts, per call
that succeeded (a failed or retried attempt is not counted: what it was billed is not
known):

* ``sample``: the prompt once per request (prefill; ``num_samples`` responses share
  one request) and every returned token (sampled); an episode's later turn sends its
  whole context again, so it counts as prefill again;
* ``prompt_logprobs`` (a teacher's, the DPO reference's, a held-out loss): every token,
  as prefill (a forward pass only);
* ``forward_backward``: every input token of every datum (trained);
* ``forward_backward_custom``: its forward pass (prefill) and its backward (trained),
  the same tokens each.

Each count goes to the step its call serves (:func:`spending_for`: a group's samples,
teacher and judge calls to the group's step, an evaluation to the step it follows; a
train call to its ticket's step), or, outside any step (the step-0 evaluation), to the
next step recorded. :meth:`TokenMeter.take` hands a recorded step its counts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from engine.core.datums import Datum
from engine.session.api import (
    CustomLoss,
    LossSpec,
    PendingCheckpoint,
    PendingSnapshot,
    SampleResult,
    SamplerHandle,
    SamplingParams,
    ServerInfo,
    Session,
    StepTicket,
    TrainResult,
)

__all__ = ["MeteredSession", "TokenCounts", "TokenMeter", "spending_for"]


@dataclass(frozen=True)
class TokenCounts:
    """Billed tokens by kind."""

    prefill: int = 0
    sampled: int = 0
    trained: int = 0

    def __add__(self, other: TokenCounts) -> TokenCounts:
        return TokenCounts(
            self.prefill + other.prefill,
            self.sampled + other.sampled,
            self.trained + other.trained,
        )


_STEP: ContextVar[int | None] = ContextVar("engine_token_step", default=None)


@contextlib.contextmanager
def spending_for(step: int) -> Iterator[None]:
    """Charge the calls made inside (and in the tasks started inside) to ``step`` (1-based,
    as metrics count)."""
    token = _STEP.set(step)
    try:
        yield
    finally:
        _STEP.reset(token)


class TokenMeter:
    """Counts per step, and the total of the steps taken so far (``start``: a resumed
    run's total at its checkpoint). Owned by one event loop; no locking. At most one
    entry per step with calls not yet recorded (the steps in flight)."""

    def __init__(self, start: TokenCounts | None = None) -> None:
        self._by_step: dict[int | None, TokenCounts] = {}
        self._total = start or TokenCounts()

    def add(self, counts: TokenCounts, step: int | None = None) -> None:
        """Count ``counts`` for ``step`` (None: the step of :func:`spending_for`, else
        the next step recorded)."""
        key = step if step is not None else _STEP.get()
        self._by_step[key] = self._by_step.get(key, TokenCounts()) + counts

    def take(self, step: int) -> tuple[TokenCounts, TokenCounts]:
        """``step``'s counts (with those outside any step) and the total after it.
        A step recorded again after a recovery takes what its redo spent: the total
        holds both attempts, as the bill does."""
        spent = self._by_step.pop(step, TokenCounts()) + self._by_step.pop(None, TokenCounts())
        self._total += spent
        return spent, self._total

    def unrecorded(self) -> TokenCounts:
        """What the calls of steps not recorded (yet) spent: at a stop, the groups
        sampled ahead (a resume trains them without sampling them again)."""
        return sum(self._by_step.values(), TokenCounts())


class MeteredSession:
    """``session`` with every billed call counted in ``meter`` (see the module doc);
    everything else is passed through."""

    def __init__(self, session: Session, meter: TokenMeter) -> None:
        self._session = session
        self._meter = meter

    @property
    def info(self) -> ServerInfo:
        return self._session.info

    @property
    def model_id(self) -> str | None:
        return self._session.model_id

    @property
    def tokenizer(self) -> Any:
        return self._session.tokenizer

    @property
    def custom_loss_refusal(self) -> str | None:
        return self._session.custom_loss_refusal

    async def sample(
        self,
        sampler: SamplerHandle,
        prompt_tokens: Sequence[int],
        num_samples: int,
        settings: SamplingParams,
    ) -> SampleResult:
        result = await self._session.sample(sampler, prompt_tokens, num_samples, settings)
        sampled = sum(len(c.tokens) for c in result.completions)
        self._meter.add(TokenCounts(prefill=len(prompt_tokens), sampled=sampled))
        return result

    async def prompt_logprobs(
        self, sampler: SamplerHandle, tokens: Sequence[int]
    ) -> list[float | None]:
        logprobs = await self._session.prompt_logprobs(sampler, tokens)
        self._meter.add(TokenCounts(prefill=len(tokens)))
        return logprobs

    async def submit_forward_backward(
        self, ticket: StepTicket, datums: Sequence[Datum], loss: LossSpec
    ) -> None:
        await self._session.submit_forward_backward(ticket, datums, loss)
        self._meter.add(TokenCounts(trained=_tokens(datums)), ticket.step)

    async def submit_forward_backward_custom(
        self, ticket: StepTicket, datums: Sequence[Datum], loss: CustomLoss
    ) -> None:
        await self._session.submit_forward_backward_custom(ticket, datums, loss)
        tokens = _tokens(datums)
        self._meter.add(TokenCounts(prefill=tokens, trained=tokens), ticket.step)

    async def submit_optim_step(self, ticket: StepTicket, learning_rate: float) -> None:
        await self._session.submit_optim_step(ticket, learning_rate)

    async def submit_snapshot(self, version: int) -> PendingSnapshot:
        return await self._session.submit_snapshot(version)

    async def submit_checkpoint(self, step: int, name: str) -> PendingCheckpoint:
        return await self._session.submit_checkpoint(step, name)

    async def delivered(self, step: int) -> None:
        await self._session.delivered(step)

    async def finish_train_step(self, ticket: StepTicket) -> TrainResult:
        return await self._session.finish_train_step(ticket)

    async def finish_snapshot(self, pending: PendingSnapshot) -> SamplerHandle:
        return await self._session.finish_snapshot(pending)

    async def finish_checkpoint(self, pending: PendingCheckpoint) -> tuple[str, str]:
        return await self._session.finish_checkpoint(pending)

    async def open_sampler(self, version: int, sampler_path: str) -> SamplerHandle:
        return await self._session.open_sampler(version, sampler_path)

    async def open_base_sampler(self) -> SamplerHandle:
        return await self._session.open_base_sampler()

    async def open_teacher(self, source: str) -> tuple[SamplerHandle, Any]:
        return await self._session.open_teacher(source)

    async def save_checkpoint(
        self, state_name: str, sampler_name: str, *, once_within: float | None = None
    ) -> tuple[str, str]:
        return await self._session.save_checkpoint(
            state_name, sampler_name, once_within=once_within
        )

    async def restore(self, state_path: str | None, *, optimizer: bool = True) -> None:
        await self._session.restore(state_path, optimizer=optimizer)


def _tokens(datums: Sequence[Datum]) -> int:
    """The input tokens of ``datums`` (what a forward or backward pass processes)."""
    return sum(len(d) for d in datums)
