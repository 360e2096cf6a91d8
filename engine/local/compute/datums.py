"""Validate training datums and pack them into padded micro-batches.

Validation lives here so that every user mistake (missing or misaligned loss inputs,
token ids outside the vocabulary, over-long sequences, NaNs) is reported with the datum
index and the field name before any compute runs, instead of surfacing as a shape error
deep inside torch.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

Tensor = torch.Tensor

_FLOAT_KEYS = ("weights", "logprobs", "advantages", "sequence_ratio_mask", "stability_mask")


class DatumError(ValueError):
    """A datum the backend cannot train on; the message names the datum and field."""


@dataclass(frozen=True)
class CheckedDatum:
    tokens: Tensor  # (N,) int64
    inputs: dict[str, Tensor]  # target_tokens int64 (N,), float keys float32 (N,)

    @property
    def length(self) -> int:
        return int(self.tokens.shape[0])


def _as_1d(i: int, key: str, value: object, n: int) -> Tensor:
    if not isinstance(value, Tensor):
        raise DatumError(
            f"datum {i}: loss input {key!r} must be a tensor, got {type(value).__name__}"
        )
    t = value.reshape(-1) if value.dim() != 1 and value.numel() == n else value
    if t.dim() != 1 or t.shape[0] != n:
        raise DatumError(
            f"datum {i}: loss input {key!r} has shape {tuple(value.shape)} but model_input has "
            f"{n} tokens; every loss input needs exactly one entry per model_input token"
        )
    return t


class DatumLike(Protocol):
    """A decoded datum: the flattened model_input and the dense loss inputs."""

    @property
    def tokens(self) -> Sequence[int]: ...
    @property
    def inputs(self) -> dict[str, Tensor]: ...


@dataclass
class _Column:
    """One loss input across a request: the datums that have it, and their values."""

    owners: list[int] = field(default_factory=list)
    parts: list[Tensor] = field(default_factory=list)


def check_data(
    data: Sequence[DatumLike], required: Sequence[str], *, vocab: int, max_len: int
) -> list[CheckedDatum]:
    """Validate every datum of a request and return them as tensors. Lengths, keys and
    shapes are checked datum by datum; token ids and float values over the whole request
    at once (a pass per datum costs more than training the small default model)."""
    lengths: list[int] = []
    columns: dict[str, _Column] = {}
    for i, d in enumerate(data):
        n = len(d.tokens)
        if n == 0:
            raise DatumError(f"datum {i}: model_input is empty")
        if n > max_len:
            raise DatumError(
                f"datum {i}: model_input has {n} tokens, more than the model's max context "
                f"length {max_len}"
            )
        missing = [k for k in required if k not in d.inputs]
        if missing:
            raise DatumError(
                f"datum {i}: missing loss input(s) {missing}; this loss needs {list(required)}"
            )
        lengths.append(n)
        for key, value in d.inputs.items():
            if key != "target_tokens" and key not in _FLOAT_KEYS:
                continue  # not used by any loss: accepted and ignored, like the hosted service
            t = _as_1d(i, key, value, n)
            if key == "target_tokens" and (
                t.is_floating_point() or t.is_complex() or t.dtype == torch.bool
            ):
                raise DatumError(f"datum {i}: target_tokens must be integers, got dtype {t.dtype}")
            column = columns.setdefault(key, _Column())
            column.owners.append(i)
            column.parts.append(t)
    tokens = _token_ids(data, lengths, vocab)
    inputs: list[dict[str, Tensor]] = [{} for _ in data]
    for key, column in columns.items():
        sizes = [lengths[i] for i in column.owners]
        if key == "target_tokens":
            flat = torch.cat(column.parts).to(torch.long)
            _check_ids(flat, "target_tokens", vocab, column.owners, sizes)
        else:
            flat = torch.cat(column.parts).to(torch.float32)
            finite = torch.isfinite(flat)
            if not bool(finite.all()):
                bad = column.owners[_datum_at(int((~finite).int().argmax()), sizes)]
                raise DatumError(f"datum {bad}: loss input {key!r} contains NaN or infinity")
        for i, part in zip(column.owners, flat.split(sizes), strict=True):
            inputs[i][key] = part
    return [CheckedDatum(tok, inp) for tok, inp in zip(tokens, inputs, strict=True)]


def _token_ids(data: Sequence[DatumLike], lengths: list[int], vocab: int) -> list[Tensor]:
    """Each datum's model_input as an int64 tensor, every id checked."""
    try:
        flat = torch.tensor([t for d in data for t in d.tokens], dtype=torch.long)
    except (TypeError, ValueError, OverflowError):  # not an int64: find it for the message
        for i, d in enumerate(data):
            for t in d.tokens:
                if not (isinstance(t, int) and 0 <= t < vocab):
                    raise DatumError(
                        f"datum {i}: model_input contains token id {t!r}, outside the "
                        f"model's vocabulary [0, {vocab})"
                    ) from None
        raise
    _check_ids(flat, "model_input", vocab, range(len(data)), lengths)
    return list(flat.split(lengths))


