"""Objects named ``package.module:attr`` on the command line (a task, a reward), found
with one rule and refused in one line when there is none."""

from __future__ import annotations

import importlib
from typing import Any

from engine.errors import ConfigError

__all__ = ["import_attr"]


def import_attr(spec: str, what: str) -> Any:
    """The object ``package.module:attr`` names (``attr`` may be dotted; not called);
    a ConfigError ``invalid <what> <spec>: ...`` when the spec is malformed, the module
    cannot be imported or has no such attribute."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"invalid {what} {spec!r}: name it as package.module:attr")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # not found, or the module raised while it was imported
        cause = str(exc) if isinstance(exc, ImportError) else f"{type(exc).__name__}: {exc}"
        raise ConfigError(
            f"invalid {what} {spec!r}: cannot import {module_name!r} ({cause})"
        ) from exc
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"invalid {what} {spec!r}: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj
