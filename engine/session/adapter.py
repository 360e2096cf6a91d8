"""What the two SDK adapters share: the session over a Tinker-shaped SDK, with the SDK
calls themselves left to a subclass (:mod:`engine.session.mint` for tinker 0.22 under
``mint``, :mod:`engine.session.tinker` for tinker >= 0.38).

Both generations have the same clients, types and futures and differ in how a call is
made, how a sampler snapshot keeps its place in the model's sequence and how a session
closes; the rest is here once, every call through :meth:`SdkSession._call` (the seam
where retries, deadlines and the breaker wrap it). A step's ``forward_backward`` and
``optim_step`` are submitted before either is awaited (one server round); train-step
calls are never repeated (docs/architecture.md, "Wire facts" and "Exactly-once train
steps"). Imported only by the adapters: it imports ``tinker``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar, cast

import anyio
from tinker import types
from tinker.lib.retry_handler import RetryConfig

from engine.common.protocol import ROLLOUT_CORRECTIONS
from engine.config import EngineConfig
from engine.core.datums import Completion, Datum, with_loss_inputs
from engine.errors import EngineError, primary_error
from engine.session.api import (
    CustomLoss,
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
from engine.session.preflight import (
    PreflightError,
    check_local_loss_options,
    check_reachable,
    setup_call,
)
from engine.session.preflight import recommended_profile as read_recommended_profile
from engine.session.queue_watch import QueueObserver
from engine.session.retry import OpKind, RetryCounter, ServiceGuard, tally_retries
from engine.session.sdk_calls import (
    LoraSpec,
    SdkCalls,
    custom_loss_refusal,
    import_tokenizer_library,
    sampler_tokenizer,
    sdk_sampling_retry_config,
    settled,
    to_sdk_datum,
    torch_loss,
)

__all__ = ["SNAPSHOT_TTL_S", "SdkSession"]

T = TypeVar("T")

SNAPSHOT_TTL_S = 24 * 3600
"""Time to live of the per-version sampler weights on the server: a version is sampled
from for at most K+1 steps; the TTL keeps a long run from piling them up."""


class SdkSession(SdkCalls):
    """A connected training session: one training client and its tokenizer. Subclasses
    make the SDK calls (the ``_sdk_*`` methods of :class:`SdkCalls`)."""

    def __init__(
        self,
        service: Any,
        training: Any,
        tokenizer: Any,
        info: ServerInfo,
        guard: ServiceGuard,
        lora: LoraSpec,
        config: EngineConfig,
    ) -> None:
        self._service = service
        self._training = training
        self.tokenizer = tokenizer
        self.info = info
        self.config = config
        """The config the session was opened with, resolved with the server's defaults."""
        self.guard = guard
        self._lora = lora

    @property
    def retries(self) -> RetryCounter:
        """Retries per kind; step metrics read them as ``retries/<kind>``."""
        return self.guard.counter

    @property
    def queue(self) -> QueueObserver:
        """The server's sampling-queue answers; step metrics read them as ``queue/*``."""
        return self.guard.queue

    @property
    def model_id(self) -> str | None:
        """The server's id of the current training client (changes on restore)."""
        return self._training.model_id  # type: ignore[no-any-return]

    # -- the seam ----------------------------------------------------------------------

    async def _call(self, kind: OpKind, op: str, fn: Callable[[], Awaitable[T]]) -> T:
        """Run one SDK operation through the reliability layer (retries for the
        idempotent kinds, deadlines, breaker); ``fn`` must build a fresh request on
        each call."""
        return await self.guard.call(kind, op, fn)

    async def _step_call(self, step: int, fn: Callable[[], Awaitable[T]], *, completes: bool) -> T:
        """A train-step call: under its deadline, never repeated, any failure raises
        StepOutcomeUnknown (or PermanentServiceError for a refused request)."""
        return await self.guard.train_step(step, fn, completes=completes)

    # -- sampling ----------------------------------------------------------------------

    async def sample(
        self,
        sampler: SamplerHandle,
        prompt_tokens: Sequence[int],
        num_samples: int,
        settings: SamplingParams,
    ) -> SampleResult:
        """``num_samples`` responses to one prompt from ``sampler``."""
        client = sampler.client
        prompt = types.ModelInput.from_ints(tokens=list(prompt_tokens))

        async def go() -> types.SampleResponse:
            return await self._sdk_sample(client, prompt, num_samples, settings)

        with tally_retries() as tally:
            response = await self._call(OpKind.SAMPLE, "sample", go)
        completions = tuple(
            Completion(
                tokens=tuple(seq.tokens),
                logprobs=None if seq.logprobs is None else tuple(seq.logprobs),
                stop_reason=str(seq.stop_reason),
            )
            for seq in response.sequences
        )
        if len(completions) != num_samples:
            raise EngineError(
                f"the sampler returned {len(completions)} responses, {num_samples} were asked"
            )
        return SampleResult(sampler.version, completions, tally.count)

    async def prompt_logprobs(
        self, sampler: SamplerHandle, tokens: Sequence[int]
    ) -> list[float | None]:
        """``sampler``'s logprob of each of ``tokens`` given those before it (the first:
        None); retried like a sample request."""
        prompt = types.ModelInput.from_ints(tokens=list(tokens))
        logprobs = await self._call(
            OpKind.SAMPLE,
            "compute_logprobs",
            functools.partial(self._sdk_prompt_logprobs, sampler.client, prompt),
        )
        if len(logprobs) != len(tokens):
            raise EngineError(
                f"the sampler returned {len(logprobs)} prompt logprobs for {len(tokens)} tokens"
            )
        return [None if lp is None else float(lp) for lp in logprobs]

    async def submit_snapshot(self, version: int) -> PendingSnapshot:
        """Reserve, in the training client's sequence, a snapshot of the weights after
        everything submitted so far: submitted right behind a step's optim_step, it
        snapshots the weights after that step. Never repeated (a new submission would
        snapshot later weights); a failure is an unknown step outcome."""
        training = self._training

        async def go() -> Any:
            return self._sdk_reserve_snapshot(training, version)

        reserved = await self._step_call(version, go, completes=False)
        return PendingSnapshot(version, reserved)

    async def finish_snapshot(self, pending: PendingSnapshot) -> SamplerHandle:
        """Await a reserved snapshot and open a sampling client on it."""
        return await self._sdk_finish_snapshot(pending.version, pending.handle)

    async def open_sampler(self, version: int, sampler_path: str) -> SamplerHandle:
        """A sampling client on saved sampler weights (a checkpoint's, or a finished
        snapshot's), as policy ``version``; retried."""
        return SamplerHandle(version, await self._sampling_client(sampler_path, None))

    async def open_base_sampler(self) -> SamplerHandle:
        """A sampling client on the base model, as version 0 (a fresh LoRA's weights:
        its update starts at zero); retried."""
        return SamplerHandle(0, await self._sampling_client(None, self.info.base_model))

    async def open_teacher(self, source: str) -> tuple[SamplerHandle, Any]:
        """A sampling client on ``source`` (tinker:// sampler weights, or a base model's
        name) and its tokenizer; retried."""
        path = source if source.startswith("tinker://") else None
        client = await self._sampling_client(path, None if path else source)
        tokenizer = await sampler_tokenizer(client, self.info.base_model, self.tokenizer)
        return SamplerHandle(0, client), tokenizer

    async def _sampling_client(self, path: str | None, base_model: str | None) -> Any:
        return await self._call(
            OpKind.SAMPLER_SNAPSHOT,
            f"open sampler {path or base_model}",
            lambda: self._sdk_sampling_client(path, base_model),
        )

    def _sampling_retry_config(self) -> RetryConfig:
        return sdk_sampling_retry_config(self.guard.policy(OpKind.SAMPLE))

    # -- training ----------------------------------------------------------------------

    async def submit_forward_backward(
        self, ticket: StepTicket, datums: Sequence[Datum], loss: LossSpec
    ) -> None:
        """Submit one forward_backward of ``ticket``'s step (gradients accumulate until
        the optim step); its result is awaited by :meth:`finish_train_step`."""
        training = self._training
        batch = [to_sdk_datum(with_loss_inputs(d, loss.name)) for d in datums]

        async def go() -> Any:
            return await self._sdk_forward_backward(training, batch, loss)

        handle = await self._step_call(ticket.step, go, completes=False)
        ticket.handles.append(handle)
        ticket.datums.append(len(batch))

    @property
    def custom_loss_refusal(self) -> str | None:
        """Why this session cannot train with a custom loss (None: it can)."""
        return custom_loss_refusal(self.sdk, self.sdk_version)

    async def submit_forward_backward_custom(
        self, ticket: StepTicket, datums: Sequence[Datum], loss: CustomLoss
    ) -> None:
        """Submit ``forward_backward_custom`` for ``ticket``'s step: the SDK's forward
        pass, ``loss`` on its logprobs, then the backward pass of its gradients (a
        ``cross_entropy`` forward_backward weighted by minus the gradient). Like any
        training call it is never repeated; its result is awaited by
        :meth:`finish_train_step`."""
        training = self._training
        batch = [to_sdk_datum(d) for d in datums]
        loss_fn = torch_loss(loss)

        async def go() -> Any:
            return await self._sdk_forward_backward_custom(training, batch, loss_fn)

        handle = await self._step_call(ticket.step, go, completes=False)
        ticket.handles.append(handle)
        ticket.datums.append(len(batch))

    async def submit_optim_step(self, ticket: StepTicket, learning_rate: float) -> None:
        """Submit the Adam step of ``ticket``'s step (the quickstart sets only the
        learning rate)."""
        training = self._training

        async def go() -> Any:
            return await self._sdk_optim_step(
                training, types.AdamParams(learning_rate=learning_rate)
            )

        ticket.optim = await self._step_call(ticket.step, go, completes=False)

    async def delivered(self, step: int) -> None:
        """The SDK posts a training client's calls one at a time, each once the server
        has answered the one before (its "turn"), so calls submitted together reach the
        server a round trip apart, and behind whatever else the SDK's thread is sending.
        Both generations number the calls as they are submitted (``_request_id_counter``)
        and count the turns taken (``_turn_counter``, waking ``_turn_waiters`` on its own
        event loop): tests/test_session_sdks.py checks it on tinker 0.22, and every run
        in tests/test_sdk_matrix.py waits on it on 0.38."""
        training = self._training
        submitted: int = training._request_id_counter

        async def turns_taken() -> None:  # on the SDK's event loop
            if training._turn_counter < submitted:
                event = asyncio.Event()
                training._turn_waiters.setdefault(submitted, []).append(event)
                await event.wait()

        async def wait() -> None:
            loop = training.holder.get_loop()
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(turns_taken(), loop))

        await self._step_call(step, wait, completes=False)

    async def finish_train_step(self, ticket: StepTicket) -> TrainResult:
        """Await ``ticket``'s submitted calls; logprobs are in datum order. Any failure
        raises StepOutcomeUnknown: the step may or may not have been applied."""
        return await self._step_call(ticket.step, lambda: self._collect(ticket), completes=True)

    async def _collect(self, ticket: StepTicket) -> TrainResult:
        logprobs: list[Sequence[float]] = []
        metrics: dict[str, float] = {}
        for n, future in zip(ticket.datums, ticket.handles, strict=True):
            result: types.ForwardBackwardOutput = await settled(future)
            if len(result.loss_fn_outputs) != n:
                raise EngineError(
                    f"forward_backward returned {len(result.loss_fn_outputs)} outputs for "
                    f"{n} datums"
                )
            logprobs.extend(o["logprobs"].tolist() for o in result.loss_fn_outputs)
            for key, value in result.metrics.items():
                # Sums add up across the step's calls; other reductions keep the last.
                summed = metrics.get(key, 0.0) if key.endswith(":sum") else 0.0
                metrics[key] = summed + float(value)
        optim_metrics: dict[str, float] = {}
        if ticket.optim is not None:
            optim = await settled(ticket.optim)
            optim_metrics = {k: float(v) for k, v in (optim.metrics or {}).items()}
        return TrainResult(logprobs, metrics, optim_metrics)

    # -- saving ------------------------------------------------------------------------

    async def save_weights_for_sampler(self, name: str) -> str:
        """Persist the current weights for sampling under ``name``; returns the
        ``tinker://`` path."""

        async def go() -> str:
            future = await self._sdk_save_sampler(self._training, name)
            return str((await settled(future)).path)

        return await self._call(OpKind.SAMPLER_SNAPSHOT, "save_weights_for_sampler", go)

    async def save_state(self, name: str) -> str:
        """Persist weights and optimizer state under ``name``; returns the path.
        ``overwrite``: a retry after an attempt whose answer was lost must not fail on
        the checkpoint that attempt already wrote (names are unique per training
        client otherwise)."""

        async def go() -> str:
            future = await self._sdk_save_state(self._training, name)
            return str((await settled(future)).path)

        return await self._call(OpKind.SAVE_STATE, "save_state", go)

    async def submit_checkpoint(self, step: int, name: str) -> PendingCheckpoint:
        """Reserve ``save_state`` and sampler weights of the weights after everything
        submitted so far (right behind a step's optim_step: the weights after it). Never
        repeated; a failure to submit is an unknown outcome of that step, like a
        snapshot's (its place in the sequence may be taken)."""
        training = self._training

        async def go() -> tuple[Any, Any]:
            state = await self._sdk_save_state(training, name)
            return state, self._sdk_reserve_sampler_save(training, name)

        handles = await self._step_call(step, go, completes=False)
        return PendingCheckpoint(step, handles)

    async def finish_checkpoint(self, pending: PendingCheckpoint) -> tuple[str, str]:
        """The paths of a reserved checkpoint: one attempt under the save_state deadline
        (awaiting again would not save again)."""
        state, sampler = cast(tuple[Any, Any], pending.handle)

        async def paths() -> tuple[str, str]:
            return str((await settled(state)).path), str((await settled(sampler)).path)

        within = self.guard.policy(OpKind.SAVE_STATE).attempt_timeout
        return await self.guard.once(f"the checkpoint of step {pending.step}", paths, within=within)

    async def save_checkpoint(
        self, state_name: str, sampler_name: str, *, once_within: float | None = None
    ) -> tuple[str, str]:
        """``save_state`` and ``save_weights_for_sampler`` of the same weights (nothing
        is trained between them), submitted together so they share one server round;
        returns (state path, sampler path).

        ``once_within`` makes it one bounded attempt of each, no retries: the
        best-effort checkpoint of a run that is stopping (the server may be why)."""
        training = self._training

        async def state_once() -> str:
            future = await self._sdk_save_state(training, state_name)
            return str((await settled(future)).path)

        async def sampler_once() -> str:
            future = await self._sdk_save_sampler(training, sampler_name)
            return str((await settled(future)).path)

        paths: dict[str, str] = {}

        async def run(key: str, fn: Callable[[], Awaitable[str]]) -> None:
            paths[key] = await fn()

        state: Callable[[], Awaitable[str]] = state_once
        sampler: Callable[[], Awaitable[str]] = sampler_once
        if once_within is None:
            state = functools.partial(self.save_state, state_name)
            sampler = functools.partial(self.save_weights_for_sampler, sampler_name)

        async def both() -> None:
            async with anyio.create_task_group() as tg:
                tg.start_soon(run, "state", state)
                tg.start_soon(run, "sampler", sampler)

        try:
            if once_within is None:
                await both()
            else:
                await self.guard.once("the stop checkpoint", both, within=once_within)
        except BaseExceptionGroup as group:
            raise primary_error(group) from None
        return paths["state"], paths["sampler"]

    # -- recovery ----------------------------------------------------------------------

    async def restore(self, state_path: str | None, *, optimizer: bool = True) -> None:
        """Replace the training client by a new one loaded from ``state_path`` (weights
        and optimizer state; ``optimizer=False``: weights only), or, with None, by a
        fresh LoRA client of the run's base model, rank and seed. The old client is
        abandoned: after a step of unknown outcome its weights cannot be trusted. New
        client, new ``seq_id`` sequence."""
        if state_path is None or not optimizer:
            lora, what = self._lora, "create the training client"
            if state_path is not None:
                lora = dataclasses.replace(lora, init_from=state_path, init_with_optimizer=False)
                what = f"load the weights of {state_path}"
            self._training = await self._call(
                OpKind.SESSION, what, lambda: self._sdk_new_training(lora)
            )
        else:
            self._training = await self._call(
                OpKind.SESSION, f"restore {state_path}", lambda: self._sdk_load_training(state_path)
            )

    # -- opening -----------------------------------------------------------------------

    @classmethod
    @contextlib.asynccontextmanager
    async def connect(
        cls,
        config: EngineConfig,
        base_url: str,
        api_key: str | None,
        *,
        local: bool,
        say: Callable[[str], None],
        guard: ServiceGuard,
        restore_from: str | None,
    ) -> AsyncIterator[SdkSession]:
        """Check the server, resolve the settings ``config`` leaves to the server from
        what it recommends (:attr:`config`, which also names the SDK), create the LoRA
        training client (or load ``restore_from``) and its tokenizer; close the SDK's
        session on exit."""
        try:
            async with anyio.create_task_group() as warming:
                # The tokenizer's library takes seconds of client CPU to import: import
                # it while the server answers the setup calls, not after them.
                warming.start_soon(import_tokenizer_library)
                session = await cls._open(
                    config,
                    base_url,
                    api_key,
                    local=local,
                    say=say,
                    guard=guard,
                    restore_from=restore_from,
                )
        except ExceptionGroup as group:
            raise primary_error(group) from None
        failed = True
        try:
            yield session
            failed = False
        finally:
            with anyio.CancelScope(shield=True):
                await session._sdk_close(failed)

    @classmethod
    async def _open(
        cls,
        config: EngineConfig,
        base_url: str,
        api_key: str | None,
        *,
        local: bool,
        say: Callable[[str], None],
        guard: ServiceGuard,
        restore_from: str | None,
    ) -> SdkSession:
        """:meth:`connect`'s setup calls; the SDK's session is closed if one fails."""
        say("Connecting to MinT server...")
        say(f"Endpoint: {base_url}")
        await check_reachable(base_url, api_key, guard, cls.sdk_version)
        local_options = config.training.local_loss_options()
        if local_options and not local:
            await check_local_loss_options(base_url, api_key, guard, local_options)
        # config.json records the SDK and what the server resolved
        profiles = (
            [await read_recommended_profile(base_url, api_key, guard)] if config.unresolved else []
        )
        config = config.resolved(*profiles, sdk=cls.sdk)
        assert config.model.base_model is not None and config.model.lora_rank is not None
        base_model = config.model.base_model
        guard.watch_server(base_url)
        service = await setup_call(
            guard,
            base_url,
            "connect",
            lambda: anyio.to_thread.run_sync(
                cls._sdk_service, base_url, api_key, guard.queue, abandon_on_cancel=True
            ),
        )
        lora = LoraSpec(
            base_model,
            config.model.lora_rank,
            config.model.lora_seed if config.model.lora_seed is not None else config.task.seed,
            config.model.init_from,
            config.model.init_from_optimizer,
            ROLLOUT_CORRECTIONS.get(config.training.rollout_correction),
        )
        info = ServerInfo(base_url, base_model, local, ())
        session = cls(service, None, None, info, guard, lora, config)
        try:
            models = await setup_call(
                guard,
                base_url,
                "read capabilities",
                lambda: session._sdk_supported_models(base_url, api_key),
            )
            supported = tuple(models)
            if restore_from is None:
                try:
                    correction = config.training.rollout_correction
                    training = await setup_call(
                        guard,
                        base_url,
                        "create the training client"
                        + (
                            f" (--rollout-correction {correction})"
                            if lora.rollout_correction
                            else ""
                        ),
                        lambda: session._sdk_new_training(lora),
                    )
                except PreflightError as exc:
                    # The capabilities list the canonical names; a server may accept
                    # others (aliases), so only its refusal counts.
                    if supported and base_model not in supported:
                        raise PreflightError(
                            f"the MinT server at {base_url} does not serve model "
                            f"{base_model!r} (it serves: {', '.join(supported)}); set "
                            "MINT_BASE_MODEL or --base-model"
                        ) from exc
                    raise
            else:
                path = restore_from
                training = await setup_call(
                    guard, base_url, f"restore {path}", lambda: session._sdk_load_training(path)
                )
            tokenizer = await setup_call(
                guard,
                base_url,
                "load the tokenizer",
                lambda: anyio.to_thread.run_sync(training.get_tokenizer, abandon_on_cancel=True),
            )
            say(f"Model: {base_model}, Vocab: {tokenizer.vocab_size:,}\n")
            session._training = training
            session.tokenizer = tokenizer
            session.info = ServerInfo(
                base_url, base_model, local, supported, models.get(base_model)
            )
        except BaseException:
            with anyio.CancelScope(shield=True):
                await session._sdk_close(True)
            raise
        return session
