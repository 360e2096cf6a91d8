"""Settings of one local server instance, declared once and validated at construction.

Every setting is one annotated field of :class:`ServerConfig` (or of its :class:`Limits`)
with the :class:`~engine.common.setting.Setting` marker the engine's settings use: its
type, default and checks. A field with a description is also a flag of ``python -m
engine.local`` (the description is its help): the parser (:func:`add_server_flags`), the
values it gives (:func:`flag_values`) and the docs' option table
(``scripts/gen_config_table.py``) are generated from the fields, so a new setting is one
declaration. The CLI, the in-process launchers and the tests share one set of defaults
and one set of error messages.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, get_origin

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from engine.basemodels.catalogue import DEFAULT_MODEL_DIR, PACKAGED, PRETRAINED, resolve_model
from engine.common.net import is_loopback_host
from engine.common.protocol import LOCAL_MAX_NUM_SAMPLES
from engine.common.setting import Setting, SettingField, one_of, setting_fields
from engine.local.faults import FaultSpec
from engine.local.latency import LatencyProfile
from engine.local.profiles import HOSTED_SAMPLING_SLOTS, SERVICES, ServiceProfile, profile_of

READY_PREFIX = "engine.local: serving "
"""The line ``python -m engine.local`` prints on stdout once it accepts requests."""

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


# --------------------------------------------------------------------------- checks


@dataclass(frozen=True)
class _Bound:
    """A check whose problem reads the same for a value out of range and for a flag's
    text that is no number at all (``--max-datums x``: "must be a positive integer")."""

    problem: str
    fits: Callable[[Any], bool]

    def __call__(self, v: Any) -> str | None:
        return None if self.fits(v) else self.problem


def _whole(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


positive_int = _Bound("must be a positive integer", lambda v: _whole(v) and v >= 1)
positive_seconds = _Bound("must be a number of seconds > 0", lambda v: math.isfinite(v) and v > 0)
positive_rate = _Bound(
    "must be a number of requests per second > 0", lambda v: math.isfinite(v) and v > 0
)
port_number = _Bound("must be an integer in 0..65535", lambda v: _whole(v) and 0 <= v <= 65535)
slot_count = _Bound("must be an integer in 0..4096 (0: no limit)", lambda v: 0 <= v <= 4096)
thread_count = _Bound("must be in 1..1024", lambda v: 1 <= v <= 1024)
jwt_lifetime = _Bound("must be >= 600 (the client refreshes 5 min early)", lambda v: v >= 600)
at_least_zero = _Bound("must be >= 0", lambda v: v >= 0)


@dataclass(frozen=True)
class Flag:
    """How a setting's flag maps onto its field where it is not one to one."""

    scale: int = 1
    """The field's value per unit of the flag's (``--max-adapter-memory`` is in MB)."""
    also: tuple[str, ...] = ()
    """Other fields of the same model the flag sets too (``--max-samplers``)."""


