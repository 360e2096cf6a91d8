"""What command-line flags and environment variables give, as the keyword arguments of
:class:`~engine.config.models.EngineConfig` (:func:`given_settings`): one reading used by
the CLI (:func:`engine.config.sources.config_from_sources`) and by
:meth:`EngineConfig.from_env <engine.config.models.EngineConfig.from_env>`. It builds no
config, so the models and the sources both stand on it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, get_origin

from engine.common.setting import SettingField, TaskSettings, parse_text, setting_fields
from engine.config.groups import GROUPS, all_settings
from engine.config.records import nest_record
from engine.config.registry import task_settings_models
from engine.config.values import HOSTED_BASE_URL
from engine.errors import ConfigError

__all__ = [
    "Values",
    "env_text",
    "given_settings",
    "is_mapping",
    "parse_task_args",
    "task_own_settings",
]

Values = dict[str, dict[str, Any]]
"""Settings by group: ``{"pipeline": {"batch": 8}}``."""


def task_own_settings() -> tuple[tuple[type[TaskSettings], SettingField], ...]:
    """The settings the built-in tasks declare (flags such as ``--op``)."""
    return tuple((model, f) for model in task_settings_models() for f in setting_fields(model))


def is_mapping(field: SettingField) -> bool:
    """Whether ``field`` is a table of KEY = VALUE (``--task-arg``)."""
    return get_origin(field.value_type) is dict


def env_text(field: SettingField, environ: Mapping[str, str]) -> tuple[str, str] | None:
    """(variable, text) of the first of ``field``'s environment variables that is set
    (the ``mint`` SDK's own hosted ``TINKER_BASE_URL`` does not count)."""
    for name in field.env:
        text = environ.get(name)
        if name == "TINKER_BASE_URL" and _is_hosted_default(text):
            continue  # importing ``mint`` sets it; it is the default, not a choice
        if text is not None and text.strip():
            return name, text
    return None


def parse_task_args(items: Sequence[str], source: str = "--task-arg") -> dict[str, str]:
    """``KEY=VALUE`` strings as a dict (a later key wins); ConfigError on a bad item."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{source} must be KEY=VALUE, got {item!r}")
        out[key.strip()] = value
    return out


def _given(field: SettingField, value: Any, source: str) -> Any:
    """A flag's value (text, a switch's bool, ``--task-arg`` items) as the setting's."""
    if is_mapping(field):
        if isinstance(value, Mapping):
            return {str(k): str(v) for k, v in value.items()}
        return parse_task_args(value, source)
    if isinstance(value, str) and not field.is_switch:
        return parse_text(field, value, source)
    return value


def given_settings(
    flags: Mapping[str, Any],
    environ: Mapping[str, str],
    *,
    defaults: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The settings from flags (by flat name: text, a switch's bool, ``--task-arg``
    items; None = not given), the environment and ``defaults`` (groups), as
    ``EngineConfig``'s keyword arguments (groups, and a task's own settings by flat
    name). ``--task-arg`` values extend the defaults' task arguments key by key, and win
    over a task's own flags (``--op``). No API key and no base URL (or a
    ``--local-model``) means the local server."""
    values: Values = {g: dict(v) for g, v in nest_record(defaults or {}).items() if g in GROUPS}
    for field in all_settings():
        assert field.group is not None
        given = flags.get(field.flat)
        if given is not None:
            value = _given(field, given, field.flag)
            if is_mapping(field):
                value = {**values.get(field.group, {}).get(field.name, {}), **value}
            values.setdefault(field.group, {})[field.name] = value
            continue
        found = env_text(field, environ)
        if found is not None:
            name, text = found
            value = parse_text(field, text, name)
            if is_mapping(field):
                value = {**values.get(field.group, {}).get(field.name, {}), **value}
            values.setdefault(field.group, {})[field.name] = value
    own: dict[str, Any] = {}
    for _, field in task_own_settings():
        flag = flags.get(field.flat)
        if flag is not None:
            own[field.flat] = parse_text(field, str(flag), field.flag)
        elif (found := env_text(field, environ)) is not None:
            own[field.flat] = parse_text(field, found[1], found[0])
    session = values.setdefault("session", {})
    connect = session.get("api_key") or session.get("base_url") is not None
    if session.get("local_model") is not None or not connect:
        session["local"] = True
    return {**values, **own}


def _is_hosted_default(url: str | None) -> bool:
    return url is not None and url.strip().rstrip("/") == HOSTED_BASE_URL.rstrip("/")
