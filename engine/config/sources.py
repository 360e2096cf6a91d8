"""Where settings come from, all generated from the models: command-line flags (in
``--help`` groups), environment variables, TOML files and a resumed run's config.json.

Each setting is read in this order: flag, environment variable, TOML file (``--config``),
the run dir's config.json (``--resume``), the model's default; a server-recommended
setting nobody set is resolved once the server is known (:mod:`engine.config.profile`).
A bad value stops the run with one ConfigError line naming the flag, variable or file
key it came from (exit code 2).
"""

from __future__ import annotations

import argparse
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final, get_origin

from engine.common.setting import (
    SettingField,
    did_you_mean,
    parse_text,
    setting_fields,
)
from engine.config.given import (
    Values,
    env_text,
    given_settings,
    is_mapping,
    parse_task_args,
    task_own_settings,
)
from engine.config.groups import GROUPS, all_settings
from engine.config.models import EngineConfig
from engine.config.profile import HOSTED_PROFILE, toml_text
from engine.config.records import nest_record
from engine.config.registry import task_settings_models
from engine.errors import ConfigError

__all__ = [
    "BEFORE_RECORDED",
    "add_setting_arguments",
    "config_from_sources",
    "default_text",
    "env_text",
    "help_text",
    "parse_task_args",
    "read_config_file",
    "stored_settings",
    "task_own_settings",
    "with_stored_settings",
]


def default_text(field: SettingField, task: str | None = None) -> str:
    """A setting's default as ``--help`` and the docs show it (``task``: the task whose
    own setting it is)."""
    if field.marker.recommended:
        hosted = (
            HOSTED_PROFILE.task_args.get(task, {}).get(field.name)
            if task is not None
            else getattr(HOSTED_PROFILE, field.name)
        )
        shown = f"{hosted:g}" if isinstance(hosted, float) else hosted
        return f"the server's recommendation, else {shown}"
    value = field.default
    if field.is_switch:
        return "on" if value else "off"
    if value is None or value in ((), {}):
        return field.marker.unset or "none"
    return f"{value:g}" if isinstance(value, float) else str(value)


def help_text(field: SettingField, task: str | None = None) -> str:
    env = f"env {' / '.join(field.env)}; "
    return f"{field.description} ({env}default: {default_text(field, task)})"


def config_from_sources(
    flags: Mapping[str, Any],
    environ: Mapping[str, str],
    *,
    defaults: Mapping[str, Any] | None = None,
) -> EngineConfig:
    """The config from flags (by flat name: text, a switch's bool, ``--task-arg``
    items; None = not given), the environment and ``defaults`` (groups, e.g.
    :func:`stored_settings` of a run being resumed overlaid by
    :func:`read_config_file`), read as :func:`~engine.config.given.given_settings`
    reads them."""
    return EngineConfig(**given_settings(flags, environ, defaults=defaults))


def add_setting_arguments(parser: argparse.ArgumentParser) -> None:
    """One argument group per settings group (and per task that declares settings),
    every flag with its environment variables and default in its help. Each flag's
    dest is the setting's flat name; a flag not given is None."""
    for name, model in GROUPS.items():
        group = parser.add_argument_group(f"{name} settings", _first_line(model.__doc__))
        for field in setting_fields(model, name):
            _add_flag(group, field, help_text(field))
    for task in task_settings_models():
        group = parser.add_argument_group(
            f"{task.spec} task settings", f"also --task-arg NAME=VALUE (--task {task.spec})"
        )
        for field in setting_fields(task):
            _add_flag(group, field, help_text(field, task.spec))


def _add_flag(group: argparse._ArgumentGroup, field: SettingField, text: str) -> None:
    text = text.replace("%", "%%")
    if field.is_switch:
        action = "store_false" if field.default else "store_true"
        group.add_argument(field.flag, dest=field.flat, action=action, default=None, help=text)
    elif is_mapping(field):
        group.add_argument(
            field.flag, dest=field.flat, action="append", metavar=field.metavar, help=text
        )
    else:
        group.add_argument(
            field.flag, dest=field.flat, default=None, metavar=field.metavar, help=text
        )


def _first_line(doc: str | None) -> str:
    return doc.strip().splitlines()[0] if doc else ""


def with_stored_settings(
    config: EngineConfig, stored: Mapping[str, Any], source: str
) -> EngineConfig:
    """The one rule a resumed run's settings follow, from the command line and embedded
    alike: it keeps the settings it was started with (``stored``, its config.json) unless
    ``config`` sets them (a flag, a variable, a TOML key, a keyword). Task arguments merge
    key by key; unset optional settings (None) take the stored value."""
    changes: dict[str, dict[str, Any]] = {}
    for group, values in stored_settings(stored, source).items():
        model = getattr(config, group)
        given = model.model_fields_set
        for name, value in values.items():
            current = getattr(model, name)
            if name == "args" and group == "task":
                value = {**value, **current}
            elif name in given and current is not None:
                continue
            changes.setdefault(group, {})[name] = value
    return config.replace(**changes) if changes else config


