"""Every setting of a run, once: nested pydantic models grouped by concern
(:mod:`engine.config.groups`), assembled into :class:`EngineConfig` here.

Each field declares its default, type, description and (in its
:class:`~engine.common.setting.Setting` marker) its flag, environment variables, checks
and resume rule; :mod:`engine.config.sources` generates the CLI and the TOML format
from these fields, :mod:`engine.config.given` reads the flags and environment variables
by them, ``scripts/gen_config_table.py`` writes the docs table. Constructing a config
validates it (ConfigError, one line).

``EngineConfig(batch=8, steps=3)`` takes the flat names too: a flat keyword goes into
the group that declares it (one rule, :func:`route_flat`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, Final, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    ValidationError,
    model_validator,
)

from engine.common.setting import (
    SettingField,
    TaskSettings,
    check_value,
    did_you_mean,
    setting_fields,
)
from engine.config.given import given_settings
from engine.config.registry import settings_spec, task_settings_models
from engine.config.values import (
    HOSTED_BASE_URL,
    LOSSES,
    SDKS,
    TINKER_ONLY_LOSSES,
    LogFormat,
    LogLevel,
    LossName,
    OnRewardError,
)
from engine.errors import ConfigError

__all__ = [
    "GROUPS",
    "HOSTED_BASE_URL",
    "LOSSES",
    "SDKS",
    "TINKER_ONLY_LOSSES",
    "CheckpointSettings",
    "DistillationSettings",
    "EngineConfig",
    "EnvironmentSettings",
    "EvaluationSettings",
    "LogFormat",
    "LogLevel",
    "LoggingSettings",
    "LossName",
    "ModelSettings",
    "OnRewardError",
    "PipelineSettings",
    "PreferenceSettings",
    "SamplingSettings",
    "ScoringSettings",
    "SessionSettings",
    "TaskSettingsGroup",
    "ThenSettings",
    "TrainingSettings",
    "all_settings",
    "route_flat",
    "setting_at",
    "task_settings_of",
]

from engine.config.groups import (
    GROUPS,
    CheckpointSettings,
    DistillationSettings,
    EnvironmentSettings,
    EvaluationSettings,
    LoggingSettings,
    ModelSettings,
    PipelineSettings,
    PreferenceSettings,
    SamplingSettings,
    ScoringSettings,
    SessionSettings,
    TaskSettingsGroup,
    ThenSettings,
    TrainingSettings,
    all_settings,
    setting_at,
)

_FLAT: Final[Mapping[str, SettingField]] = {f.flat: f for f in all_settings()}


def task_settings_of(spec: str) -> type[TaskSettings] | None:
    """The settings a built-in task declares (a judged task: its task's; None: none)."""
    return next(
        (model for model in task_settings_models() if model.spec == settings_spec(spec)), None
    )


def _task_flat() -> dict[str, tuple[type[TaskSettings], SettingField]]:
    return {f.name: (model, f) for model in task_settings_models() for f in setting_fields(model)}


def route_flat(data: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` with its flat keys (``batch``, ``learning_rate``, a task's ``op``...)
    moved into their groups: a key naming a group with a mapping (or a group) is that
    group; any other key is a flat name. A task's own setting becomes a task argument
    (a ``task_args`` value wins over it); ConfigError when the task is not its task."""
    out: dict[str, Any] = {}
    flat: dict[str, dict[str, Any]] = {}
    task_own: dict[str, Any] = {}
    own_names = _task_flat()
    for key, value in data.items():
        if key in GROUPS and isinstance(value, Mapping | BaseModel):
            given = value.model_dump() if isinstance(value, BaseModel) else dict(value)
            out[key] = {**out.get(key, {}), **given}
        elif key in _FLAT:
            field = _FLAT[key]
            assert field.group is not None
            flat.setdefault(field.group, {})[field.name] = value
        elif key in own_names:
            if value is not None:
                task_own[key] = value
        else:
            out[key] = value  # extra="forbid" names it
    for group, values in flat.items():
        out[group] = {**out.get(group, {}), **values}
    if task_own:
        task = out.setdefault("task", {})
        spec = task.get("spec", TaskSettingsGroup.model_fields["spec"].default)
        for key, value in task_own.items():
            model, field = own_names[key]
            if settings_spec(spec) != model.spec:
                raise ConfigError(
                    f"{', '.join(task_own)} only apply to the {model.spec} task; give task "
                    f"{spec!r} its settings with --task-arg KEY=VALUE"
                )
            check_value(field, value, key)
        task["args"] = {**{k: str(v) for k, v in task_own.items()}, **task.get("args", {})}
    return out


class EngineConfig(BaseModel):
    """A run's configuration, by concern (``config.pipeline.batch``). The
    server-dependent ``None`` settings are filled from what the server reports by
    :meth:`resolved` (the engine does it once it knows the server). Constructing one
    validates it (ConfigError, one line); flat keywords (``EngineConfig(batch=8)``) go
    into their groups."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    task: TaskSettingsGroup = TaskSettingsGroup()
    model: ModelSettings = ModelSettings()
    sampling: SamplingSettings = SamplingSettings()
    training: TrainingSettings = TrainingSettings()
    distillation: DistillationSettings = DistillationSettings()
    preference: PreferenceSettings = PreferenceSettings()
    pipeline: PipelineSettings = PipelineSettings()
    scoring: ScoringSettings = ScoringSettings()
    environment: EnvironmentSettings = EnvironmentSettings()
    evaluation: EvaluationSettings = EvaluationSettings()
    checkpoints: CheckpointSettings = CheckpointSettings()
    session: SessionSettings = SessionSettings()
    logging: LoggingSettings = LoggingSettings()
    then: ThenSettings = ThenSettings()

    def __init__(self, **data: Any) -> None:
        spec = data.get("task")
        if spec is not None and not isinstance(spec, str | Mapping | BaseModel):
            raise ConfigError(
                f"EngineConfig(task=...) takes the task's spec as a string ('arithmetic', "
                f"'jsonl:PATH', 'hf:PATH' or 'package.module:attr'), got a "
                f"{type(spec).__name__}: pass a task object as Engine(config, task=...)"
            )
        try:
            super().__init__(**route_flat(data))
        except ValidationError as exc:
            raise ConfigError(_one_line(exc)) from None

    @model_validator(mode="after")
    def _check_across_groups(self) -> EngineConfig:
        session, checkpoints = self.session, self.checkpoints
        if self.pipeline.step_order == "completion" and self.pipeline.refill_groups:
            raise ConfigError(
                "--step-order completion forms steps from the groups that finish first, "
                "and --refill-groups replaces a step's tied groups: use one of them"
            )
        if self.scoring.overlong_buffer > self.sampling.max_tokens:
            raise ConfigError(
                f"--overlong-buffer {self.scoring.overlong_buffer} must not exceed "
                f"--max-tokens {self.sampling.max_tokens}"
            )
        if self.model.init_from_optimizer and self.model.init_from is None:
            raise ConfigError("init_from_optimizer needs init_from (a tinker://.../weights/ path)")
        run_dir = self.logging.run_dir
        if checkpoints.resume is not None and run_dir is not None and run_dir != checkpoints.resume:
            raise ConfigError(
                f"--resume {checkpoints.resume} and --run-dir {run_dir} name different "
                "directories: a resumed run continues in its own directory"
            )
        if session.base_url is not None and not session.api_key_value and not session.local:
            raise ConfigError(
                "MINT_BASE_URL is set but MINT_API_KEY is not: set both to use that server, "
                "or neither to start the local server"
            )
        return self

    def replace(self, **changes: Any) -> EngineConfig:
        """A validated copy with ``changes``: flat names, or groups as mappings of the
        fields that change (``replace(task={"spec": ..., "args": ...})``)."""
        data: dict[str, Any] = self._groups()
        for key, value in changes.items():
            if key in GROUPS and isinstance(value, Mapping):
                data[key] = {**getattr(self, key).model_dump(), **value}
            else:
                data[key] = value
        return EngineConfig(**data)

    def _groups(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in GROUPS}

    @property
    def uses_local_server(self) -> bool:
        """True when the engine starts the local server itself (``session.local``; the
        CLI and :meth:`from_env` set it when neither an API key nor a base URL is given)."""
        return self.session.local

    def checkpoint_due(self, completed_steps: int) -> bool:
        """True when a periodic checkpoint follows ``completed_steps`` trained steps (the
        initial and final checkpoints are not periodic)."""
        every = self.checkpoints.checkpoint_every
        steps = self.pipeline.steps
        return bool(every) and 0 < completed_steps < steps and completed_steps % every == 0

    @property
    def unresolved(self) -> tuple[str, ...]:
        """The settings whose defaults come from the server, still unset (by flat name:
        ``base_model``, ``lora_rank``, ``learning_rate`` and the task's own settings the
        server recommends, such as the arithmetic task's ``op``)."""
        missing = [
            f.flat
            for f in all_settings()
            if f.marker.recommended and getattr(getattr(self, f.group or ""), f.name) is None
        ]
        return (*missing, *self.unresolved_task_args)

    @property
    def unresolved_task_args(self) -> tuple[str, ...]:
        """The task's own settings the server recommends, still unset: the task is
        loaded once they are known."""
        own = task_settings_of(self.task.spec)
        if own is None:
            return ()
        fields = setting_fields(own)
        return tuple(
            f.name for f in fields if f.marker.recommended and f.name not in self.task.args
        )

    def setting_values(self, flats: Sequence[str]) -> list[str]:
        """``--flag value`` of each setting named by its flat name (as :attr:`unresolved`
        names them; a task argument as ``--task-arg NAME=VALUE``), in the order given,
        those that have a value."""
        out = []
        for flat in flats:
            field = _FLAT.get(flat)
            if field is None:
                value = self.task.args.get(flat)
                out += [f"--task-arg {flat}={value}"] if value is not None else []
                continue
            value = getattr(getattr(self, field.group or ""), field.name)
            out += [f"{field.flag} {value}"] if value is not None else []
        return out

    def resolved(self, *profiles: Any, **changes: Any) -> EngineConfig:
        """A copy with ``changes`` (as :meth:`replace`), the unset server-dependent
        settings taken from ``profiles`` (:class:`engine.config.Profile`; the first that
        has one wins) and the task's arguments completed by the task: one validated
        config. What no profile sets stays unset (:attr:`unresolved`)."""
        if changes:
            return self.replace(**changes).resolved(*profiles)
        for f in all_settings():
            if not f.marker.recommended:
                continue
            given = [getattr(getattr(self, f.group or ""), f.name)]
            given += [getattr(p, f.name) for p in profiles]
            changes[f.flat] = next((v for v in given if v is not None), None)
        spec = self.task.spec
        args: dict[str, str] = {}
        for profile in reversed(profiles):
            args.update(profile.task_args.get(settings_spec(spec), {}))
        args.update(self.task.args)
        own = task_settings_of(spec)
        if own is not None:
            args = own.complete(args, evaluated=bool(self.evaluation.eval_every))
        changes["task_args"] = args
        return self.replace(**changes)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **settings: Any) -> EngineConfig:
        """A config read from the environment the way ``python -m engine.run`` reads it
        (``MINT_API_KEY``, ``MINT_BASE_URL``, the quickstart's ``MINT_CUSTOM_REWARD_*``...),
        with ``settings`` (flat names or groups) on top. As in the CLI, no API key and no
        base URL means the local server. The plain constructor never reads the
        environment."""
        env = dict(os.environ if environ is None else environ)
        base = cls(**given_settings({}, env))
        connect = settings.get("api_key") or settings.get("base_url") is not None
        local = settings.get("local", base.session.local and not connect)
        return base.replace(**{**settings, "local": local})

    def public_dict(self) -> dict[str, Any]:
        """What config.json records: every group (JSON values) without the secrets, and
        ``server`` (``local`` or ``remote``)."""
        secrets = {f.group: {f.name} for f in all_settings() if f.marker.secret}
        out: dict[str, Any] = {
            name: group.model_dump(mode="json", exclude=secrets.get(name, set()))
            for name, group in self._groups().items()
        }
        out["server"] = "local" if self.uses_local_server else "remote"
        return out


_TYPE_PROBLEMS: Final = {
    "int_parsing": "must be an integer",
    "int_type": "must be an integer",
    "int_from_float": "must be an integer",
    "float_parsing": "must be a number",
    "float_type": "must be a number",
    "bool_parsing": "must be true or false",
    "bool_type": "must be true or false",
}


def _one_line(exc: ValidationError) -> str:
    """The first error of ``exc`` as one sentence naming the setting (its flat name)."""
    error = exc.errors()[0]
    loc = [str(part) for part in error["loc"]]
    setting = setting_at(".".join(loc[:2]))
    where = setting.flat if setting is not None else ".".join(loc)
    if error["type"] == "extra_forbidden":
        known = [*_FLAT, *(f.path for f in all_settings()), *_task_flat()]
        hint = did_you_mean(where, known)
        return f"{where} is not a setting{hint} (see python -m engine.run --help)"
    given = error.get("input")
    if error["type"] == "literal_error" and setting is not None:
        choices = ", ".join(map(str, get_args(setting.value_type)))
        return f"{where} must be one of {choices}, got {given!r}"
    problem = _TYPE_PROBLEMS.get(error["type"], error["msg"][:1].lower() + error["msg"][1:])
    shown = "" if isinstance(given, Mapping | BaseModel) else f", got {given!r}"
    return f"{where} {problem}{shown}"
