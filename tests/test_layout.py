"""The package layout keeps its layers: the local server imports nothing of the client,
and the shared basics (``engine.common``) import neither side."""

from __future__ import annotations

import subprocess
import sys

from tests.hosted_env import REPO

CHECK = """
import importlib, pkgutil, sys
import engine.local
for info in pkgutil.walk_packages(engine.local.__path__, "engine.local."):
    if not info.name.endswith("__main__"):
        importlib.import_module(info.name)
import engine.local.__main__
allowed = ("engine.local", "engine.common")
loaded = sorted(
    m for m in sys.modules
    if m.startswith("engine.") and not m.startswith(allowed)
)
print(",".join(loaded))
"""


def test_the_local_server_imports_nothing_of_the_client() -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHECK], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "", f"engine.local loads client modules: {done.stdout}"


def test_the_shared_basics_import_neither_side() -> None:
    code = (
        "import sys, engine.common.cli, engine.common.extras, engine.common.protocol;"
        "print(','.join(m for m in sys.modules if m.startswith('engine.')"
        " and not m.startswith('engine.common')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ""
