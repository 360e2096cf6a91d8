"""``python -m engine.export CHECKPOINT --format peft|merged --out DIR``: a trained LoRA
as a PEFT adapter directory, or merged into full Hugging Face weights.

CHECKPOINT is a run directory, a checkpoint directory or a ``tinker://`` path
(:mod:`engine.checkpoint_files`). ``peft`` writes ``adapter_config.json`` +
``adapter_model.safetensors`` (load with ``PeftModel.from_pretrained(base, DIR)``);
``merged`` writes the base model with the LoRA delta folded in, plus its tokenizer
(load with ``AutoModelForCausalLM.from_pretrained(DIR)``). The base model is the one the
checkpoint's ``meta.json`` names (the packaged model, a ``--model`` of the local server,
a Hugging Face id), or ``--base-model``. ``adapter_config.json`` names it by that model
id (with ``--revision``, or the checkpoint's ``base_model_revision``, when known), never
by a path of this machine, so the adapter loads elsewhere; ``--base-path DIR`` records
(and loads from) a local directory instead. Needs the ``local`` extra (torch, peft).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from engine.basemodels.catalogue import (
    AGENT_MODEL_DIR,
    CODE_MODEL_DIR,
    DEFAULT_MODEL_DIR,
    PRETRAINED,
    model_directory,
)
from engine.basemodels.recommended import served_model_name
from engine.checkpoint_files import checkpoint_directory, resolve_checkpoint
from engine.common.cli import OneLineErrorParser, add_version_flag, program_name
from engine.common.extras import require
from engine.errors import ConfigError

__all__ = ["BaseModelRef", "ExportFormat", "base_model_source", "export_checkpoint", "main"]

ExportFormat = Literal["peft", "merged"]
ADAPTER_FILE = "adapter.safetensors"
PEFT_PREFIX = "base_model.model."
"""What PEFT puts before a module path in an adapter file's keys."""


def base_model_source(name: str) -> str:
    """Where the base model ``name`` (a checkpoint's ``base_model``) loads from: the
    packaged model's directory, a converted local-server model's, else ``name`` itself
    (a Hugging Face id)."""
    for packaged in (DEFAULT_MODEL_DIR, AGENT_MODEL_DIR, CODE_MODEL_DIR):
        if name == served_model_name(packaged):
            return str(packaged)
    for short, spec in PRETRAINED.items():
        if name == spec.model_name:
            return str(model_directory(short))
    return name


@dataclass(frozen=True)
class BaseModelRef:
    """The base model of an export: ``name`` (what ``adapter_config.json`` records),
    ``revision`` (recorded with it; None: unknown) and ``source`` (where its weights
    load from, for ``merged``)."""

    name: str
    source: str
    revision: str | None = None

    @classmethod
    def of(
        cls,
        meta: dict[str, Any],
        *,
        base_model: str | None = None,
        base_path: Path | None = None,
        revision: str | None = None,
    ) -> BaseModelRef:
        """The checkpoint's base model (``meta``), or ``base_model``; ``base_path``: a
        local directory, recorded as it is (the explicit choice of a path)."""
        if base_path is not None:
            if not base_path.is_dir():
                raise ConfigError(f"--base-path {base_path} is not a directory")
            path = str(base_path.resolve())
            return cls(path, path, revision)
        name = base_model or str(meta["base_model"])
        known = revision or meta.get("base_model_revision")
        return cls(name, base_model_source(name), str(known) if known else None)


def _read_meta(directory: Path) -> dict[str, Any]:
    meta = json.loads((directory / "meta.json").read_text(encoding="utf-8"))
    keys = ("base_model", "lora_rank", "lora_alpha", "target_modules")
    missing = [k for k in keys if k not in meta]
    if missing or not (directory / ADAPTER_FILE).is_file():
        raise ConfigError(
            f"{directory} is not an engine LoRA checkpoint "
            f"({'meta.json lacks ' + ', '.join(missing) if missing else 'no ' + ADAPTER_FILE})"
        )
    return dict(meta)


