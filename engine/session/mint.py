"""The MinT session: the ONE module that talks to the ``mint`` SDK.

Why one module: every SDK call the engine makes passes through :meth:`MintSession._call`,
the single seam where the reliability layer (``engine.session.retry``,
``engine.supervision.watchdog``) wraps retries, deadlines and circuit breaking. The rest
of the engine sees typed results (:class:`SampleResult`, :class:`TrainResult`,
:class:`SamplerHandle`) and never an SDK future.

Two SDK facts shape this module (tinker 0.22; docs/architecture.md, "Wire facts"):

* The ``_async`` training calls need two awaits: ``fut = await tc.forward_backward_async
  (...)`` submits (and fixes the request's place in the model's sequence), ``await fut``
  waits for the result. A step's ``forward_backward`` AND ``optim_step`` are submitted
  (:meth:`MintSession.submit_forward_backward`, :meth:`MintSession.submit_optim_step`)
  before either is awaited (:meth:`MintSession.finish_train_step`): one server round
  instead of three.
* Some SDK calls block the calling thread even in their ``_async`` form (the
  ServiceClient constructor, ``save_weights_and_get_sampling_client[_async]``,
  ``get_tokenizer``); they run in a worker thread so the event loop keeps serving the
  other pipeline stages.

Opening a session (:func:`open_session`): with an API key (and optional base URL) it
talks to that endpoint; with neither it starts the local server in the background and
says so (its data dir, where its checkpoints live, can be put inside the run dir so a
new process can resume from them). A preflight turns an unreachable server, a rejected
key and an unknown model into one sentence each (:class:`PreflightError`, exit code 1).

Reliability (see :mod:`engine.session.retry`): every call goes through a
:class:`~engine.session.retry.ServiceGuard` -- idempotent kinds (setup, sampling, sampler
snapshots, save_state) are retried on transient errors under a per-attempt deadline;
train-step calls are bounded by a deadline and never repeated: a failure after
submission raises :class:`~engine.errors.StepOutcomeUnknown` and the engine restores a
checkpoint with :meth:`MintSession.restore`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

import anyio
import httpx
import mint
import tinker
from tinker import types
from tinker.lib.retry_handler import RetryConfig

from engine.common.clock import LOOP_CLOCK, Clock
from engine.config import HOSTED_BASE_URL, HOSTED_PROFILE, EngineConfig, Profile, server_profile
from engine.errors import ConfigError, EngineError, ServiceError, classify, os_reason, primary_error
from engine.loop.rl import Completion, Datum
from engine.redact import register_secret
from engine.session.api import (
    LossSpec,
    PendingSnapshot,
    SampleResult,
    SamplerHandle,
    SamplingSettings,
    ServerInfo,
    StepTicket,
    TrainResult,
)
from engine.session.retry import (
    SDK_MAX_RETRIES,
    OpKind,
    RetryCounter,
    RetryPolicy,
    ServiceGuard,
    retry_policies,
    tally_retries,
)
from engine.supervision.watchdog import CircuitBreaker

__all__ = [
    "MintSession",
    "PreflightError",
    "local_server_profile",
    "open_session",
    "read_server_profile",
    "reserve_sampler_snapshot",
    "sdk_sampling_retry_config",
    "service_guard",
    "snapshot_name",
    "to_sdk_datum",
]

T = TypeVar("T")

_PREFLIGHT_TIMEOUT = httpx.Timeout(30.0, connect=10.0)
_LOCAL_PLACEHOLDER_KEY = "tml-engine-local"


class PreflightError(EngineError):
    """The server cannot be used for this run (unreachable, key rejected, no such model)."""


SNAPSHOT_TTL_S = 24 * 3600
"""Time to live of the per-version sampler weights on the server: a version is sampled
from for at most K+1 steps; the TTL keeps a long run from piling them up."""


@dataclass(frozen=True)
class _LoraSpec:
    base_model: str
    rank: int
    seed: int | None
    init_from: str | None = None  # saved weights the fresh client starts from
    init_with_optimizer: bool = False


class MintSession:
    """A connected training session: one training client and its tokenizer."""

    def __init__(
        self,
        service: tinker.ServiceClient,
        training: tinker.TrainingClient,
        tokenizer: Any,
        info: ServerInfo,
        guard: ServiceGuard,
        lora: _LoraSpec,
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
    def model_id(self) -> str | None:
        """The server's id of the current training client (changes on restore)."""
        return self._training.model_id

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
        settings: SamplingSettings,
    ) -> SampleResult:
        """``num_samples`` responses to one prompt from ``sampler``."""
        client = cast(tinker.SamplingClient, sampler.client)
        prompt = types.ModelInput.from_ints(tokens=list(prompt_tokens))
        params = types.SamplingParams(
            max_tokens=settings.max_tokens,
            temperature=settings.temperature,
            seed=settings.seed,
            stop=list(settings.stop_strings) or list(settings.stop_token_ids) or None,
        )

        async def go() -> types.SampleResponse:
            return await client.sample_async(
                prompt=prompt, num_samples=num_samples, sampling_params=params
            )

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

    async def submit_snapshot(self, version: int) -> PendingSnapshot:
        """Reserve, in the training client's sequence, a snapshot of the weights after
        everything submitted so far: submitted right behind a step's optim_step, it
        snapshots the weights after that step. Never repeated (a new submission would
        snapshot later weights); a failure is an unknown step outcome."""
        training = self._training

        async def go() -> Any:
            return reserve_sampler_snapshot(training, snapshot_name(version))

        future = await self._step_call(version, go, completes=False)
        return PendingSnapshot(version, future)

    async def finish_snapshot(self, pending: PendingSnapshot) -> SamplerHandle:
        """Await a reserved snapshot and open a sampling client on it (that part is
        idempotent and retried)."""
        future = pending.handle

        async def saved() -> str:
            return str((await settled(future)).path)

        path = await self._step_call(pending.version, saved, completes=False)
        return await self.open_sampler(pending.version, path)

    async def open_sampler(self, version: int, sampler_path: str) -> SamplerHandle:
        """A sampling client on saved sampler weights (a checkpoint's, or a finished
        snapshot's), as policy ``version``; retried."""
        client = await self._call(
            OpKind.SAMPLER_SNAPSHOT,
            f"open sampler {sampler_path}",
            lambda: self._sampling_client(sampler_path),
        )
        return SamplerHandle(version, client)

    async def _sampling_client(self, path: str) -> tinker.SamplingClient:
        return await self._service.create_sampling_client_async(
            model_path=path, retry_config=self._sampling_retry_config()
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
        batch = [to_sdk_datum(d) for d in datums]

        async def go() -> Any:
            return await training.forward_backward_async(
                batch,
                loss.name,  # type: ignore[arg-type]  # validated against LOSSES by the config
                loss.config,
            )

        handle = await self._step_call(ticket.step, go, completes=False)
        ticket.handles.append(handle)
        ticket.datums.append(len(batch))

    async def submit_optim_step(self, ticket: StepTicket, learning_rate: float) -> None:
        """Submit the Adam step of ``ticket``'s step (the quickstart sets only the
        learning rate)."""
        training = self._training

        async def go() -> Any:
            return await training.optim_step_async(types.AdamParams(learning_rate=learning_rate))

        ticket.optim = await self._step_call(ticket.step, go, completes=False)

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
            future = await self._training.save_weights_for_sampler_async(name)
            return str((await settled(future)).path)

        return await self._call(OpKind.SAMPLER_SNAPSHOT, "save_weights_for_sampler", go)

    async def save_state(self, name: str) -> str:
        """Persist weights and optimizer state under ``name``; returns the path.
        ``overwrite``: a retry after an attempt whose answer was lost must not fail on
        the checkpoint that attempt already wrote (names are unique per training
        client otherwise)."""

        async def go() -> str:
            future = await self._training.save_state_async(name, overwrite=True)
            return str((await settled(future)).path)

        return await self._call(OpKind.SAVE_STATE, "save_state", go)

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
            future = await training.save_state_async(state_name, overwrite=True)
            return str((await settled(future)).path)

        async def sampler_once() -> str:
            future = await training.save_weights_for_sampler_async(sampler_name)
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

    async def restore(self, state_path: str | None) -> None:
        """Replace the training client by a new one loaded from ``state_path`` (weights
        and optimizer state), or, with None, by a fresh LoRA client of the run's base
        model, rank and seed. The old client is abandoned: after a step of unknown
        outcome its weights cannot be trusted. New client, new ``seq_id`` sequence."""
        service, lora = self._service, self._lora

        async def load() -> tinker.TrainingClient:
            assert state_path is not None
            return await service.create_training_client_from_state_with_optimizer_async(state_path)

        async def fresh() -> tinker.TrainingClient:
            return await _create_lora(service, lora)

        if state_path is None:
            self._training = await self._call(OpKind.SESSION, "create the training client", fresh)
        else:
            self._training = await self._call(OpKind.SESSION, f"restore {state_path}", load)


# ----------------------------------------------------------------------------- opening


@contextlib.asynccontextmanager
async def open_session(
    config: EngineConfig,
    *,
    guard: ServiceGuard,
    say: Callable[[str], None] = lambda line: None,
    local_data_dir: Path | None = None,
    restore_from: str | None = None,
) -> AsyncIterator[MintSession]:
    """Connect as ``config`` says (starting the local server when it uses one), check
    the server, resolve the settings ``config`` leaves to the server from what it
    recommends (:attr:`MintSession.config`), create the LoRA training client and load its
    tokenizer. ``say`` receives the console lines
    (the quickstart's "Connecting to MinT server...", "Endpoint: ...", "Model: ...").

    ``guard`` is the reliability layer every call goes through. ``local_data_dir`` is
    where a local server keeps its checkpoints (default: a temporary dir removed on exit;
    a resumable run passes a dir inside its run dir). ``restore_from`` is a
    ``tinker://`` state to load (weights and optimizer) instead of creating a fresh LoRA
    client: how a run is resumed."""
    if config.uses_local_server:
        from engine.local import ConfigError as LocalConfigError
        from engine.local import serve_local
        from engine.local.backend import BackendError

        say("No MINT_API_KEY set: starting the local MinT server (engine.local)...")
        async with contextlib.AsyncExitStack() as stack:
            try:
                server = await stack.enter_async_context(
                    serve_local(model_dir=config.local_model, data_dir=local_data_dir)
                )
            except (LocalConfigError, BackendError) as exc:
                raise ConfigError(f"cannot start the local server: {exc}") from exc
            say(f"Local server: {server.base_url} serving {server.model_name}")
            # A local server without a key accepts any; the SDK still wants one.
            api_key = server.api_key or _LOCAL_PLACEHOLDER_KEY
            session = await stack.enter_async_context(
                _connect(config, server.base_url, api_key, True, say, guard, restore_from)
            )
            yield session
        return
    register_secret(config.api_key)
    base_url = config.base_url or HOSTED_BASE_URL
    async with _connect(
        config, base_url, config.api_key, False, say, guard, restore_from
    ) as session:
        yield session


@contextlib.asynccontextmanager
async def _connect(
    config: EngineConfig,
    base_url: str,
    api_key: str | None,
    local: bool,
    say: Callable[[str], None],
    guard: ServiceGuard,
    restore_from: str | None,
) -> AsyncIterator[MintSession]:
    say("Connecting to MinT server...")
    say(f"Endpoint: {base_url}")
    await _check_reachable(base_url, api_key, guard)
    if config.unresolved:
        config = config.resolved(await _recommended_profile(base_url, api_key, guard))
    assert config.base_model is not None and config.lora_rank is not None
    base_model = config.base_model
    guard.watch_server(base_url)
    service = await _sdk(
        guard,
        base_url,
        "connect",
        lambda: anyio.to_thread.run_sync(
            _make_service_client, base_url, api_key, abandon_on_cancel=True
        ),
    )
    try:
        caps = await _sdk(
            guard, base_url, "read capabilities", service.get_server_capabilities_async
        )
        supported = tuple(m.model_name for m in caps.supported_models if m.model_name)
        lora = _LoraSpec(
            base_model,
            config.lora_rank,
            config.lora_seed,
            config.init_from,
            config.init_from_optimizer,
        )
        if restore_from is None:
            try:
                training = await _sdk(
                    guard,
                    base_url,
                    "create the training client",
                    lambda: _create_lora(service, lora),
                )
            except PreflightError as exc:
                # The capabilities list the canonical names; a server may accept others
                # (aliases), so only its refusal counts.
                if supported and base_model not in supported:
                    raise PreflightError(
                        f"the MinT server at {base_url} does not serve model {base_model!r} "
                        f"(it serves: {', '.join(supported)}); set MINT_BASE_MODEL or "
                        "--base-model"
                    ) from exc
                raise
        else:
            path = restore_from
            training = await _sdk(
                guard,
                base_url,
                f"restore {path}",
                lambda: service.create_training_client_from_state_with_optimizer_async(path),
            )
        tokenizer = await _sdk(
            guard,
            base_url,
            "load the tokenizer",
            lambda: anyio.to_thread.run_sync(training.get_tokenizer, abandon_on_cancel=True),
        )
        say(f"Model: {base_model}, Vocab: {tokenizer.vocab_size:,}\n")
        context = next(
            (m.max_context_length for m in caps.supported_models if m.model_name == base_model),
            None,
        )
        info = ServerInfo(base_url, base_model, local, supported, context)
        yield MintSession(service, training, tokenizer, info, guard, lora, config)
    finally:
        # Stops the SDK's session heartbeat (it would outlive a local server).
        service.holder.close()


async def _create_lora(service: tinker.ServiceClient, lora: _LoraSpec) -> tinker.TrainingClient:
    """A new training client: a fresh LoRA, or one loaded from ``--init-from`` (its
    weights, and with ``--init-from-optimizer`` its optimizer state)."""
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


def to_sdk_datum(datum: Datum) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens=datum.model_input.tolist()),
        loss_fn_inputs={
            key: types.TensorData.from_numpy(value) for key, value in datum.loss_fn_inputs.items()
        },
    )


