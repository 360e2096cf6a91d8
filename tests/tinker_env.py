"""The tinker >= 0.38 environment the tests run SDK subprocesses in: ``.venv-tinker``
(``scripts/bootstrap_tinker.sh``). Without it a test is skipped, except under CI (the
``CI`` environment variable set), where a missing environment is a failure: CI creates it
(``.ci/run``), so its absence means the matrix silently shrank."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TINKER_PYTHON = REPO / ".venv-tinker" / "bin" / "python"


def tinker_python() -> Path:
    """``.venv-tinker``'s interpreter; skips the test (fails it under CI) without it."""
    if not TINKER_PYTHON.is_file():
        reason = (
            "no .venv-tinker with the tinker 0.38 SDK: create it with scripts/bootstrap_tinker.sh"
        )
        if os.environ.get("CI"):
            pytest.fail(f"CI is set but there is {reason}")
        pytest.skip(reason)
    return TINKER_PYTHON
