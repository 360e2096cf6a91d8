"""A fake MinT session behind the :class:`engine.session.api.Session` protocol, for fast,
deterministic stage tests of the pipeline: no server, no SDK, no sleeps.

It models what the pipeline relies on: a training client whose requests are applied in
submission order (each ``submit_*`` takes the next place in the sequence), a snapshot
that sees exactly the optimizer steps submitted before it, and sampling from a snapshot
tagged with its version; a reserved checkpoint saves the optimizer steps submitted
before it. Tests observe the order of calls in ``log`` and may hold any
step's results with ``hold(step)`` to see what the pipeline does meanwhile.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

import anyio
import numpy as np

from engine.core.datums import Completion, Datum
from engine.errors import StepOutcomeUnknown
from engine.session.api import (
    CustomLoss,
    CustomLossValue,
    LossSpec,
    PendingCheckpoint,
    PendingSnapshot,
    SampleResult,
    SamplerHandle,
    SamplingParams,
    ServerInfo,
    StepTicket,
    TrainResult,
)


class ByteTokenizer:
    """Tokens are UTF-8 bytes; no special tokens, no chat template."""

    eos_token_id = None
    eos_token = None
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    def decode(self, tokens: Sequence[int], skip_special_tokens: bool = False) -> str:
        return bytes(tokens).decode()


@dataclass
class FakeSession:
    """A Session whose sampler answers ``"<version> <i>"`` for response ``i`` (tokens are
    the UTF-8 bytes), with logprob -0.5 per token."""

    log: list[tuple[str, int]] = field(default_factory=list)
    losses: list[LossSpec] = field(default_factory=list)
    """The loss of every forward_backward, in submission order."""
    fail_step: int | None = None
    """A 1-based step whose results fail with an unknown outcome (once)."""
    fail_checkpoint: int | None = None
    """A step count whose reserved checkpoint fails to save (once)."""
    teacher_tokenizer: object | None = None
    """What :meth:`open_teacher` gives as the teacher's tokenizer (None: the student's)."""
    teacher_fails_after: int | None = None
    """Teacher prompt-logprobs requests that succeed before every later one fails."""
    teacher_error: Exception = field(
        default_factory=lambda: RuntimeError("the fake teacher is gone")
    )
    """What a failing teacher request raises."""
    custom_losses: list[tuple[int, list[Datum], CustomLossValue]] = field(default_factory=list)
    """Each custom-loss forward_backward: its step, datums and the loss at the fake
    policy's logprobs (:meth:`policy_logprobs`), in submission order."""
    custom_loss_refusal: str | None = None
    """Why the fake refuses a custom loss (None: it runs it)."""
    _submitted_optims: int = 0
    _holds: dict[int, anyio.Event] = field(default_factory=dict)
    _checkpoint_holds: dict[int, anyio.Event] = field(default_factory=dict)
    _checkpoints: dict[str, int] = field(default_factory=dict)
    _sampler_weights: dict[str, int] = field(default_factory=dict)

    # -- Session protocol -----------------------------------------------------------

    @property
    def info(self) -> ServerInfo:
        return ServerInfo("fake://", "fake-model", True, ("fake-model",))

    @property
    def model_id(self) -> str:
        return "fake-model-0"

    @property
    def tokenizer(self) -> ByteTokenizer:
        return ByteTokenizer()

    async def sample(
        self,
        sampler: SamplerHandle,
        prompt_tokens: Sequence[int],
        num_samples: int,
        settings: SamplingParams,
    ) -> SampleResult:
        await anyio.lowlevel.checkpoint()
        self.log.append(("sample", sampler.version))
        completions = tuple(
            Completion(
                tuple(f"{sampler.version} {i}".encode()), (-0.5,) * len(f"{sampler.version} {i}")
            )
            for i in range(num_samples)
        )
        return SampleResult(sampler.version, completions)

    async def prompt_logprobs(
        self, sampler: SamplerHandle, tokens: Sequence[int]
    ) -> list[float | None]:
        """-1 / (1 + version) per token: a later snapshot scores every token higher."""
        await anyio.lowlevel.checkpoint()
        if sampler.client == "teacher":
            if self.teacher_fails_after is not None:
                if self.teacher_fails_after == 0:
                    raise self.teacher_error
                self.teacher_fails_after -= 1
            self.log.append(("teacher_logprobs", len(tokens)))
            return [None, *[-1.0] * (len(tokens) - 1)]
        self.log.append(("prompt_logprobs", sampler.version))
        return [None, *[-1.0 / (1 + sampler.version)] * (len(tokens) - 1)]

    async def submit_forward_backward(
        self, ticket: StepTicket, datums: Sequence[Datum], loss: LossSpec
    ) -> None:
        await anyio.lowlevel.checkpoint()
        self.log.append(("forward_backward", ticket.step))
        self.losses.append(loss)
        ticket.handles.append(list(datums))
        ticket.datums.append(len(datums))

    async def submit_forward_backward_custom(
        self, ticket: StepTicket, datums: Sequence[Datum], loss: CustomLoss
    ) -> None:
        """The SDK's two rounds: the forward's logprobs (:meth:`policy_logprobs`), the
        loss on them, then the backward, submitted as one forward_backward."""
        await anyio.lowlevel.checkpoint()
        self.log.append(("forward", ticket.step))
        value = loss([self.policy_logprobs(d) for d in datums])
        self.custom_losses.append((ticket.step, list(datums), value))
        await self.submit_forward_backward(ticket, datums, LossSpec("custom"))

    def policy_logprobs(self, datum: Datum) -> np.ndarray:
        """The fake policy's logprob of each target token: -0.1 x (the step count the
        weights hold + 1) per byte value / 256 (deterministic, differs per token)."""
        targets = np.asarray(datum.loss_fn_inputs["target_tokens"], dtype=np.float64)
        return -0.1 * (self._submitted_optims + 1) * (1.0 + targets / 256.0)

    async def submit_optim_step(self, ticket: StepTicket, learning_rate: float) -> None:
        await anyio.lowlevel.checkpoint()
        self.log.append(("optim_step", ticket.step))
        self._submitted_optims += 1
        ticket.optim = self._submitted_optims

    async def delivered(self, step: int) -> None:
        await anyio.lowlevel.checkpoint()
        self.log.append(("delivered", step))

    async def submit_snapshot(self, version: int) -> PendingSnapshot:
        await anyio.lowlevel.checkpoint()
        self.log.append(("snapshot", version))
        return PendingSnapshot(version, self._submitted_optims)

    async def submit_checkpoint(self, step: int, name: str) -> PendingCheckpoint:
        await anyio.lowlevel.checkpoint()
        self.log.append(("checkpoint", self._submitted_optims))
        return PendingCheckpoint(step, (name, self._submitted_optims))

    async def finish_checkpoint(self, pending: PendingCheckpoint) -> tuple[str, str]:
        hold = self._checkpoint_holds.get(pending.step)
        if hold is not None:
            await hold.wait()
        await anyio.lowlevel.checkpoint()
        name, seen = cast("tuple[str, int]", pending.handle)  # as submit_checkpoint made it
        if self.fail_checkpoint == pending.step:
            self.fail_checkpoint = None
            raise RuntimeError(f"the fake server could not save {name}")
        self.log.append(("checkpoint_saved", seen))
        return self._saved(name, name, seen)

    async def finish_train_step(self, ticket: StepTicket) -> TrainResult:
        hold = self._holds.get(ticket.step)
        if hold is not None:
            await hold.wait()
        await anyio.lowlevel.checkpoint()
        if self.fail_step == ticket.step:
            self.fail_step = None
            self.log.append(("failed", ticket.step))
            raise StepOutcomeUnknown(ticket.step, "the fake server lost the answer")
        self.log.append(("finished", ticket.step))
        logprobs: list[Sequence[float]] = [
            [-0.5] * len(d)
            for handle in ticket.handles
            for d in cast("list[Datum]", handle)  # as submit_forward_backward made it
        ]
        return TrainResult(logprobs, {"loss:sum": 1.0}, {})

    async def finish_snapshot(self, pending: PendingSnapshot) -> SamplerHandle:
        await anyio.lowlevel.checkpoint()
        seen = int(pending.handle)  # type: ignore[call-overload]
        assert seen == pending.version, f"snapshot v{pending.version} saw {seen} optim steps"
        return SamplerHandle(pending.version, seen)

    async def open_sampler(self, version: int, sampler_path: str) -> SamplerHandle:
        await anyio.lowlevel.checkpoint()
        return SamplerHandle(version, self._sampler_weights[sampler_path])

    async def open_base_sampler(self) -> SamplerHandle:
        await anyio.lowlevel.checkpoint()
        self.log.append(("base_sampler", 0))
        return SamplerHandle(0, 0)

    async def open_teacher(self, source: str) -> tuple[SamplerHandle, object]:
        """A teacher whose prompt logprobs are -1 per token (a version-0 sampler)."""
        await anyio.lowlevel.checkpoint()
        self.log.append(("teacher", 0))
        tokenizer = self.teacher_tokenizer or self.tokenizer
        return SamplerHandle(0, "teacher"), tokenizer

    async def save_checkpoint(
        self, state_name: str, sampler_name: str, *, once_within: float | None = None
    ) -> tuple[str, str]:
        await anyio.lowlevel.checkpoint()
        self.log.append(("checkpoint", self._submitted_optims))
        return self._saved(state_name, sampler_name, self._submitted_optims)

    def _saved(self, state_name: str, sampler_name: str, optims: int) -> tuple[str, str]:
        self._checkpoints[state_name] = optims
        sampler_path = f"fake://sampler/{sampler_name}"
        self._sampler_weights[sampler_path] = optims
        return f"tinker://fake-model-0/weights/{state_name}", sampler_path

    async def restore(self, state_path: str | None, *, optimizer: bool = True) -> None:
        await anyio.lowlevel.checkpoint()
        name = None if state_path is None else state_path.rsplit("/", 1)[-1]
        loaded = 0 if name is None else self._checkpoints[name]
        self.log.append(("restore" if optimizer else "restore_weights", loaded))
        # Weights only (init_from): a fresh optimizer, whose steps count from 0 as the
        # versions of the run that starts from them do.
        self._submitted_optims = loaded if optimizer else 0

    # -- test controls --------------------------------------------------------------

    def hold(self, step: int) -> anyio.Event:
        """Hold step ``step``'s results until the returned event is set."""
        event = anyio.Event()
        self._holds[step] = event
        return event

    def hold_checkpoint(self, step: int) -> anyio.Event:
        """Hold the checkpoint after ``step`` steps (its save) until the event is set."""
        event = anyio.Event()
        self._checkpoint_holds[step] = event
        return event

    def index(self, entry: tuple[str, int]) -> int:
        return self.log.index(entry)