def snapshot_name(version: int) -> str:
    """The sampler weights' name of policy ``version``: the snapshot lives at
    ``tinker://<model id>/sampler_weights/<name>``."""
    return f"sampler-v{version}"


def reserve_sampler_snapshot(training: tinker.TrainingClient, name: str) -> Any:
    """``save_weights_for_sampler(name)`` with its place in the model's sequence taken
    NOW; returns the SDK future of its response.

    Why not the public method: tinker 0.22's ``save_weights_for_sampler[_async]`` takes
    its ``seq_id`` only once the SDK's own event loop runs the request, so a
    ``forward_backward`` called right after it (which, like ``optim_step`` and
    ``save_state``, takes its ``seq_id`` at once) can overtake it, and the snapshot would
    hold a later step's weights. The method the public one wraps takes it at once."""
    return training._save_weights_for_sampler_impl(name, SNAPSHOT_TTL_S)


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


def _make_service_client(base_url: str, api_key: str | None) -> tinker.ServiceClient:
    return mint.ServiceClient(api_key=api_key, base_url=base_url, max_retries=SDK_MAX_RETRIES)


async def _sdk(guard: ServiceGuard, base_url: str, what: str, fn: Callable[[], Awaitable[T]]) -> T:
    """Await a setup call under the SESSION retry policy; a failure that outlasts it
    becomes one PreflightError sentence."""
    try:
        return await guard.call(OpKind.SESSION, what, fn)
    except ServiceError as exc:
        cause = exc.__cause__ if exc.__cause__ is not None else exc
        text = str(cause)
        if "api_key" in text:
            message = f"the API key is not usable with {base_url}: {text.splitlines()[0]}"
        else:
            message = f"could not {what} at {base_url}: {classify(cause).message}"
        raise PreflightError(message) from exc


