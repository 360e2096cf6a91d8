"""What a setting declares besides its type, default and description, and how a value
given as text (a flag, an environment variable, a TOML value) becomes a checked value.

Why a marker: every setting is one annotated field of a settings model
(:mod:`engine.config.models`); the CLI flags, environment variables, TOML keys, resume
rules and the docs table are generated from these fields and their :class:`Setting`
markers, so nothing about a setting is written twice.
"""

from __future__ import annotations

import json
import math
import types
import urllib.parse
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar, Final, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict
from pydantic.fields import FieldInfo

from engine.common.cli import did_you_mean
from engine.common.protocol import MAX_SEED
from engine.errors import ConfigError

__all__ = [
    "ENV_PREFIX",
    "MAX_SEED",
    "Check",
    "Resume",
    "Setting",
    "SettingField",
    "TaskSettings",
    "check_value",
    "did_you_mean",
    "finite_non_negative",
    "finite_positive",
    "http_url",
    "non_empty",
    "non_negative",
    "one_of",
    "parse_text",
    "positive",
    "seed",
    "setting_fields",
]

Check = Callable[[Any], "str | None"]
"""A value's problem as the end of a sentence ("must be positive"), or None."""

Resume = Literal["fixed", "changeable", "current"]
"""What a resumed run does with a setting: ``fixed`` (the run dir's value; a different
one is refused), ``changeable`` (the run dir's value unless given anew; nothing trained
changes) or ``current`` (never read from the run dir: where it connects, how it
reports)."""

ENV_PREFIX: Final = "ENGINE_"
"""Every setting's own environment variable is this prefix and its flat name in capitals
(``ENGINE_BATCH``, ``ENGINE_LEARNING_RATE``); ``Setting.env`` adds aliases."""


@dataclass(frozen=True)
class Setting:
    """The marker of a setting field (``Annotated[type, Setting(...)]``).

    ``flag``: its command-line flag (default ``--`` + the field name, dashed); ``env``:
    aliases read after ``ENGINE_<FLAT NAME>`` (the quickstart's
    ``MINT_CUSTOM_REWARD_STEPS``...), the first set wins; ``check``: a value's problem
    beyond its type (a ``Literal`` type checks its choices by itself); ``unset``: what
    ``None`` means, for the docs and ``--help``; ``recommended``: the server recommends
    its value when unset (:class:`engine.config.Profile`); ``flat``: its name as a keyword of
    ``EngineConfig(...)``, in a flat TOML file and in a run dir's config.json from
    before the groups (default the field name); ``secret``: never written anywhere;
    ``metavar``: what ``--help`` shows as its value (default: from its type)."""

    flag: str | None = None
    env: tuple[str, ...] = ()
    check: Check | None = None
    resume: Resume = "fixed"
    unset: str | None = None
    recommended: bool = False
    flat: str | None = None
    secret: bool = False
    metavar: str | None = None


@dataclass(frozen=True)
class SettingField:
    """One setting of a settings model, as the generators see it."""

    group: str | None
    name: str
    info: FieldInfo
    marker: Setting

    @property
    def path(self) -> str:
        """``group.name`` (the dotted key in config.json and the nested TOML)."""
        return f"{self.group}.{self.name}" if self.group else self.name

    @property
    def flat(self) -> str:
        return self.marker.flat or self.name

    @property
    def flag(self) -> str:
        return self.marker.flag or "--" + self.name.replace("_", "-")

    @property
    def env(self) -> tuple[str, ...]:
        """Its environment variables, the first set wins: ``ENGINE_<FLAT NAME>``, then
        the declared aliases."""
        return tuple(dict.fromkeys((ENV_PREFIX + self.flat.upper(), *self.marker.env)))

    @property
    def metavar(self) -> str:
        """What ``--help`` shows as its value: the marker's, the choices, or the kind of
        value."""
        if self.marker.metavar is not None:
            return self.marker.metavar
        kind = self.value_type
        check = self.marker.check
        choices = check.choices if isinstance(check, _OneOf) else _choices(kind)
        if choices:
            return "{" + ",".join(choices) + "}"
        if get_origin(kind) is tuple:
            return "INT[,INT...]" if _items(kind) is int else "NAME[,NAME...]"
        if get_origin(kind) is dict:
            return "KEY=VALUE"
        return _METAVARS.get(kind, "TEXT")

    @property
    def value_type(self) -> Any:
        """The field's type without ``None``."""
        return _without_none(self.info.annotation)

    @property
    def is_switch(self) -> bool:
        return self.value_type is bool

    @property
    def description(self) -> str:
        return self.info.description or ""

    @property
    def default(self) -> Any:
        return self.info.get_default(call_default_factory=True)

    def checks(self) -> Iterator[Check]:
        choices = _choices(self.value_type)
        if choices:
            yield one_of(choices)
        if self.marker.check is not None:
            yield self.marker.check

    def problem(self, value: Any) -> str | None:
        """The first check's complaint about ``value`` (None: fine or unset)."""
        if value is None:
            return None
        for check in self.checks():
            problem = check(value)
            if problem:
                return problem
        return None


