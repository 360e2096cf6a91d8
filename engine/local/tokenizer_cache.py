"""Make the served model's tokenizer loadable by its name, offline.

``SamplingClient.get_tokenizer()`` calls ``AutoTokenizer.from_pretrained(base_model)``
with the model NAME the sampler reports (e.g. "engine-local/tiny-arith"), which offline
only works if the local Hugging Face hub cache holds that name. The server therefore
files its tokenizer files in the hub cache under the served model's name, in the
cache's own layout (``models--org--name/refs/main`` -> ``snapshots/<hash>/``).

It never shadows a real model: an entry is written only where the cache has none of
that name or where an earlier server wrote it (marked by ``MARKER``). Aliases
(``--model-alias``, e.g. a hosted model's name) are never registered.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger("engine.local")

MARKER = ".engine-local-tokenizer"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "config.json",
)
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
    if repo.exists() and not (repo / MARKER).is_file():
        return None  # a real cached model of that name: leave it alone
    files = [model_dir / f for f in TOKENIZER_FILES if (model_dir / f).is_file()]
    digest = hashlib.sha1()
    for file in files:
        digest.update(file.name.encode())
        digest.update(file.read_bytes())
    revision = digest.hexdigest()
    snapshot = repo / "snapshots" / revision
    try:
        repo.mkdir(parents=True, exist_ok=True)
        (repo / MARKER).write_text(f"written by engine.local for {model_dir}\n")
        if not snapshot.is_dir():
            # A private temporary dir: servers starting at once (test workers) may file
            # the same tokenizer; the first rename wins and the others drop their copy.
            (repo / "snapshots").mkdir(exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{revision}.", dir=repo / "snapshots"))
            try:
                for file in files:
                    shutil.copyfile(file, tmp / file.name)
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
