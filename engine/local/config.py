"""Settings of one local server instance, validated once at construction.

Every knob lives here so the CLI, the in-process helpers and the tests share one set of
defaults and one set of error messages.
"""

from __future__ import annotations

import ipaddress
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from engine.local.faults import FaultSpec
from engine.local.latency import LatencyProfile
from engine.local.pretrained import PACKAGED, resolve_model
from engine.local.profiles import SERVICES, ServiceProfile, profile_of

DEFAULT_MODEL_DIR = PACKAGED["tiny-arith"]
"""The small model packaged with the engine (created by ``scripts.make_model``)."""

AGENT_MODEL_DIR = PACKAGED["tiny-agent-2"]
"""The packaged model that also knows the shipped environments' formats (created by
``scripts.make_model --environments``); those tasks ask for it (``local_model``)."""

CODE_MODEL_DIR = PACKAGED["tiny-code"]
"""The packaged model that writes one-line Python functions from examples (created by
``scripts.make_model --code``; RL on ``examples/tiny_code.jsonl``, docs/sandbox.md)."""

READY_PREFIX = "engine.local: serving "
"""The line ``python -m engine.local`` prints on stdout once it accepts requests."""

LOOPBACK_NAMES = frozenset({"localhost"})
SAMPLING_LOGPROBS = ("tempered", "untempered")
"""What a sampled token's reported logprob is taken under (``ServerConfig.sampling_logprobs``)."""
DEFAULT_DATA_DIR_TEXT = (
    "$XDG_DATA_HOME/engine/local-server, else ~/.local/share/engine/local-server"
)


def default_data_dir() -> Path:
    """Where ``python -m engine.local`` keeps runs and checkpoints unless told otherwise
    (``DEFAULT_DATA_DIR_TEXT``; an XDG_DATA_HOME that is not absolute is ignored, as the
    XDG spec says)."""
    xdg = os.environ.get("XDG_DATA_HOME", "")
    root = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".local" / "share"
    return root / "engine" / "local-server"


class ServerConfigError(ValueError):
    """A setting is out of range or inconsistent; the message says which and why."""


