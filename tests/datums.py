"""Datums as plain data, for comparing what the engine and the quickstart send."""

from __future__ import annotations

from typing import Any


def model_input_tokens(datum: Any) -> list[int]:
    """The input tokens of a datum, the engine's or the SDK's."""
    tokens = datum.model_input
    to_ints = getattr(tokens, "to_ints", None)
    return to_ints() if to_ints is not None else [int(t) for t in tokens]


def datum_to_dict(datum: Any) -> dict[str, list[int] | list[float]]:
    """A plain, comparable view of a datum, the engine's or the SDK's."""
    out: dict[str, list[int] | list[float]] = {"model_input": model_input_tokens(datum)}
    for key, value in sorted(datum.loss_fn_inputs.items()):
        out[key] = value.tolist()
    return out
