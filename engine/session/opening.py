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
import functools
import importlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, cast

import anyio

from engine.basemodels.catalogue import PretrainedUnavailable
from engine.common.protocol import LOCAL_PLACEHOLDER_KEY
from engine.common.sdks import SdkName, choose_sdk
from engine.config import EngineConfig
from engine.errors import ConfigError
from engine.redact import register_secret
from engine.session.retry import ServiceGuard

if TYPE_CHECKING:
    from engine.local.launch import RunningServer
    from engine.session.adapter import SdkSession

__all__ = ["SharedLocalServer", "adapter_class", "open_session"]

_ADAPTERS: dict[SdkName, tuple[str, str]] = {
    "mint": ("engine.session.mint", "MintSession"),
    "tinker": ("engine.session.tinker", "TinkerSession"),
}


def adapter_class(sdk: SdkName) -> type[SdkSession]:
    """The session class of ``sdk`` (imports its SDK)."""
    module, name = _ADAPTERS[sdk]
    return cast("type[SdkSession]", getattr(importlib.import_module(module), name))


class SharedLocalServer:
    """One local server for runs in sequence (the stages of :mod:`engine.stages`): the
    first session that needs a local server starts it, in ``data_dir`` or else in the
    data dir that session asks for; later sessions connect to the same server. It runs
    until the ``async with`` of :meth:`kept` ends."""

    def __init__(self, data_dir: Path | None = None) -> None:
        self._data_dir = data_dir
        self._stack: contextlib.AsyncExitStack | None = None
        self._server: RunningServer | None = None
        self._model_dir: Path | None = None

    @property
    def started(self) -> bool:
        return self._server is not None

    @property
    def data_dir(self) -> Path | None:
        """Where the server keeps its checkpoints (None: not started, none given)."""
        return self._server.data_dir if self._server is not None else self._data_dir

    @contextlib.asynccontextmanager
    async def kept(self) -> AsyncIterator[SharedLocalServer]:
        """The block the server lives in (it starts inside, on first use)."""
        async with contextlib.AsyncExitStack() as stack:
            self._stack = stack
            try:
                yield self
            finally:
                self._stack, self._server = None, None

    async def serve(self, model_dir: Path | None, data_dir: Path | None) -> RunningServer:
        """The running server, started now if none is (serving ``model_dir``)."""
        if self._stack is None:
            raise RuntimeError("SharedLocalServer.serve() outside 'async with shared.kept()'")
        if self._server is None:
            self._server = await _start_local_server(
                self._stack, model_dir, self._data_dir or data_dir
            )
            self._model_dir = model_dir
        elif model_dir != self._model_dir:
            raise ConfigError(
                f"the local server of this command serves {self._model_dir or 'the packaged model'}"
                f", not {model_dir}: every stage trains the same model"
            )
        return self._server


async def _start_local_server(
    stack: contextlib.AsyncExitStack, model_dir: Path | None, data_dir: Path | None
) -> RunningServer:
    """A local server on ``model_dir``, living as long as ``stack``. Its settings are
    resolved on a worker thread: a pretrained model is converted there on first use
    (a download and a minute of dequantizing), never on the event loop."""
    from engine.local import ServerConfig, serve_local

    config = await anyio.to_thread.run_sync(
        functools.partial(ServerConfig, model_dir=model_dir, data_dir=data_dir)
    )
    return await stack.enter_async_context(serve_local(config))


@contextlib.asynccontextmanager
async def open_session(
    config: EngineConfig,
    *,
    guard: ServiceGuard,
    say: Callable[[str], None] = lambda line: None,
    local_data_dir: Path | None = None,
    restore_from: str | None = None,
    local_server: SharedLocalServer | None = None,
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
    client: how a run is resumed. ``local_server``: a local server kept for runs in
    sequence, used (and started on first use) instead of one of this session's own."""
    session_class = adapter_class(choose_sdk(config.session.sdk))
    if config.uses_local_server:
        from engine.local import ServerConfigError
        from engine.local.compute.backend_types import BackendError

        kept = local_server is not None and local_server.started
        if not kept:
            say("No MINT_API_KEY set: starting the local MinT server (engine.local)...")
        async with contextlib.AsyncExitStack() as stack:
            model_dir = config.session.local_model
            try:
                if local_server is not None:
                    server = await local_server.serve(model_dir, local_data_dir)
                else:
                    server = await _start_local_server(stack, model_dir, local_data_dir)
            except (ServerConfigError, PretrainedUnavailable, BackendError) as exc:
                raise ConfigError(f"cannot start the local server: {exc}") from exc
            again = " (the same server)" if kept else ""
            say(f"Local server: {server.base_url} serving {server.model_name}{again}")
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
