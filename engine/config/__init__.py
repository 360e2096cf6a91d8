"""Every setting of a run, declared once as nested pydantic models
(:mod:`engine.config.models`), and everything generated from them: flags, environment
variables, TOML files, resume rules (:mod:`engine.config.sources`,
:mod:`engine.config.given`, :mod:`engine.config.records`), the server's recommended defaults
(:mod:`engine.config.profile`) and what a run needs installed
(:mod:`engine.config.installed`)."""

from engine.common.setting import MAX_SEED, Setting
from engine.config.installed import check_installed
from engine.config.models import GROUPS, EngineConfig, all_settings
from engine.config.profile import HOSTED_PROFILE, Profile, server_profile
from engine.config.records import nest_record, resume_rule
from engine.config.sources import (
    add_setting_arguments,
    config_from_sources,
    parse_task_args,
    read_config_file,
    stored_settings,
    with_stored_settings,
)
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

__all__ = [
    "GROUPS",
    "HOSTED_BASE_URL",
    "HOSTED_PROFILE",
    "LOSSES",
    "MAX_SEED",
    "SDKS",
    "TINKER_ONLY_LOSSES",
    "EngineConfig",
    "LogFormat",
    "LogLevel",
    "LossName",
    "OnRewardError",
    "Profile",
    "Setting",
    "add_setting_arguments",
    "all_settings",
    "check_installed",
    "config_from_sources",
    "nest_record",
    "parse_task_args",
    "read_config_file",
    "resume_rule",
    "server_profile",
    "stored_settings",
    "with_stored_settings",
]