BEFORE_RECORDED: Final = {"training.loss_temperature": "off"}
"""What a server-recommended setting was in a run dir recorded before it existed, by
dotted key (a resume keeps it rather than take the server's recommendation, and it is
no change of the run's settings): such a run scored its loss at the model's own logits."""


def stored_settings(stored: Mapping[str, Any], source: str) -> Values:
    """The settings of a run directory's config.json (either layout) as groups, the
    ones a resume keeps (:func:`with_stored_settings`). Settings a resume takes from its
    own flags and environment (``resume="current"``: the run dir, keys, how it reports)
    and secrets are left out; ``source`` names the file in errors."""
    nested = nest_record(stored)
    out: Values = {}
    for field in all_settings():
        assert field.group is not None
        group = nested.get(field.group)
        value = group.get(field.name) if isinstance(group, Mapping) else None
        if value is None and isinstance(group, Mapping) and field.name not in group:
            value = BEFORE_RECORDED.get(field.path)
        if value is None or field.marker.resume == "current" or field.marker.secret:
            continue
        out.setdefault(field.group, {})[field.name] = _stored_value(
            field, value, f"{field.path} in {source}"
        )
    return out


def _stored_value(field: SettingField, value: Any, source: str) -> Any:
    if is_mapping(field):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{source} must be a table of KEY = VALUE")
        return {str(k): toml_text(v) for k, v in value.items()}
    if field.is_switch:
        if not isinstance(value, bool):
            raise ConfigError(f"{source} must be true or false, got {value!r}")
        return value
    if isinstance(value, list) and get_origin(field.value_type) is tuple:
        return parse_text(field, ",".join(map(str, value)), source)
    if isinstance(value, dict | list | bool):
        raise ConfigError(f"{source} must be a string or a number, got {value!r}")
    return parse_text(field, toml_text(value), source)


def read_config_file(path: Path) -> Values:
    """The settings of a TOML config file as groups. The file has a table per group
    (``[sampling]`` ``temperature = 1.0``; keys are field names or flag names, ``-`` or
    ``_``; ``[task.args]`` is the task's arguments, its own settings such as ``op``
    among them); a flat file from before the groups (``lr = 1e-3``, ``[task-arg]``)
    is read alike. ConfigError naming the file and key."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path} is not valid TOML ({exc})") from None
    out: Values = {}
    flat: dict[str, tuple[str, SettingField]] = {}
    for field in all_settings():
        for name in (field.flat, field.flag.removeprefix("--")):
            flat[name.replace("-", "_")] = (field.path, field)
    own = {f.name: f for _, f in task_own_settings()}
    for raw_key, value in data.items():
        key = raw_key.replace("-", "_")
        if key in GROUPS and isinstance(value, dict):
            for raw_name, item in value.items():
                where = f"{raw_key}.{raw_name} in {path}"
                found = _in_group(key, raw_name)
                if found is None:
                    names = [f.name for f in setting_fields(GROUPS[key], key)]
                    raise ConfigError(
                        f"{where} is not a setting{did_you_mean(raw_name.replace('-', '_'), names)}"
                        " (see python -m engine.run --help)"
                    )
                _put(out, found, item, where)
        elif key in flat:
            _put(out, flat[key][1], value, f"{raw_key} in {path}")
        elif key in own:
            args = out.setdefault("task", {}).setdefault("args", {})
            args.setdefault(key, _stored_value(own[key], value, f"{raw_key} in {path}"))
        else:
            known = [*GROUPS, *flat, *own]
            raise ConfigError(
                f"{raw_key} in {path} is not a setting{did_you_mean(key, known)} "
                "(see python -m engine.run --help)"
            )
    return out


def _in_group(group: str, raw_name: str) -> SettingField | None:
    name = raw_name.replace("-", "_")
    for field in setting_fields(GROUPS[group], group):
        if name in (field.name, field.flat, field.flag.removeprefix("--").replace("-", "_")):
            return field
    return None


def _put(out: Values, field: SettingField, value: Any, where: str) -> None:
    assert field.group is not None
    if field.marker.secret:
        raise ConfigError(f"{where}: keep API keys out of files (use MINT_API_KEY)")
    parsed = _stored_value(field, str(value) if isinstance(value, Path) else value, where)
    group = out.setdefault(field.group, {})
    if is_mapping(field):
        parsed = {**group.get(field.name, {}), **parsed}
    group[field.name] = parsed
