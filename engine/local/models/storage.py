"""Where checkpoints live: ``tinker://`` paths <-> directories under the data dir.

``tinker://<model_id>/weights/<name>`` and ``tinker://<model_id>/sampler_weights/<name>``
map to ``<data_dir>/<model_id>/{weights,sampler_weights}/<name>/``. Because the mapping
depends only on the path, a new server process started on the same data dir can load
what an earlier (killed) process saved. Every component is checked against a strict
pattern so a client-supplied name can never escape the data dir.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Kind = Literal["weights", "sampler_weights"]
KINDS: tuple[Kind, ...] = ("weights", "sampler_weights")
SCHEME = "tinker://"
_COMPONENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_MODEL_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,191}")
"""Model ids may also hold ':': tinker 0.38 names a model it resumes from a checkpoint
itself, as ``<session_id>:train:<model_seq_id>``."""


class BadPath(ValueError):
    """A checkpoint name or tinker path is malformed or unsafe; the message says why."""


def check_name(name: str, what: str = "checkpoint name") -> str:
    """Accept letters, digits, '.', '_' and '-' (not leading, no '..', <= 128 chars)."""
    if not isinstance(name, str) or not name:
        raise BadPath(f"{what} must be a non-empty string")
    if name.startswith("/") or "\\" in name or "/" in name:
        raise BadPath(f"{what} {name!r} must be a plain name, not a path")
    if ".." in name or not _COMPONENT.fullmatch(name):
        raise BadPath(
            f"{what} {name!r} may only use letters, digits, '.', '_' and '-' "
            "(starting with a letter or digit, no '..', at most 128 characters)"
        )
    return name


def check_model_id(model_id: str, what: str = "model id") -> str:
    """Like ``check_name``, and ':' is allowed too (never '/', '\\' or '..')."""
    if not isinstance(model_id, str) or ".." in model_id or not _MODEL_ID.fullmatch(model_id):
        raise BadPath(
            f"{what} {model_id!r} may only use letters, digits, '.', '_', ':' and '-' "
            "(starting with a letter or digit, no '..', at most 192 characters)"
        )
    return model_id


@dataclass(frozen=True)
class TinkerPath:
    model_id: str
    kind: Kind
    name: str

    def __str__(self) -> str:
        return f"{SCHEME}{self.model_id}/{self.kind}/{self.name}"

    def directory(self, data_dir: Path) -> Path:
        return data_dir / self.model_id / self.kind / self.name

    @classmethod
    def parse(cls, text: str) -> TinkerPath:
        if not isinstance(text, str) or not text.startswith(SCHEME):
            raise BadPath(
                f"checkpoint path {text!r} must look like tinker://<model_id>/weights/<name> "
                "or tinker://<model_id>/sampler_weights/<name>"
            )
        parts = text[len(SCHEME) :].split("/")
        if len(parts) != 3 or parts[1] not in KINDS:
            raise BadPath(
                f"checkpoint path {text!r} must look like tinker://<model_id>/weights/<name> "
                "or tinker://<model_id>/sampler_weights/<name>"
            )
        model_id, kind, name = parts
        check_model_id(model_id, "model id in checkpoint path")
        check_name(name)
        return cls(model_id, kind, name)  # type: ignore[arg-type]


DATA_DIR_PLACEHOLDER = "<data dir>"


def hide_data_dir(message: str, data_dir: Path) -> str:
    """``message`` with the data dir's absolute path replaced by a placeholder, so errors
    sent to clients name checkpoints without revealing where the server keeps them."""
    for root in sorted({str(data_dir), str(data_dir.resolve())}, key=len, reverse=True):
        message = message.replace(root, DATA_DIR_PLACEHOLDER)
    return message