def setting_fields(model: type[BaseModel], group: str | None = None) -> tuple[SettingField, ...]:
    """The settings of ``model``, in declaration order."""
    out = []
    for name, info in model.model_fields.items():
        marker = next((m for m in info.metadata if isinstance(m, Setting)), Setting())
        out.append(SettingField(group, name, info, marker))
    return tuple(out)


def check_value(field: SettingField, value: Any, source: str) -> None:
    """ConfigError ``"<source> <problem>, got <value>"`` when a check rejects ``value``."""
    problem = field.problem(value)
    if problem:
        raise ConfigError(f"{source} {problem}, got {value!r}")


def parse_text(field: SettingField, text: str, source: str) -> Any:
    """``text`` (a flag's, a variable's or a TOML value) as ``field``'s value, checked;
    ConfigError naming ``source`` and the text otherwise."""
    kind = field.value_type
    try:
        value = _parse(kind, text)
    except ValueError:
        raise ConfigError(
            f"{source} must be {_KIND_NAMES.get(get_origin(kind) or kind, 'valid')}, got {text!r}"
        ) from None
    problem = field.problem(value)
    if problem:
        raise ConfigError(f"{source} {problem}, got {text!r}")
    return value


def _parse(kind: Any, text: str) -> Any:
    if get_origin(kind) is dict:
        return _parse_mapping(text)
    if kind is int:
        return int(text.strip())
    if kind is float:
        return float(text.strip())
    if kind is bool:
        lowered = text.strip().lower()
        if lowered not in ("true", "false", "1", "0"):
            raise ValueError(text)
        return lowered in ("true", "1")
    if kind is Path:
        if not text.strip():
            raise ValueError("empty path")  # Path("") would be the current directory
        return Path(text).expanduser()
    if get_origin(kind) is tuple:
        names = tuple(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
        return tuple(dict.fromkeys(map(int, names))) if _items(kind) is int else names
    return text


def _items(kind: Any) -> Any:
    """The item type of ``tuple[X, ...]``."""
    return get_args(kind)[0] if get_args(kind) else str


def _parse_mapping(text: str) -> dict[str, str]:
    """A table from text: a JSON object, or ``KEY=VALUE`` items separated by commas."""
    if text.strip().startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            raise ValueError(text) from None
        if not isinstance(data, dict):
            raise ValueError(text)
        return {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in data.items()}
    out: dict[str, str] = {}
    for item in filter(str.strip, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(text)
        out[key.strip()] = value
    return out


_METAVARS: Final[Mapping[Any, str]] = {
    int: "INT",
    float: "NUMBER",
    Path: "PATH",
    str: "TEXT",
}

_KIND_NAMES: Final[Mapping[Any, str]] = {
    int: "an integer",
    float: "a number",
    bool: "true or false",
    Path: "a non-empty path",
    dict: "KEY=VALUE[,KEY=VALUE...] or a JSON object",
    tuple: "comma-separated integers",
}


def _without_none(annotation: Any) -> Any:
    if get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    if get_origin(annotation) in (Union, types.UnionType):
        rest = [a for a in get_args(annotation) if a is not type(None)]
        if len(rest) == 1:
            return _without_none(rest[0])
    return annotation


def _choices(kind: Any) -> tuple[str, ...]:
    if get_origin(kind) is Literal:
        return tuple(map(str, get_args(kind)))
    return ()


class TaskSettings(BaseModel):
    """The settings a built-in task declares as flags of their own (each also a
    ``--task-arg NAME=VALUE``): a task owns its settings. Its ``recommended`` fields are
    among what a server recommends (``Profile.task_args``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    spec: ClassVar[str]
    """The ``--task`` these settings belong to."""

    @classmethod
    def complete(cls, args: Mapping[str, str], *, evaluated: bool) -> dict[str, str]:
        """The task's arguments once resolved; ``evaluated``: the run evaluates the
        task's held-out problems (``--eval-every``)."""
        return dict(args)


# --------------------------------------------------------------------------- checks


def positive(v: Any) -> str | None:
    return None if v > 0 else "must be positive"


def non_negative(v: Any) -> str | None:
    return None if v >= 0 else "must be >= 0"


def finite_positive(v: Any) -> str | None:
    return None if math.isfinite(v) and v > 0 else "must be a positive number"


def finite_non_negative(v: Any) -> str | None:
    return None if math.isfinite(v) and v >= 0 else "must be a number >= 0"


@dataclass(frozen=True)
class _OneOf:
    """A check of choices that ``--help`` can list."""

    choices: tuple[str, ...]

    def __call__(self, v: Any) -> str | None:
        return None if v in self.choices else f"must be one of {', '.join(self.choices)}"


def one_of(choices: tuple[str, ...]) -> Check:
    return _OneOf(choices)


def non_empty(v: Any) -> str | None:
    return None if str(v).strip() else "must not be empty"


def seed(v: Any) -> str | None:
    return None if 0 <= v <= MAX_SEED else f"must be an integer in 0..{MAX_SEED} (2^63-1)"


def http_url(example: str) -> Check:
    def check(v: Any) -> str | None:
        problem = "must be an http:// or https:// URL with a host, e.g. " + example
        try:
            parts = urllib.parse.urlsplit(str(v).strip())
            parts.port  # noqa: B018  # raises ValueError for a port that is not a number
        except ValueError:
            return problem
        return None if parts.scheme in ("http", "https") and parts.hostname else problem

    return check
