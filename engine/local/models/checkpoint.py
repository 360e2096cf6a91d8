"""On-disk format of saved LoRA states and sampler snapshots (safetensors + JSON).

A checkpoint is a directory::

    meta.json                 format, kind ("state" | "sampler"), base model, LoRA spec
    adapter.safetensors       LoRA tensors keyed "<module path>.lora_A.weight", ...
    optimizer.safetensors     (states only) "exp_avg/<key>", "exp_avg_sq/<key>", "step/<key>"

Directories are written under a temporary name and renamed into place, so a crash never
leaves a half-written checkpoint that a later load would trust.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from safetensors.torch import load_file, save_file

FORMAT = "engine-local-lora/1"
_META = "meta.json"
_ADAPTER = "adapter.safetensors"
_OPTIM = "optimizer.safetensors"
MAX_META_BYTES = 64 * 1024


class CheckpointError(ValueError):
    """Missing, foreign or corrupt checkpoint directory."""


class Meta(BaseModel):
    """What ``meta.json`` may hold (as ``Backend._meta`` writes it); strict, because
    uploaded archives bring their own."""

    model_config = ConfigDict(strict=True, extra="forbid")

    format: str
    kind: Literal["state", "sampler"]
    base_model: str
    is_lora: Literal[True] = True
    lora_rank: int = Field(ge=1)
    lora_alpha: int | float | None = None
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True
    target_modules: list[str] = Field(min_length=1)
    seed: int | None = None
    optimizer_steps: int = Field(default=0, ge=0)


@dataclass(frozen=True)
class Checkpoint:
    meta: dict[str, Any]
    weights: dict[str, torch.Tensor]
    optimizer: dict[str, torch.Tensor] | None


def write(
    dest: Path,
    meta: dict[str, Any],
    weights: dict[str, torch.Tensor],
    optimizer: dict[str, torch.Tensor] | None = None,
) -> None:
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        save_file({k: v.detach().contiguous() for k, v in weights.items()}, str(tmp / _ADAPTER))
        if optimizer is not None:
            save_file({k: v.contiguous() for k, v in optimizer.items()}, str(tmp / _OPTIM))
        (tmp / _META).write_text(json.dumps({"format": FORMAT, **meta}, indent=2, sort_keys=True))
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def read_meta(src: Path) -> dict[str, Any]:
    """The checkpoint's metadata, checked against ``Meta``."""
    path = Path(src) / _META
    if not path.is_file():
        raise CheckpointError(f"{src} is not a saved checkpoint (no {_META})")
    try:
        if path.stat().st_size > MAX_META_BYTES:
            raise CheckpointError(f"{path} is larger than {MAX_META_BYTES} bytes")
        meta = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError, RecursionError) as e:  # ValueError: JSON or UTF-8
        raise CheckpointError(f"{path} is unreadable: {type(e).__name__}: {e}") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{src} is not a checkpoint of format {FORMAT}")
    try:
        Meta.model_validate(meta)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "meta"
        raise CheckpointError(f"{path}: {where}: {first['msg']}") from None
    return meta


def read(src: Path, *, optimizer: bool) -> Checkpoint:
    meta = read_meta(src)
    try:
        weights = load_file(str(Path(src) / _ADAPTER))
        opt = None
        if optimizer:
            opt_path = Path(src) / _OPTIM
            if not opt_path.is_file():
                raise CheckpointError(
                    f"{src} holds no optimizer state (it is a {meta.get('kind')!r} checkpoint)"
                )
            opt = load_file(str(opt_path))
    except CheckpointError:
        raise
    except Exception as e:  # safetensors raises several types for truncated/corrupt files
        raise CheckpointError(f"{src}: cannot read tensors: {e}") from e
    return Checkpoint(meta, weights, opt)
