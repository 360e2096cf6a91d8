"""Opening a session: the reliability layer a run's calls go through, the local server
when the run uses one, and the SDK adapter (:mod:`engine.common.sdks`).

With an API key (and optional base URL) a session talks to that endpoint; with neither
the local server starts in the background and says so (its data dir, where its
checkpoints live, can be put inside the run dir so a new process can resume from
them). The adapter module is imported here, lazily: the engine imports without the
other SDK generation installed.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from engine.common.clock import LOOP_CLOCK, Clock
from engine.common.protocol import LOCAL_PLACEHOLDER_KEY
from engine.common.sdks import SdkName, choose_sdk
from engine.config import EngineConfig
from engine.errors import ConfigError
from engine.redact import register_secret
from engine.session.breaker import CircuitBreaker
from engine.session.retry import RetryCounter, ServiceGuard, retry_policies

if TYPE_CHECKING:
    from engine.session.adapter import SdkSession

__all__ = ["adapter_class", "open_session", "service_guard"]

_ADAPTERS: dict[SdkName, tuple[str, str]] = {
    "mint": ("engine.session.mint", "MintSession"),
    "tinker": ("engine.session.tinker", "TinkerSession"),
}


def adapter_class(sdk: SdkName) -> type[SdkSession]:
    """The session class of ``sdk`` (imports its SDK)."""
    module, name = _ADAPTERS[sdk]
    return cast("type[SdkSession]", getattr(importlib.import_module(module), name))


def service_guard(
    config: EngineConfig, *, log: Any = None, clock: Clock = LOOP_CLOCK
) -> ServiceGuard:
    """The retries, deadlines and breaker of every service call of a run with
    ``config`` (``--retry-attempts``, ``--retry-backoff``, ``--request-timeout``,
    ``--max-consecutive-failures``, ``--unreachable-timeout``), timed by ``clock``."""
    return ServiceGuard(
        policies=retry_policies(
            attempts=config.session.retry_attempts,
            backoff=config.session.retry_backoff,
            request_timeout=config.session.request_timeout,
        ),
        breaker=CircuitBreaker(config.session.max_consecutive_failures, log=log),
        counter=RetryCounter(),
        log=log,
        clock=clock,
        unreachable_after=config.session.unreachable_timeout,
    )


@contextlib.asynccontextmanager
async def open_session(
    config: EngineConfig,
    *,
    guard: ServiceGuard,
    say: Callable[[str], None] = lambda line: None,
    local_data_dir: Path | None = None,
    restore_from: str | None = None,
) -> AsyncIterator[SdkSession]:
    """Connect as ``config`` says (starting the local server when it uses one) through
    the SDK ``config.session.sdk`` picks, check the server, resolve the settings ``config``
    leaves to the server from what it recommends (:attr:`SdkSession.config`), create the
    LoRA training client and load its tokenizer. ``say`` receives the console lines
    (the quickstart's "Connecting to MinT server...", "Endpoint: ...", "Model: ...").

    ``guard`` is the reliability layer every call goes through. ``local_data_dir`` is
    where a local server keeps its checkpoints (default: a temporary dir removed on exit;
    a resumable run passes a dir inside its run dir). ``restore_from`` is a
    ``tinker://`` state to load (weights and optimizer) instead of creating a fresh LoRA
    client: how a run is resumed."""
    session_class = adapter_class(choose_sdk(config.session.sdk))
    if config.uses_local_server:
        from engine.local import ServerConfigError, serve_local
        from engine.local.compute_types import BackendError

        say("No MINT_API_KEY set: starting the local MinT server (engine.local)...")
        async with contextlib.AsyncExitStack() as stack:
            try:
                server = await stack.enter_async_context(
                    serve_local(model_dir=config.session.local_model, data_dir=local_data_dir)
                )
            except (ServerConfigError, BackendError) as exc:
                raise ConfigError(f"cannot start the local server: {exc}") from exc
            say(f"Local server: {server.base_url} serving {server.model_name}")
            # A local server without a key accepts any; the SDK still wants one.
            api_key = server.api_key or LOCAL_PLACEHOLDER_KEY
            session = await stack.enter_async_context(
                session_class.connect(
                    config,
                    server.base_url,
                    api_key,
                    local=True,
                    say=say,
                    guard=guard,
                    restore_from=restore_from,
                )
            )
            yield session
        return
    register_secret(config.session.api_key_value)
    base_url = config.session.base_url or session_class.default_base_url
    async with session_class.connect(
        config,
        base_url,
        config.session.api_key_value,
        local=False,
        say=say,
        guard=guard,
        restore_from=restore_from,
    ) as session:
        yield session
