"""The stop condition of the shipped environments: every reply ends at the model's EOS
(the format the packaged models were trained on), whatever ``--stop-at-eos`` says."""

from __future__ import annotations

import dataclasses

from engine.envs.types import EnvContext

__all__ = ["stop_at_eos"]


def stop_at_eos(context: EnvContext, max_tokens: int | None = None) -> EnvContext:
    """``context`` with the tokenizer's EOS among the stop tokens (and ``max_tokens``
    per reply when given)."""
    stop = context.stop
    eos = getattr(context.tokenizer, "eos_token_id", None)
    if isinstance(eos, int) and eos not in stop.stop_token_ids:
        stop = dataclasses.replace(stop, stop_token_ids=(*stop.stop_token_ids, eos))
    if max_tokens is not None:
        stop = dataclasses.replace(stop, max_tokens=max_tokens)
    return dataclasses.replace(context, stop=stop)
