"""Make the served model's tokenizer loadable by its name, offline.

``SamplingClient.get_tokenizer()`` calls ``AutoTokenizer.from_pretrained(base_model)``
with the model NAME the sampler reports (e.g. "engine-local/tiny-arith"), which offline
only works if the local Hugging Face hub cache holds that name. The server therefore
files its tokenizer files in the hub cache under the served model's name, in the
cache's own layout (``models--org--name/refs/main`` -> ``snapshots/<hash>/``).

The served model's aliases (``--model-alias``, e.g. a hosted model's name) are filed the
same way, so a client that loads its tokenizer by the name it asks for (tinker-cookbook)
works offline with an alias as with ``--model-name``.

It never shadows a real model: an entry is written only where the cache has none of
that name or where servers wrote all of it (``MARKER`` names the snapshots they wrote;
a real download beside them makes the entry the user's from then on).

``TrainingClient.get_tokenizer()`` loads the ``tokenizer_id`` that ``get_info`` gives: the
filed snapshot directory when there is one (its ``config.json`` may be lighter than the
model's, see :func:`filed_config`), else the model directory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

from engine.basemodels.catalogue import METADATA_FILE

log = logging.getLogger("engine.local")

MARKER = ".engine-local-tokenizer"
TOKENIZER_CONFIG = "tokenizer_config.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    TOKENIZER_CONFIG,
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
)
MODEL_CONFIG = "config.json"
"""Filed beside the tokenizer: ``AutoTokenizer`` reads it (see :func:`filed_config`)."""
GENERIC_TOKENIZER = "TokenizersBackend"
_REVISION = "revision "
"""How ``MARKER`` names a snapshot a server wrote (one line each)."""
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


def register_tokenizer(name: str, model_dir: Path, cache_dir: Path | None = None) -> Path | None:
    """File ``model_dir``'s tokenizer in the hub cache as ``name``; return the snapshot
    directory, or None when ``name`` is not a hub id or a real entry of that name exists."""
    if not _HUB_ID.fullmatch(name) or ".." in name:
        return None
    if cache_dir is None:
        from huggingface_hub import constants

        cache_dir = Path(constants.HF_HUB_CACHE)
    repo = cache_dir / f"models--{name.replace('/', '--')}"
    written = _written(repo)
    if repo.exists() and written is None:
        log.warning(
            "the hub cache holds a model named %s: a client that loads its tokenizer by "
            "that name gets that model's, not the served one's",
            name,
        )
        return None
    files = {f: (model_dir / f).read_bytes() for f in TOKENIZER_FILES if (model_dir / f).is_file()}
    config = filed_config(model_dir, files.get(TOKENIZER_CONFIG))
    if config is not None:
        files[MODEL_CONFIG] = config
    digest = hashlib.sha1()
    for file_name, content in files.items():
        digest.update(file_name.encode())
        digest.update(content)
    revision = digest.hexdigest()
    snapshot = repo / "snapshots" / revision
    try:
        repo.mkdir(parents=True, exist_ok=True)
        revisions = "".join(f"{_REVISION}{r}\n" for r in sorted({*(written or ()), revision}))
        (repo / MARKER).write_text(f"written by engine.local for {model_dir}\n{revisions}")
        if not snapshot.is_dir():
            # A private temporary dir: servers starting at once (test workers) may file
            # the same tokenizer; the first rename wins and the others drop their copy.
            (repo / "snapshots").mkdir(exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{revision}.", dir=repo / "snapshots"))
            try:
                for file_name, content in files.items():
                    (tmp / file_name).write_bytes(content)
                os.replace(tmp, snapshot)
            except OSError:
                if not snapshot.is_dir():
                    raise
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(revision)
    except OSError as exc:
        log.warning("cannot file the tokenizer in the hub cache %s: %s", cache_dir, exc)
        return None
    return snapshot


def _written(repo: Path) -> set[str] | None:
    """The snapshots of ``repo`` that servers wrote, when they wrote all of it (an
    entry that is not there: none); None when it is (also) the user's: no ``MARKER``,
    or a snapshot the marker does not name (a real download since). A marker of an
    older server names none: its snapshots are all its own."""
    marker = repo / MARKER
    if not repo.exists():
        return set()
    if not marker.is_file():
        return None
    snapshots = repo / "snapshots"
    present = (
        {p.name for p in snapshots.iterdir() if not p.name.startswith(".")}
        if snapshots.is_dir()
        else set()
    )
    lines = marker.read_text(errors="replace").splitlines()
    named = {line.removeprefix(_REVISION) for line in lines if line.startswith(_REVISION)}
    if not named:
        return present
    return named if present <= named else None


def filed_config(model_dir: Path, tokenizer_config: bytes | None) -> bytes | None:
    """The ``config.json`` filed with the tokenizer: the model's own, or for the engine's
    own models (``engine_model.json``) whose tokenizer is the generic ``TokenizersBackend``
    (built from ``tokenizer.json`` alone) one that names only that class.

    ``AutoTokenizer`` loads the config's model class to choose a tokenizer class; for a
    Llama config that imports ~1 s of modules a tokenizer never uses (activations, weight
    loading, ``torch.distributed``, ``accelerate``) in every client. A config without a
    model type is read as a generic one, and the declared class is used as it is. Other
    models keep their config: for a few model types transformers overrides the declared
    tokenizer class by it. ``tokenizer_config`` is the content of the model's
    ``tokenizer_config.json``, if it has one."""
    engine_made = (model_dir / METADATA_FILE).is_file()
    if engine_made and _declared_class(tokenizer_config) == GENERIC_TOKENIZER:
        return json.dumps({"tokenizer_class": GENERIC_TOKENIZER}).encode()
    own = model_dir / MODEL_CONFIG
    return own.read_bytes() if own.is_file() else None


def _declared_class(tokenizer_config: bytes | None) -> object:
    if tokenizer_config is None:
        return None
    try:
        declared = json.loads(tokenizer_config)
    except ValueError:
        return None
    return declared.get("tokenizer_class") if isinstance(declared, dict) else None