def write_peft_adapter(checkpoint: Path, out: Path, base: BaseModelRef) -> dict[str, Any]:
    """Write ``checkpoint`` as a PEFT adapter directory in ``out`` naming ``base``;
    return its meta."""
    from peft import LoraConfig
    from safetensors.torch import load_file, save_file

    meta = _read_meta(checkpoint)
    tensors = load_file(str(checkpoint / ADAPTER_FILE))
    out.mkdir(parents=True, exist_ok=True)
    save_file(
        {PEFT_PREFIX + key: value.contiguous() for key, value in tensors.items()},
        str(out / "adapter_model.safetensors"),
        metadata={"format": "pt"},
    )
    LoraConfig(
        r=int(meta["lora_rank"]),
        lora_alpha=int(meta["lora_alpha"]),
        lora_dropout=0.0,
        bias="none",
        target_modules=list(meta["target_modules"]),
        base_model_name_or_path=base.name,
        revision=base.revision,
        task_type="CAUSAL_LM",
    ).save_pretrained(str(out))
    return meta


def write_merged(checkpoint: Path, out: Path, base: BaseModelRef) -> dict[str, Any]:
    """Write the base model with ``checkpoint``'s LoRA folded in (float32) to ``out``."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(base.source, dtype=torch.float32)
    output = model.get_output_embeddings()
    weight = getattr(output, "weight", None)
    if isinstance(weight, torch.Tensor) and weight is model.get_input_embeddings().weight:
        # Merging a LoRA on the unembedding must not change the tied input embedding.
        output.weight = torch.nn.Parameter(weight.detach().clone())
        model.config.tie_word_embeddings = False
    with tempfile.TemporaryDirectory(prefix="engine-export-") as tmp:
        meta = write_peft_adapter(checkpoint, Path(tmp), base)
        merged = PeftModel.from_pretrained(model, tmp).merge_and_unload()
    out.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(str(out))
    AutoTokenizer.from_pretrained(base.source).save_pretrained(str(out))
    return meta


def export_checkpoint(
    checkpoint: Path,
    out: Path,
    fmt: ExportFormat,
    *,
    base_model: str | None = None,
    base_path: Path | None = None,
    revision: str | None = None,
) -> dict[str, Any]:
    """Export the checkpoint directory ``checkpoint`` to ``out`` (written under a temporary
    name and renamed into place); return its meta. The base model: see
    :meth:`BaseModelRef.of`."""
    meta = _read_meta(checkpoint)
    base = BaseModelRef.of(meta, base_model=base_model, base_path=base_path, revision=revision)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"--out {out} exists and is not empty")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        writer = write_peft_adapter if fmt == "peft" else write_merged
        writer(checkpoint, staging, base)
        if out.exists():
            out.rmdir()
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return meta


def _parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog=program_name("engine.export", "engine-export"),
        description="Export a trained LoRA checkpoint as a PEFT adapter or merged weights.",
    )
    parser.add_argument("checkpoint", help="run dir, checkpoint dir or tinker:// path")
    parser.add_argument("--format", choices=("peft", "merged"), default="peft")
    parser.add_argument("--out", type=Path, required=True, help="directory to write")
    parser.add_argument("--step", type=int, help="a run dir's checkpoint of this step")
    parser.add_argument("--data-dir", type=Path, help="a local server's data dir")
    parser.add_argument(
        "--base-model",
        metavar="ID",
        help="the base model's id, recorded in adapter_config.json (default: the one the "
        "checkpoint names)",
    )
    parser.add_argument(
        "--revision", help="the base model's revision, recorded with its id (default: unknown)"
    )
    parser.add_argument(
        "--base-path",
        type=Path,
        metavar="DIR",
        help="record (and load) the base model as this local directory instead of its id",
    )
    parser.add_argument("--base-url", help="the server to download a tinker:// path from")
    add_version_flag(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        require("local", "python -m engine.export")
        ref = resolve_checkpoint(args.checkpoint, step=args.step, data_dir=args.data_dir)
        with checkpoint_directory(
            ref, base_url=args.base_url, api_key=os.environ.get("MINT_API_KEY")
        ) as directory:
            meta = export_checkpoint(
                directory,
                args.out,
                args.format,
                base_model=args.base_model,
                base_path=args.base_path,
                revision=args.revision,
            )
    except ConfigError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return 2
    what = "PEFT adapter" if args.format == "peft" else "merged model"
    print(
        f"Wrote the {what} of {args.checkpoint} (base {meta['base_model']}, "
        f"rank {meta['lora_rank']}, {meta.get('optimizer_steps', '?')} steps) to {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
