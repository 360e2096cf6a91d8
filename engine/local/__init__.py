"""engine.local: a MinT/Tinker-compatible server on a local model, for the unmodified
``mint`` SDK (``mint.ServiceClient(base_url=server.base_url, api_key=...)``).

Start it with ``python -m engine.local`` or from Python::

    async with serve_local(ServerConfig(...)) as server: ...  # in this event loop
    with LocalServer(config=ServerConfig(...)) as server: ...  # background thread (sync code)
    spawned = spawn_local_server(data_dir=...)  # child process (kill -9 / restart tests)

``ServerConfig`` declares every setting once (``engine.local.config``); ``faults=`` and
``latency=`` take the ``--faults`` / ``--latency`` grammars documented in
``engine.local.faults`` and ``engine.local.latency``.

The launchers import torch; they are loaded on first use so that importing this package
(e.g. for ``python -m engine.local --help``) stays fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from engine.basemodels.catalogue import DEFAULT_MODEL_DIR
from engine.local.config import (
    Limits,
    ServerConfig,
    ServerConfigError,
)
from engine.local.faults import FaultSpec, FaultSpecError
from engine.local.latency import LatencyProfile, LatencyProfileError
from engine.local.stats import OpCycle, StatsSnapshot

if TYPE_CHECKING:
    from engine.local.launch import (
        LocalServer,
        RunningServer,
        SpawnedServer,
        serve_local,
        spawn_local_server,
    )

_LAZY = {"LocalServer", "RunningServer", "SpawnedServer", "serve_local", "spawn_local_server"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module("engine.local.launch"), name)
    raise AttributeError(f"module 'engine.local' has no attribute {name!r}")


__all__ = [
    "DEFAULT_MODEL_DIR",
    "FaultSpec",
    "FaultSpecError",
    "LatencyProfile",
    "LatencyProfileError",
    "Limits",
    "LocalServer",
    "OpCycle",
    "RunningServer",
    "ServerConfig",
    "ServerConfigError",
    "SpawnedServer",
    "StatsSnapshot",
    "serve_local",
    "spawn_local_server",
]