class _Checked(BaseModel):
    """Frozen settings whose :class:`Setting` checks run at construction; a bad value is
    one :class:`ServerConfigError` line naming the field."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            error = exc.errors()[0]
            raised = error.get("ctx", {}).get("error")
            if isinstance(raised, ValueError):
                raise raised from None  # ours (ServerConfigError, a --faults spec's...)
            where = ".".join(map(str, error["loc"]))
            if error["type"] == "extra_forbidden":
                raise ServerConfigError(f"{where} is not a setting of the local server") from None
            given = error.get("input")
            message = error["msg"][:1].lower() + error["msg"][1:]
            raise ServerConfigError(f"{where}: {message}, got {given!r}") from None

    @model_validator(mode="after")
    def _checked(self) -> _Checked:
        for field in setting_fields(type(self)):
            value = getattr(self, field.name)
            problem = field.problem(value)
            if problem:
                raise ServerConfigError(f"{field.name} {problem}, got {value!r}")
        return self


class Limits(_Checked):
    """Request-size bounds. They keep one bad or hostile request from exhausting memory;
    each violation is answered with a message naming the limit."""

    max_body_bytes: Annotated[int, Setting(check=positive_int, metavar="N")] = Field(
        32 * 1024 * 1024,
        description="largest JSON request body in bytes (uploads: --max-upload-bytes), 413 "
        "beyond; the client chunks forward_backward at ~5 MB",
    )
    max_upload_bytes: Annotated[int, Setting(check=positive_int, metavar="N")] = Field(
        1 << 30,
        description="largest checkpoint archive upload (/api/v1/checkpoints/upload) in bytes, "
        "and the most file contents it may unpack to; 413 beyond",
    )
    max_datums: Annotated[int, Setting(check=positive_int, metavar="N")] = Field(
        1024,
        description="datums per forward/forward_backward request; the SDK sends at most 1024",
    )
    max_request_tokens: Annotated[int, Setting(check=positive_int, metavar="N")] = Field(
        131072,
        description="model_input tokens per forward/forward_backward request, summed over its "
        "datums, bounding how long one request holds the compute thread (the client's ~5 MB "
        "chunks of RL datums stay under ~125k tokens)",
    )
    max_seq_gap: Annotated[int, Setting(check=positive_int, metavar="N")] = Field(
        16,
        description="how far a model's seq_id may run past the first missing one; further "
        "ones are refused at once (this also bounds the operations waiting for a missing one)",
    )
    max_models: Annotated[int, Setting(check=positive_int, metavar="N")] = Field(
        64,
        description="training clients held in memory; beyond it a new one is refused (429), a "
        "live one is never evicted for it (clients are released when their session stops "
        "sending heartbeats)",
    )
    max_named_samplers: Annotated[
        int,
        Setting(flag="--max-samplers", check=positive_int, metavar="N"),
        Flag(also=("max_ephemeral_samplers",)),
    ] = Field(
        64,
        description="checkpoint snapshots (sampling clients from a model_path, and those saved "
        "with save_weights_for_sampler) held in memory, and as many from "
        "save_weights_and_get_sampling_client; beyond it the least recently used one that no "
        "live client may still sample from is evicted (never a training client's newest, nor "
        "one being sampled), with the sampling sessions that use it; if there is none, the "
        "new one is refused (429)",
    )
    max_adapter_bytes: Annotated[
        int,
        Setting(flag="--max-adapter-memory", check=positive_int, metavar="MB"),
        Flag(scale=1 << 20),
    ] = Field(
        4 << 30,
        description="memory for training clients (LoRA weights, gradients, Adam moments) and "
        "sampler snapshots together; beyond it the least recently used are evicted, "
        "checkpoint snapshots first, then in-memory snapshots, then idle training clients",
    )
    max_queued_samples: Annotated[
        int, Setting(flag="--sampling-queue", check=positive_int, metavar="N")
    ] = Field(
        1024,
        description="sample requests that may wait for a slot (--sampling-slots); beyond it a "
        "new one gets 429",
    )
    max_num_samples: Annotated[int, Setting(check=positive_int)] = LOCAL_MAX_NUM_SAMPLES
    """num_samples per asample request."""
    max_topk_prompt_logprobs: Annotated[int, Setting(check=positive_int)] = 20
    max_lora_rank: Annotated[int, Setting(check=positive_int)] = 256
    max_pending_futures: Annotated[int, Setting(check=positive_int)] = 4096
    """Unfinished futures across the server; beyond it submissions get 429."""
    max_pending_per_model: Annotated[int, Setting(check=positive_int)] = 256
    """Queued training operations per model; beyond it submissions get 429."""
    max_retained_results: Annotated[int, Setting(check=positive_int)] = 8192
    """Finished futures kept for re-polls; the oldest are dropped first (then 410)."""
    max_sample_batch: Annotated[int, Setting(check=positive_int)] = 64
    """asample requests merged into one backend.sample call."""
    dedupe_window: Annotated[int, Setting(check=positive_int)] = 4096
    """Per-model (seq_id -> request) entries remembered for duplicate detection."""
    max_concurrent_uploads: Annotated[int, Setting(check=positive_int)] = 4
    """Uploads received at a time; beyond it an upload gets 503 with Retry-After."""
    max_ephemeral_samplers: Annotated[int, Setting(check=positive_int)] = 64
    """Snapshots from save_weights_and_get_sampling_client kept in memory, bounded as
    ``max_named_samplers`` is (sampling from a released one fails with a clear error).
    Named snapshots (save_weights_for_sampler) are not counted: they live on disk."""
    max_stability_records: Annotated[int, Setting(check=positive_int)] = 65536
    """Sampled sequences kept for ``stable_reinforce`` (``record_stability_info``); beyond
    it the least recently used are forgotten first (training on one then fails clearly)."""


class ServerConfig(_Checked):
    """Everything a server instance needs; ``ServerConfig()`` is the library's defaults
    (the packaged model, no API key, a temporary data dir, loopback on a free port).
    Values may be given as a user gives them: a model by name, ``faults`` and ``latency``
    in their ``--faults`` / ``--latency`` grammars."""

    host: Annotated[str, Setting(metavar="HOST")] = Field(
        "127.0.0.1", description="address to bind (a non-loopback address requires --api-key)"
    )
    port: Annotated[int, Setting(check=port_number, metavar="PORT")] = Field(
        0, description="port to bind; 0 picks a free one"
    )
    model_dir: Annotated[Path, Setting(flag="--model", metavar="DIR|NAME")] = Field(
        Path("tiny-arith"),
        validate_default=True,
        description="local Hugging Face causal-LM directory, or a packaged model by name: "
        f"{', '.join(PACKAGED)}, or a pretrained one: {', '.join(PRETRAINED)} (opt-in, "
        "converted on first use; see docs/local-server.md)",
    )
    model_name: Annotated[
        str | None,
        Setting(unset="chosen by the backend from the model", metavar="NAME"),
    ] = Field(None, description="base_model name clients use")
    model_aliases: Annotated[tuple[str, ...], Setting(flag="--model-alias", metavar="NAME")] = (
        Field(
            (),
            description="extra base_model name accepted for the served model, e.g. "
            "Qwen/Qwen3-0.6B (repeatable), so scripts with a hard-coded hosted model run "
            "unchanged",
        )
    )
    api_key: Annotated[
        str | None,
        Setting(
            env=("ENGINE_LOCAL_API_KEY",),
            secret=True,
            metavar="KEY",
            unset="no authentication (any key works)",
        ),
    ] = Field(
        None,
        description="require this key (X-API-Key, raw or as a JWT from auth/token, which only "
        "the key itself can fetch)",
    )
    data_dir: Annotated[
        Path | None,
        Setting(metavar="DIR", unset=f"{DEFAULT_DATA_DIR_TEXT}; the library's: a temporary dir"),
    ] = Field(None, description="where training runs and checkpoints are kept, across restarts")
    faults: Annotated[FaultSpec, Setting(metavar="SPEC", unset="none")] = Field(
        default_factory=FaultSpec, description="inject faults (see below)"
    )
    latency: Annotated[LatencyProfile | None, Setting(metavar="PROFILE")] = Field(
        None, description="simulate hosted latency (see below)"
    )
    long_poll_s: Annotated[
        float, Setting(flag="--long-poll", check=positive_seconds, metavar="SECONDS")
    ] = Field(20.0, description="how long retrieve_future holds a poll before try_again")
    seq_gap_timeout_s: Annotated[
        float, Setting(flag="--seq-gap-timeout", check=positive_seconds, metavar="SECONDS")
    ] = Field(
        300.0,
        description="how long an operation waits for a missing earlier seq_id of its model "
        "before it is refused (the client gives up submitting after 5 minutes)",
    )
    header_timeout_s: Annotated[
        float, Setting(flag="--header-timeout", check=positive_seconds, metavar="SECONDS")
    ] = Field(
        10.0,
        description="a connection that has not sent a request's headers within this time is closed",
    )
    body_timeout_s: Annotated[
        float, Setting(flag="--body-timeout", check=positive_seconds, metavar="SECONDS")
    ] = Field(
        60.0,
        description="a request whose body (a checkpoint upload's too) has not arrived within "
        "this time gets 408",
    )
    num_threads: Annotated[
        int | None,
        Setting(
            flag="--threads",
            check=thread_count,
            metavar="N",
            unset="1 for small models, all cores but one otherwise",
        ),
    ] = Field(
        None, description="torch threads for the model (on a busy machine 1 is often fastest)"
    )
    sampling_logprobs: Annotated[str, Setting(check=one_of(SAMPLING_LOGPROBS))] = Field(
        "tempered",
        description="the logprob reported for each sampled token: under the distribution it "
        "was drawn from ('tempered', as hosted Tinker) or under the untempered model "
        "('untempered'); see docs/losses.md",
    )
    service: Annotated[str, Setting(check=one_of(SERVICES))] = Field(
        "local",
        description="behave as this hosted service in what changes a client's results or "
        "control flow: accepted losses and loss_fn_config keys, MinT's "
        "rollout_correction_config, the sampling queue; see docs/local-server.md, 'Service "
        "profiles' (local: every option of this server)",
    )
    sampling_slots: Annotated[
        int | None,
        Setting(
            check=slot_count,
            metavar="N",
            unset=f"no limit for local, {HOSTED_SAMPLING_SLOTS} for mint and tinker",
        ),
    ] = Field(
        None,
        description="sample requests run at a time; the rest wait in a FIFO queue, and a "
        "request sent with X-Tinker-Sampling-Backpressure: 1 gets 408 with its place in it "
        "while it waits; 0: no limit",
    )
    rate_limit: Annotated[
        float | None, Setting(check=positive_rate, metavar="PER_SECOND", unset="no limit")
    ] = Field(
        None,
        description="requests per second per API key (token bucket, bursts of max(1, rate)); "
        "past it 429 with Retry-After; polls and heartbeats are not counted",
    )
    session_timeout_s: Annotated[
        float, Setting(flag="--session-timeout", check=positive_seconds, metavar="SECONDS")
    ] = Field(
        600.0,
        description="release the training clients and sampling sessions of a session that "
        "sent no heartbeat for this long (the SDK heartbeats every 10 s)",
    )
    limits: Limits = Field(default_factory=Limits)
    jwt_ttl_s: Annotated[int, Setting(check=jwt_lifetime)] = 24 * 3600
    sample_batch_window_s: Annotated[float, Setting(check=at_least_zero)] = 0.0
    """Extra time the sampler waits for more asample requests before a batch runs."""
    housekeeping_interval_s: Annotated[float, Setting(check=positive_seconds)] = 10.0
    """How often silent sessions, expired checkpoints and archive URLs are swept."""

    @field_validator("model_dir", mode="before")
    @classmethod
    def _model_directory(cls, model: Any) -> Path:
        """A packaged model's name becomes its directory, a pretrained one's its converted
        directory (converted on first use: call this off the event loop)."""
        path = resolve_model(model) or DEFAULT_MODEL_DIR
        if not path.is_dir():
            packaged = path == DEFAULT_MODEL_DIR
            hint = " (create the packaged model with `python -m scripts.make_model`)"
            raise ServerConfigError(
                f"model directory {str(path)!r} does not exist{hint if packaged else ''}"
            )
        return path.resolve()

    @field_validator("data_dir", mode="before")
    @classmethod
    def _absolute(cls, path: Any) -> Any:
        return None if path is None else Path(path).expanduser().resolve()

    @field_validator("faults", mode="before")
    @classmethod
    def _faults(cls, spec: Any) -> Any:
        return spec if isinstance(spec, FaultSpec) else FaultSpec.parse(spec)

    @field_validator("latency", mode="before")
    @classmethod
    def _latency(cls, profile: Any) -> Any:
        return profile if not isinstance(profile, str) else LatencyProfile.parse(profile)

    @model_validator(mode="after")
    def _consistent(self) -> ServerConfig:
        if self.api_key is not None and not self.api_key.strip():
            raise ServerConfigError("api_key must not be empty (omit it to disable authentication)")
        if not is_loopback_host(self.host) and self.api_key is None:
            raise ServerConfigError(
                f"refusing to bind non-loopback host {self.host!r} without an API key "
                "(pass --api-key, or bind 127.0.0.1)"
            )
        return self

    @property
    def profile(self) -> ServiceProfile:
        return profile_of(self.service)

    @property
    def slots(self) -> int | None:
        """The sampling slots in force (None: no limit)."""
        if self.sampling_slots is None:
            return self.profile.sampling_slots
        return self.sampling_slots or None


# --------------------------------------------------------------------------- flags


def server_flags() -> Iterator[tuple[str | None, SettingField]]:
    """(group, field) of every setting that is a flag, in declaration order; the group
    is ``"limits"`` for the fields of :class:`Limits`, else None."""
    for field in setting_fields(ServerConfig):
        if field.name == "limits":
            for limit in setting_fields(Limits):
                if limit.description:
                    yield "limits", limit
        elif field.description:
            yield None, field


def default_text(field: SettingField) -> str:
    """A setting's default as ``--help`` and the docs show it."""
    value = field.default
    if isinstance(value, FaultSpec) and not value.enabled:
        value = None
    if value is None or value == ():
        return field.marker.unset or "none"
    scale = _flag(field).scale
    if scale != 1:
        value //= scale
    return f"{value:g}" if isinstance(value, float) else str(value)


