"""What a config needs of this environment: the extras and the SDK generation its
settings use. Not part of a config's validation (a config is a value, the same on every
machine): a run checks it before anything starts (the CLI's parse, and
:func:`engine.engine.prepare_run` for an embedded run)."""

from __future__ import annotations

from engine.common.extras import require
from engine.common.sdks import choose_sdk
from engine.config.models import EngineConfig
from engine.config.values import TINKER_ONLY_LOSSES
from engine.errors import ConfigError

__all__ = ["check_installed"]


def check_installed(config: EngineConfig) -> None:
    """ConfigError (one line, exit 2) when this environment lacks what ``config`` uses:
    the local server's extra, a tracker's, the SDK a loss or MinT's rollout correction
    is sent by."""
    if config.session.local:
        require("local", "the local server (no MINT_API_KEY set, or --local)")
    for tracker in config.logging.log_to:
        require(tracker, f"--log-to {tracker}")
    sdk = choose_sdk(config.session.sdk)
    training = config.training
    if training.loss in TINKER_ONLY_LOSSES and sdk != "tinker":
        raise ConfigError(
            f"--loss {training.loss} needs the tinker SDK (>= 0.38) and this "
            "environment has mint (tinker 0.22): pip install 'engine[tinker]' in an "
            "environment of its own"
        )
    if training.rollout_correction != "off" and sdk != "mint":
        raise ConfigError(
            f"--rollout-correction {training.rollout_correction} is MinT's and only "
            "the mint SDK sends it (tinker 0.38 has no way to add it to create_model)"
        )