async def _check_reachable(base_url: str, api_key: str | None, guard: ServiceGuard) -> None:
    """One plain HTTP request before the SDK takes over: the SDK retries a dead
    endpoint for minutes before saying anything, and hides a rejected key behind a
    generic error."""
    response = await _preflight_request(
        base_url, api_key, guard, "POST", "client/config", {"sdk_version": tinker.__version__}
    )
    if response.status_code in (401, 403):
        raise PreflightError(
            f"the MinT server at {base_url} rejected the API key (HTTP "
            f"{response.status_code}); check MINT_API_KEY"
        )
    if response.status_code >= 400:
        raise PreflightError(
            f"the MinT server at {base_url} answered HTTP {response.status_code} to its "
            "first request; is MINT_BASE_URL a MinT server?"
        )


def service_guard(
    config: EngineConfig, *, log: Any = None, clock: Clock = LOOP_CLOCK
) -> ServiceGuard:
    """The retries, deadlines and breaker of every service call of a run with
    ``config`` (``--retry-attempts``, ``--retry-backoff``, ``--request-timeout``,
    ``--max-consecutive-failures``, ``--unreachable-timeout``), timed by ``clock``."""
    return ServiceGuard(
        policies=retry_policies(
            attempts=config.retry_attempts,
            backoff=config.retry_backoff,
            request_timeout=config.request_timeout,
        ),
        breaker=CircuitBreaker(config.max_consecutive_failures, log=log),
        counter=RetryCounter(),
        log=log,
        clock=clock,
        unreachable_after=config.unreachable_timeout,
    )