@dataclass(frozen=True)
class Limits:
    """Request-size bounds. They keep one bad or hostile request from exhausting memory;
    each violation is answered with a message naming the limit."""

    max_body_bytes: int = 32 * 1024 * 1024
    """Largest accepted request body (the client chunks forward_backward at ~5 MB)."""
    max_datums: int = 1024
    """Datums per forward / forward_backward request (the client chunks at 1024)."""
    max_request_tokens: int = 131072
    """model_input tokens per forward / forward_backward request, summed over its datums:
    bounds how long one request holds the compute thread. The client's ~5 MB chunks of
    RL datums (3+ loss inputs) stay under ~125k tokens."""
    max_seq_gap: int = 16
    """How far a model's new seq_id may run past the first missing one; this also bounds
    the operations that wait for a missing seq_id."""
    max_num_samples: int = 128
    """num_samples per asample request."""
    max_topk_prompt_logprobs: int = 20
    max_lora_rank: int = 256
    max_pending_futures: int = 4096
    """Unfinished futures across the server; beyond it submissions get 429."""
    max_pending_per_model: int = 256
    """Queued training operations per model; beyond it submissions get 429."""
    max_retained_results: int = 8192
    """Finished futures kept for re-polls; the oldest are dropped first (then 410)."""
    max_sample_batch: int = 64
    """asample requests merged into one backend.sample call."""
    dedupe_window: int = 4096
    """Per-model (seq_id -> request) entries remembered for duplicate detection."""
    max_models: int = 64
    """Training clients held in memory; beyond it a new one is refused (429): a live
    client is never evicted for another (clients are released when their session stops
    sending heartbeats)."""
    max_named_samplers: int = 64
    """Checkpoint snapshots (sampling clients from a model_path, and snapshots training
    clients save with save_weights_for_sampler) held in memory; beyond it the least
    recently used one no live client may still sample from (never a held training
    client's newest, or one being sampled) is evicted, with the sampling sessions that use
    it; when none is, a new snapshot is refused (429)."""
    max_adapter_bytes: int = 4 << 30
    """Memory for training clients (LoRA weights, gradients, Adam moments) and sampler
    snapshots together; beyond it checkpoint snapshots, then in-memory snapshots, then
    idle training clients are evicted, least recently used first."""
    max_upload_bytes: int = 1 << 30
    """Largest checkpoint archive accepted by /api/v1/checkpoints/upload (and the most
    file contents it may unpack to); JSON bodies have ``max_body_bytes`` instead."""
    max_concurrent_uploads: int = 4
    """Uploads received at a time; beyond it an upload gets 503 with Retry-After."""
    max_ephemeral_samplers: int = 64
    """Snapshots from save_weights_and_get_sampling_client kept in memory, bounded as
    ``max_named_samplers`` is (sampling from a released one fails with a clear error).
    Named snapshots (save_weights_for_sampler) are not counted: they live on disk."""
    max_queued_samples: int = 1024
    """Sample requests waiting for a sampling slot (``--sampling-slots``); beyond it a new
    one is refused (429)."""
    max_stability_records: int = 65536
    """Sampled sequences kept for ``stable_reinforce`` (``record_stability_info``); beyond
    it the least recently used are forgotten first (training on one then fails clearly)."""

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ServerConfigError(f"limit {name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class ServerConfig:
    """Everything a server instance needs; see ``serve_local`` for the user-facing docs."""

    model_dir: Path = DEFAULT_MODEL_DIR
    model_name: str | None = None
    """Name clients pass as base_model; None lets the backend choose (from the model dir)."""
    model_aliases: tuple[str, ...] = ()
    """Extra base_model names accepted for the served model (e.g. "Qwen/Qwen3-0.6B"), so
    an unmodified script with a hard-coded hosted model name runs against it."""
    api_key: str | None = None
    data_dir: Path | None = None
    """None: a fresh temporary directory, removed when the server stops (the library
    default; ``python -m engine.local`` defaults to ``default_data_dir()``)."""
    host: str = "127.0.0.1"
    port: int = 0
    faults: FaultSpec = field(default_factory=FaultSpec)
    latency: LatencyProfile | None = None
    long_poll_s: float = 20.0
    """How long retrieve_future holds a poll before answering try_again."""
    seq_gap_timeout_s: float = 300.0
    """How long an operation waits for a missing earlier seq_id of its model before the
    gap is declared abandoned (the client gives up submitting after 5 minutes)."""
    header_timeout_s: float = 10.0
    """How long a connection may take to send a request's headers (idle new connections
    and slowly trickled headers are closed after it)."""
    body_timeout_s: float = 60.0
    """How long a request may take to send its body once its headers arrived (408)."""
    jwt_ttl_s: int = 24 * 3600
    sample_batch_window_s: float = 0.0
    """Extra time the sampler waits for more asample requests before a batch runs."""
    session_timeout_s: float = 600.0
    """A session without a heartbeat for this long loses its training clients and
    sampling sessions (the SDK heartbeats every 10 s)."""
    housekeeping_interval_s: float = 10.0
    """How often silent sessions, expired checkpoints and archive URLs are swept."""
    sampling_logprobs: str = "tempered"
    """Each sampled token's logprob under the distribution it was drawn from ("tempered",
    as hosted Tinker reports it) or under the untempered model ("untempered")."""
    num_threads: int | None = None
    """torch intra-op threads of the compute thread; None: one for small models, torch's
    default less one core otherwise (see ``backend._auto_threads``)."""
    limits: Limits = field(default_factory=Limits)
    service: str = "local"
    """The hosted service this server behaves as (``engine.local.profiles``)."""
    sampling_slots: int | None = None
    """Sample requests run at a time, the rest queue (``engine.local.sampling_gate``);
    0: no limit; None: the service's default."""
    rate_limit: float | None = None
    """Requests per second per credential (``engine.local.rate_limit``); None: no limit."""

    @property
    def profile(self) -> ServiceProfile:
        return profile_of(self.service)

    @property
    def slots(self) -> int | None:
        """The sampling slots in force (None: no limit)."""
        if self.sampling_slots is None:
            return self.profile.sampling_slots
        return self.sampling_slots or None

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ServerConfigError(f"port must be an integer in 0..65535, got {self.port!r}")
        if self.api_key is not None and not self.api_key.strip():
            raise ServerConfigError("api_key must not be empty (omit it to disable authentication)")
        if not is_loopback_host(self.host) and self.api_key is None:
            raise ServerConfigError(
                f"refusing to bind non-loopback host {self.host!r} without an API key "
                "(pass --api-key, or bind 127.0.0.1)"
            )
        for name in (
            "long_poll_s",
            "seq_gap_timeout_s",
            "header_timeout_s",
            "body_timeout_s",
            "session_timeout_s",
            "housekeeping_interval_s",
        ):
            value = getattr(self, name)
            if not value > 0:
                raise ServerConfigError(f"{name} must be > 0, got {value!r}")
        if self.sampling_logprobs not in SAMPLING_LOGPROBS:
            raise ServerConfigError(
                f"sampling_logprobs must be one of {', '.join(SAMPLING_LOGPROBS)}, "
                f"got {self.sampling_logprobs!r}"
            )
        if self.service not in SERVICES:
            raise ServerConfigError(
                f"service must be one of {', '.join(SERVICES)}, got {self.service!r}"
            )
        if self.sampling_slots is not None and not 0 <= self.sampling_slots <= 4096:
            raise ServerConfigError(
                f"sampling_slots must be in 0..4096 (0: no limit), got {self.sampling_slots!r}"
            )
        if self.rate_limit is not None and not (
            math.isfinite(self.rate_limit) and self.rate_limit > 0
        ):
            raise ServerConfigError(
                f"rate_limit must be > 0 requests per second, got {self.rate_limit!r}"
            )
        if self.num_threads is not None and not 1 <= self.num_threads <= 1024:
            raise ServerConfigError(f"num_threads must be in 1..1024, got {self.num_threads!r}")
        if self.sample_batch_window_s < 0:
            raise ServerConfigError(
                f"sample_batch_window_s must be >= 0, got {self.sample_batch_window_s!r}"
            )
        if self.jwt_ttl_s < 600:
            raise ServerConfigError(
                f"jwt_ttl_s must be >= 600 (the client refreshes 5 min early), got {self.jwt_ttl_s}"
            )


def is_loopback_host(host: str) -> bool:
    """True for names/addresses that only this machine can reach."""
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def make_config(
    model_dir: str | Path | None = None,
    *,
    api_key: str | None = None,
    data_dir: str | Path | None = None,
    host: str = ServerConfig.host,
    port: int = ServerConfig.port,
    faults: str | FaultSpec | None = None,
    latency: str | LatencyProfile | None = None,
    model_name: str | None = None,
    model_aliases: Sequence[str] = (),
    long_poll_s: float = ServerConfig.long_poll_s,
    seq_gap_timeout_s: float = ServerConfig.seq_gap_timeout_s,
    header_timeout_s: float = ServerConfig.header_timeout_s,
    body_timeout_s: float = ServerConfig.body_timeout_s,
    session_timeout_s: float = ServerConfig.session_timeout_s,
    sampling_logprobs: str = ServerConfig.sampling_logprobs,
    num_threads: int | None = None,
    limits: Limits | None = None,
    service: str = ServerConfig.service,
    sampling_slots: int | None = None,
    rate_limit: float | None = None,
) -> ServerConfig:
    """A validated ``ServerConfig`` from user-level arguments (strings are parsed with
    the ``--faults`` / ``--latency`` grammars). Raises ``ValueError`` subclasses with a
    one-line message on bad values."""
    model_path = resolve_model(model_dir) or DEFAULT_MODEL_DIR
    if not model_path.is_dir():
        hint = (
            " (create the packaged model with `python -m scripts.make_model`)"
            if model_dir is None
            else ""
        )
        raise ServerConfigError(f"model directory {str(model_path)!r} does not exist{hint}")
    return ServerConfig(
        model_dir=model_path.resolve(),
        model_name=model_name,
        model_aliases=tuple(model_aliases),
        api_key=api_key,
        data_dir=Path(data_dir).resolve() if data_dir is not None else None,
        host=host,
        port=port,
        faults=faults if isinstance(faults, FaultSpec) else FaultSpec.parse(faults),
        latency=latency
        if isinstance(latency, LatencyProfile) or latency is None
        else LatencyProfile.parse(latency),
        long_poll_s=long_poll_s,
        seq_gap_timeout_s=seq_gap_timeout_s,
        header_timeout_s=header_timeout_s,
        body_timeout_s=body_timeout_s,
        session_timeout_s=session_timeout_s,
        sampling_logprobs=sampling_logprobs,
        num_threads=num_threads,
        limits=limits or Limits(),
        service=service,
        sampling_slots=sampling_slots,
        rate_limit=rate_limit,
    )
