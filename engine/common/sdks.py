"""Which SDK generation a run talks through: ``mint`` (tinker 0.22 under mindlab-toolkit)
or ``tinker`` (tinker >= 0.38).

The two cannot share an environment (mindlab-toolkit pins tinker < 0.23), so ``auto``
(the default) picks the one that is installed, MinT first; ``--sdk`` / ``ENGINE_SDK``
names one and fails with one line when it is not installed. Either takes ``MINT_API_KEY``
or ``TINKER_API_KEY``. Found by package metadata, without importing an SDK; checked
when a config is made (:class:`~engine.config.EngineConfig`), before a run starts.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from typing import Final, Literal

from engine.errors import ConfigError

__all__ = ["SdkName", "available", "choose_sdk", "installed_tinker_version"]

SdkName = Literal["mint", "tinker"]
TINKER_MIN: Final = (0, 38)

_INSTALL = {
    "mint": "pip install 'engine[mint]' (MinT: mindlab-toolkit on tinker 0.22)",
    "tinker": "pip install 'engine[tinker]' (tinker >= 0.38)",
}


def installed_tinker_version() -> str | None:
    """The installed ``tinker`` distribution's version, or None."""
    try:
        return importlib.metadata.version("tinker")
    except importlib.metadata.PackageNotFoundError:
        return None


def _release(version: str) -> tuple[int, int]:
    major, _, rest = version.partition(".")
    minor = rest.split(".")[0]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def available() -> tuple[SdkName, ...]:
    """The SDK generations this environment can run, MinT first."""
    version = installed_tinker_version()
    if version is None or importlib.util.find_spec("tinker") is None:
        return ()
    if _release(version) >= TINKER_MIN:
        return ("tinker",)
    return ("mint",) if importlib.util.find_spec("mint") is not None else ()


def choose_sdk(requested: str) -> SdkName:
    """The adapter for ``requested`` (``auto``, ``mint`` or ``tinker``); ConfigError,
    one line, when it is not installed."""
    have = available()
    version = installed_tinker_version()
    found = f"this environment has tinker {version}" if version else "no SDK is installed"
    if requested == "auto":
        if have:
            return have[0]
        raise ConfigError(f"no SDK is installed: {_INSTALL['mint']} or {_INSTALL['tinker']}")
    if requested in have:
        return "mint" if requested == "mint" else "tinker"
    raise ConfigError(
        f"--sdk {requested} is not installed ({found}; the two SDK generations cannot share "
        f"an environment): {_INSTALL.get(requested, _INSTALL['mint'])}"
    )