async def read_server_profile(
    base_url: str, api_key: str | None, guard: ServiceGuard | None = None
) -> Profile:
    """The defaults the server at ``base_url`` implies (:func:`engine.config.server_profile`
    of its ``get_server_capabilities`` answer, read as plain JSON: the SDK drops the
    recommended settings). Fails like the preflight (:class:`PreflightError`); calls
    are guarded as in a run with the default settings unless ``guard`` is given."""
    guard = guard or service_guard(EngineConfig())
    await _check_reachable(base_url, api_key, guard)
    return await _recommended_profile(base_url, api_key, guard)


async def _recommended_profile(base_url: str, api_key: str | None, guard: ServiceGuard) -> Profile:
    response = await _preflight_request(
        base_url, api_key, guard, "GET", "get_server_capabilities", None
    )
    if response.status_code in (401, 403):
        # The key passed client/config: this server wants the SDK's session token here
        # (hosted MinT in JWT mode). The local server takes the plain key everywhere,
        # so this is not one that recommends settings.
        return HOSTED_PROFILE
    if response.status_code >= 400:
        raise PreflightError(
            f"the MinT server at {base_url} answered HTTP {response.status_code} to "
            "get_server_capabilities; is MINT_BASE_URL a MinT server?"
        )
    try:
        return server_profile(response.json(), f"the MinT server at {base_url}")
    except ValueError as exc:
        raise PreflightError(str(exc)) from exc