def choices(field: SettingField) -> tuple[str, ...]:
    """The values a setting may take, when it is one of a few."""
    check = field.marker.check
    return tuple(getattr(check, "choices", ()))


def _flag(field: SettingField) -> Flag:
    return next((m for m in field.info.metadata if isinstance(m, Flag)), Flag())


def _text_type(field: SettingField) -> Callable[[str], Any]:
    """The argparse type of a flag: its text as the field's value, and the field's check
    as ``argument --flag: <problem>, got '<text>'``; a non-number without a check is
    argparse's own ``invalid int value``. Other values (a model's name, a fault spec) stay
    text until :class:`ServerConfig` reads them."""
    kind = field.value_type
    if get_origin(kind) is tuple or kind not in (int, float):
        return str
    check = field.marker.check

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            if isinstance(check, _Bound):
                raise argparse.ArgumentTypeError(f"{check.problem}, got {text!r}") from None
            raise
        problem = field.problem(value)
        if problem:
            raise argparse.ArgumentTypeError(f"{problem}, got {text!r}")
        return value

    parse.__name__ = kind.__name__  # argparse names it in "invalid int value"
    return parse


def add_server_flags(
    parser: argparse.ArgumentParser, containers: Mapping[str, Any] | None = None
) -> None:
    """Add every setting's flag to ``parser`` (or to ``containers[name]``, e.g. a
    mutually exclusive group), each with its help and default; its dest is the field's
    name and a flag not given is None."""
    for _, field in server_flags():
        help_text = f"{field.description} (default: {default_text(field)})"
        if field.marker.env:
            help_text += f"; env {' / '.join(field.marker.env)}"
        target = (containers or {}).get(field.name, parser)
        options: dict[str, Any] = {"dest": field.name, "default": None}
        if choices(field):
            options["choices"] = choices(field)
        else:
            options["metavar"] = field.metavar
            options["type"] = _text_type(field)
        if get_origin(field.value_type) is tuple:
            options["action"] = "append"
        target.add_argument(field.flag, help=help_text.replace("%", "%%"), **options)


def flag_values(args: argparse.Namespace, environ: Mapping[str, str]) -> dict[str, Any]:
    """The keyword arguments of :class:`ServerConfig` that ``args`` (from a parser with
    :func:`add_server_flags`) and ``environ`` (a setting's ``env`` variables, read when
    its flag is not given) set; a ``limits`` entry holds a :class:`Limits`."""
    values: dict[str | None, dict[str, Any]] = {None: {}, "limits": {}}
    for group, field in server_flags():
        value = getattr(args, field.name)
        if value is None:
            value = next((environ[name] for name in field.marker.env if environ.get(name)), None)
        if value is None:
            continue
        flag = _flag(field)
        for name in (field.name, *flag.also):
            values[group][name] = value * flag.scale if flag.scale != 1 else value
    limits = values.pop("limits")
    return {**values[None], **({"limits": Limits(**limits)} if limits else {})}
