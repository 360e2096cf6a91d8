"""The optional parts of the package (pyproject's extras) and the one-line message that
says how to install a missing one.

The core package with an SDK extra (``mint`` or ``tinker``: :mod:`engine.common.sdks`
says which is installed) is what a hosted user needs. The local
server (torch, peft, FastAPI), the report pictures (matplotlib), the experiment
trackers (wandb, tensorboard), Hugging Face datasets (``--task hf:PATH``) and Ray
(``--score-workers ray:N``) are extras. Whether an extra is installed is decided by
finding its modules, without importing them (torch alone takes seconds). This module
imports nothing heavy itself: the local server's command line uses it before anything.
"""

from __future__ import annotations

import importlib.util
from typing import Final, Literal

__all__ = ["EXTRA_MODULES", "Extra", "missing", "missing_message", "require"]

Extra = Literal["local", "report", "wandb", "tensorboard", "datasets", "ray"]

EXTRA_MODULES: Final[dict[Extra, tuple[str, ...]]] = {
    # transformers, tokenizers and safetensors come with either SDK (tinker) anyway
    "local": ("torch", "peft", "accelerate", "fastapi", "uvicorn", "jwt"),
    "report": ("matplotlib",),
    "wandb": ("wandb",),
    "tensorboard": ("tensorboard",),
    "datasets": ("datasets",),
    "ray": ("ray",),
}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def missing(extra: Extra) -> list[str]:
    """The modules of ``extra`` that cannot be found (empty: it is installed)."""
    return [m for m in EXTRA_MODULES[extra] if not _installed(m)]


def missing_message(extra: Extra, feature: str) -> str | None:
    """None when ``extra`` is installed, else the line naming what is missing and how to
    install it."""
    absent = missing(extra)
    if not absent:
        return None
    return (
        f"{feature} needs the '{extra}' extra ({', '.join(absent)} not installed): "
        f"pip install 'engine[{extra}]'"
    )


def require(extra: Extra, feature: str) -> None:
    """Raise ConfigError (exit code 2) with :func:`missing_message` if ``extra`` is not
    installed."""
    message = missing_message(extra, feature)
    if message is not None:
        from engine.errors import ConfigError  # imports the SDK: only when needed

        raise ConfigError(message)