def _check_ids(
    ids: Tensor, what: str, vocab: int, owners: Sequence[int], sizes: Sequence[int]
) -> None:
    """``ids`` holds the datums ``owners`` one after another, ``sizes`` ids each."""
    outside = (ids < 0) | (ids >= vocab)
    if bool(outside.any()):
        at = int(outside.int().argmax())
        raise DatumError(
            f"datum {owners[_datum_at(at, sizes)]}: {what} contains token id {int(ids[at])}, "
            f"outside the model's vocabulary [0, {vocab})"
        )


def _datum_at(index: int, sizes: Sequence[int]) -> int:
    """Which of consecutive runs of ``sizes`` elements holds element ``index``."""
    return bisect.bisect_right(list(itertools.accumulate(sizes)), index)


def micro_batches(data: Sequence[CheckedDatum], vocab: int, budget: int) -> list[list[int]]:
    """Split datum indices (in order) so each padded batch's logits stay under ``budget``
    elements; a single datum always forms a batch of its own if it alone is over."""
    batches: list[list[int]] = []
    cur: list[int] = []
    cur_max = 0
    for idx, d in enumerate(data):
        new_max = max(cur_max, d.length)
        if cur and new_max * (len(cur) + 1) * vocab > budget:
            batches.append(cur)
            cur, new_max = [], d.length
        cur.append(idx)
        cur_max = new_max
    if cur:
        batches.append(cur)
    return batches


@dataclass(frozen=True)
class PaddedBatch:
    """Datums right-padded to one width: token ids, target ids, a real-token mask, and
    the requested float loss inputs (zero on the padding), all (B, T)."""

    ids: Tensor
    targets: Tensor
    mask: Tensor
    inputs: dict[str, Tensor]


def pad_right(data: Sequence[CheckedDatum], pad_id: int, keys: Sequence[str] = ()) -> PaddedBatch:
    """Right-pad ``data`` (causal attention means real tokens never see the padding, so
    no attention mask is needed); ``keys`` names the loss inputs to pad alongside."""
    width = max(d.length for d in data)
    lengths = torch.tensor([d.length for d in data])
    mask = torch.arange(width)[None, :] < lengths[:, None]
    ids = torch.full((len(data), width), pad_id, dtype=torch.long)
    ids[mask] = torch.cat([d.tokens for d in data])
    targets = torch.zeros((len(data), width), dtype=torch.long)
    targets[mask] = torch.cat([d.inputs["target_tokens"] for d in data])
    inputs: dict[str, Tensor] = {}
    for key in keys:
        if key == "target_tokens":
            inputs[key] = targets
            continue
        padded = torch.zeros((len(data), width), dtype=torch.float32)
        padded[mask] = torch.cat([d.inputs[key] for d in data])
        inputs[key] = padded
    return PaddedBatch(ids, targets, mask, inputs)
