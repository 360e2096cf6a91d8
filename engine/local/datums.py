"""Validate training datums and pack them into padded micro-batches.

Validation lives here so that every user mistake (missing or misaligned loss inputs,
token ids outside the vocabulary, over-long sequences, NaNs) is reported with the datum
index and the field name before any compute runs, instead of surfacing as a shape error
deep inside torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

Tensor = torch.Tensor

_FLOAT_KEYS = ("weights", "logprobs", "advantages", "sequence_ratio_mask")


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


def _check_ids(i: int, what: str, ids: Tensor, vocab: int) -> None:
    if ids.numel() == 0:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab:
        bad = lo if lo < 0 else hi
        raise DatumError(
            f"datum {i}: {what} contains token id {bad}, outside the vocabulary [0, {vocab})"
        )


def check_datum(
    i: int,
    tokens: Sequence[int],
    inputs: dict[str, Tensor],
    required: Sequence[str],
    *,
    vocab: int,
    max_len: int,
) -> CheckedDatum:
    n = len(tokens)
    if n == 0:
        raise DatumError(f"datum {i}: model_input is empty")
    if n > max_len:
        raise DatumError(
            f"datum {i}: model_input has {n} tokens, more than the model's max context "
            f"length {max_len}"
        )
    tok = torch.tensor(list(tokens), dtype=torch.long)
    _check_ids(i, "model_input", tok, vocab)
    missing = [k for k in required if k not in inputs]
    if missing:
        raise DatumError(
            f"datum {i}: missing loss input(s) {missing}; this loss needs {list(required)}"
        )
    checked: dict[str, Tensor] = {}
    for key, value in inputs.items():
        if key != "target_tokens" and key not in _FLOAT_KEYS:
            continue  # not used by any loss: accepted and ignored, like the hosted service
        t = _as_1d(i, key, value, n)
        if key == "target_tokens":
            if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
                raise DatumError(f"datum {i}: target_tokens must be integers, got dtype {t.dtype}")
            t = t.to(torch.long)
            _check_ids(i, "target_tokens", t, vocab)
        else:
            t = t.to(torch.float32)
            if not bool(torch.isfinite(t).all()):
                raise DatumError(f"datum {i}: loss input {key!r} contains NaN or infinity")
        checked[key] = t
    return CheckedDatum(tok, checked)


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
