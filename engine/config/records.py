"""A run dir's recorded config (config.json) in either layout, as settings groups.

config.json records the groups (``{"pipeline": {"batch": 8, ...}, ...}``, see
:meth:`EngineConfig.public_dict <engine.config.EngineConfig.public_dict>`); a run dir
written before the groups holds flat keys (``{"batch": 8, "op": null, ...}``), which
:func:`nest_record` moves into their groups: both resume alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from engine.common.setting import Resume, setting_fields
from engine.config.groups import GROUPS, all_settings, setting_at
from engine.config.registry import task_settings_models

__all__ = ["CONFIG_FILE", "flat_settings", "nest_record", "resume_rule"]

# The file a run dir records its settings in.
CONFIG_FILE: Final = "config.json"


def nest_record(stored: Mapping[str, Any]) -> dict[str, Any]:
    """``stored`` with its flat setting keys in their groups (a task's own settings, such
    as the arithmetic ``op``, among the task's arguments); other keys (``server``,
    ``task_name``...) as they are. A record that is already nested is returned as is."""
    flat = {f.flat: f for f in all_settings()}
    own = {f.name for model in task_settings_models() for f in setting_fields(model)}
    out: dict[str, Any] = {}
    groups: dict[str, dict[str, Any]] = {}
    own_args: dict[str, str] = {}
    for key, value in stored.items():
        if key in GROUPS and isinstance(value, Mapping):
            groups.setdefault(key, {}).update(value)
        elif key in flat and flat[key].group is not None:
            groups.setdefault(str(flat[key].group), {})[flat[key].name] = value
        elif key in own:
            if value is not None:
                own_args[key] = str(value)
        else:
            out[key] = value
    if own_args:
        task = groups.setdefault("task", {})
        args = task.get("args")
        task["args"] = {**own_args, **(args if isinstance(args, Mapping) else {})}
    return {**out, **groups}


def flat_settings(stored: Mapping[str, Any]) -> dict[str, Any]:
    """The settings of a record (either layout) by flat name (``batch``, ``task``,
    ``task_args``), for code that takes settings as ``EngineConfig`` keywords."""
    nested = nest_record(stored)
    out = {}
    for field in all_settings():
        group = nested.get(str(field.group))
        if isinstance(group, Mapping) and field.name in group:
            out[field.flat] = group[field.name]
    return out


def resume_rule(key: str) -> Resume:
    """The resume rule of the config.json key ``key`` (a dotted path such as
    ``pipeline.steps`` or ``task.args.op``: a key below a setting has its rule)."""
    parts = key.split(".")
    setting = setting_at(".".join(parts[:2])) if len(parts) >= 2 else None
    return setting.marker.resume if setting is not None else "fixed"
