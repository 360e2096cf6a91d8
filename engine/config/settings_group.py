"""What every settings group is: a frozen pydantic model with no unknown keys whose
fields' checks (their :class:`~engine.common.setting.Setting` markers) run on
construction. The groups themselves live by subject (:mod:`engine.config.groups`)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from engine.common.setting import Check, Setting, check_value, setting_fields

__all__ = ["SettingsGroup", "rule"]


def rule(check: Check, **marker: Any) -> Setting:
    """A setting's marker with its check first (``rule(positive, resume="changeable")``)."""
    return Setting(check=check, **marker)


class SettingsGroup(BaseModel):
    """A group of settings: frozen, no unknown keys, every check run on construction."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    @model_validator(mode="after")
    def _check(self) -> SettingsGroup:
        for field in setting_fields(type(self)):
            check_value(field, getattr(self, field.name), field.flat)
        return self
