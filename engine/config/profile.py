"""Profiles: the defaults of the settings the server decides.

The defaults of ``base_model``, ``lora_rank``, ``learning_rate``, ``loss_temperature``,
``temperature`` and a task's own recommended settings (the arithmetic task's operation and
operand range) come from what the server reports (:func:`server_profile`): the local
server recommends settings for the model it serves (recorded with the model, see
:mod:`engine.basemodels.recommended`) and the loss and sampling temperatures; a
server that recommends nothing, such as hosted MinT, gets the MinT quickstart's
(:data:`HOSTED_PROFILE`). A config with these left unset is
:meth:`EngineConfig.resolved <engine.config.EngineConfig.resolved>` once the server is
known.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from engine.common.protocol import RECOMMENDED_FIELD
from engine.common.setting import parse_text
from engine.config.groups import all_settings
from engine.errors import ConfigError

__all__ = ["HOSTED_PROFILE", "HOSTED_TEMPERATURE", "Profile", "server_profile", "toml_text"]


HOSTED_TEMPERATURE: Final = 1.0
"""The sampling temperature on a server that recommends none (hosted MinT or Tinker): their
samplers report tempered logprobs and take no loss temperature, so at 1 an on-policy
ratio is 1; measured on the hosted-MinT profile (docs/losses.md, "Which default, and
why"). The quickstart samples at 0.8: ``--temperature 0.8`` repeats it."""


@dataclass(frozen=True)
class Profile:
    """Defaults of the settings that depend on the server and the model it serves; None
    (or a missing task): no default from this source."""

    name: str
    base_model: str | None = None
    lora_rank: int | None = None
    learning_rate: float | None = None
    loss_temperature: str | None = None
    temperature: float | None = None
    task_args: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    """Arguments per task spec (``"arithmetic"``: its operation and operand range)."""


HOSTED_PROFILE: Final = Profile(
    "hosted",
    base_model="Qwen/Qwen3-0.6B",
    lora_rank=16,
    learning_rate=2e-5,
    loss_temperature="off",
    temperature=HOSTED_TEMPERATURE,
    task_args={"arithmetic": {"op": "*", "min_operand": "10", "max_operand": "199"}},
)
"""The MinT quickstart's defaults, but for the sampling temperature: what a server that
recommends nothing gets."""


def toml_text(value: Any) -> str:
    """A TOML or JSON scalar as the text a flag would give."""
    return str(value).lower() if isinstance(value, bool) else str(value)


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
            values = {key: _recommended(recommended, key, where) for key in _RECOMMENDED_VALUES}
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        hosted = HOSTED_PROFILE
        return Profile(
            f"{name} (recommended by {source})",
            base_model=name,
            **{
                key: value if value is not None else getattr(hosted, key)
                for key, value in values.items()
            },
            task_args={
                spec: {
                    **hosted.task_args.get(spec, {}),
                    **{str(k): toml_text(v) for k, v in tasks.get(spec, {}).items()},
                }
                for spec in {*hosted.task_args, *map(str, tasks)}
            },
        )
    return HOSTED_PROFILE


_RECOMMENDED_VALUES: Final = ("lora_rank", "learning_rate", "loss_temperature", "temperature")


def _recommended(recommended: Mapping[str, Any], key: str, where: str) -> Any:
    value = recommended.get(key)
    if value is None:
        return None
    setting = next(f for f in all_settings() if f.flat == key)
    return parse_text(setting, str(value), f"{key} in {where}")