def local_server_profile(model_dir: Path | None) -> Profile:
    """The defaults the local server would report for ``model_dir`` (None: the packaged
    model), read before the engine starts it: the same entry its
    ``get_server_capabilities`` answer carries."""
    from engine.local.pretrained import resolve_model
    from engine.local.recommended import model_entry

    try:
        entry = model_entry(resolve_model(model_dir))
        return server_profile({"supported_models": [entry]}, "the local server")
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


async def _preflight_request(
    base_url: str,
    api_key: str | None,
    guard: ServiceGuard,
    method: str,
    endpoint: str,
    body: object,
) -> httpx.Response:
    """One plain request to ``/api/v1/<endpoint>``. A busy server (408/429/5xx) or a
    connection dropped mid-answer is retried under the SESSION policy, honouring
    Retry-After; no server to connect to or no answer in time fails at once with one
    sentence; other answers are the caller's to judge."""
    url = base_url.rstrip("/") + "/api/v1/" + endpoint
    headers = {"X-API-Key": api_key} if api_key else {}

    async def once() -> httpx.Response:
        try:
            async with httpx.AsyncClient(timeout=_PREFLIGHT_TIMEOUT) as client:
                response = await client.request(method, url, json=body, headers=headers)
        except httpx.TimeoutException as exc:
            raise PreflightError(
                f"the MinT server at {base_url} did not answer in time; check MINT_BASE_URL "
                "and the server's status"
            ) from exc
        except (httpx.ConnectError, httpx.UnsupportedProtocol, ValueError) as exc:
            raise PreflightError(
                f"cannot reach the MinT server at {base_url} ({os_reason(exc)}); check "
                "MINT_BASE_URL, the network and the server's status"
            ) from exc
        # Other transport errors (a connection dropped mid-answer) are transient.
        if response.status_code in (408, 429) or response.status_code >= 500:
            # Transient for the retry layer, which reads the status and Retry-After.
            raise tinker.APIStatusError(
                f"HTTP {response.status_code}", response=response, body=_body(response)
            )
        return response

    try:
        return await guard.call(OpKind.SESSION, "reach the server", once)
    except ServiceError as exc:
        cause = exc.__cause__ if exc.__cause__ is not None else exc
        raise PreflightError(
            f"the MinT server at {base_url} is not ready: {classify(cause).message}"
        ) from exc


def _body(response: httpx.Response) -> object:
    try:
        return response.json()
    except ValueError:
        return response.text
