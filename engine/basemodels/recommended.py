"""What the served model is called and which RL settings the server recommends for it.

The settings of a run that depend on the model (learning rate, LoRA rank, the
arithmetic task's operation and operand range) belong to the model, so they are
recorded with it: the ``recommended_rl`` entry of its ``engine_model.json``
(:data:`~engine.basemodels.catalogue.METADATA_FILE`). The server adds them to the model's
entry in its ``get_server_capabilities`` answer, under
:data:`engine.common.protocol.RECOMMENDED_FIELD`; the SDK ignores the extra field, hosted MinT
does not send it, and the engine reads it to pick its defaults
(:func:`engine.config.server_profile`). This module reads metadata only (no torch, no
conversion), so the engine asks it about a model before a server starts on it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.basemodels.catalogue import model_metadata, resolve_packaged
from engine.common.protocol import RECOMMENDED_FIELD

__all__ = ["RECOMMENDED_KEY", "model_entry", "recommended_settings", "served_model_name"]

LOCAL_TEMPERATURE = 0.8
"""The sampling temperature the ``local`` service recommends (the quickstart's; with the
loss scored at it, the learning grid's winner: docs/losses.md). A hosted profile
recommends none, so a client takes the hosted default (``engine.config.profile``)."""
RECOMMENDED_KEY = "recommended_rl"
"""The key of a model's recommended RL settings in its ``engine_model.json``."""


def served_model_name(model: str | Path | None) -> str:
    """The base_model name a model (a directory, a packaged or pretrained model's name;
    None: the packaged model) is served under: its metadata's ``model_name``, else the
    directory's name."""
    name = model_metadata(model).get("model_name")
    return name if isinstance(name, str) and name else resolve_packaged(model).name


def recommended_settings(model: str | Path | None) -> dict[str, Any]:
    """The model's recommended RL settings (``learning_rate``, ``lora_rank``,
    ``task_args`` per task); empty when its metadata records none."""
    settings = model_metadata(model).get(RECOMMENDED_KEY)
    return dict(settings) if isinstance(settings, dict) else {}


def model_entry(
    model: str | Path | None,
    *,
    name: str | None = None,
    max_context: int | None = None,
    tempered_logprobs: bool = True,
    service: str = "local",
) -> dict[str, Any]:
    """The ``supported_models`` entry of a server on ``model`` (a directory, a packaged
    or pretrained model's name; None: the packaged model): its name, context length
    when known, and :data:`RECOMMENDED_FIELD`. The field is there even when the model
    records no settings, so a client can tell this server from hosted MinT. Beside the
    model's settings it recommends the server's own ``loss_temperature``: ``sampling``
    when it reports tempered sampling logprobs (its losses then score at the sampling
    temperature and an on-policy ratio is 1), else ``off`` (docs/losses.md, "Which
    default, and why"). A hosted profile (``service`` other than ``local``,
    docs/local-server.md "Service profiles") refuses that loss option, so it recommends
    ``off``; ``service`` names the profile."""
    model = model or None
    entry: dict[str, Any] = {"model_name": name or served_model_name(model)}
    if max_context is not None:
        entry["max_context_length"] = max_context
    local_options = tempered_logprobs and service == "local"
    entry[RECOMMENDED_FIELD] = {
        **recommended_settings(model),
        "loss_temperature": "sampling" if local_options else "off",
        "service": service,
    }
    if service == "local":
        entry[RECOMMENDED_FIELD]["temperature"] = LOCAL_TEMPERATURE
    return entry
