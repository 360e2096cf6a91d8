"""The package layout keeps its layers: the local server imports nothing of the client,
and the shared basics (``engine.common``) import neither side; and each class name is
defined once in the engine package, so a name says which type it is."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict

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


def test_no_class_name_is_defined_twice_in_the_engine_package() -> None:
    defined: dict[str, list[str]] = defaultdict(list)
    for path in sorted((REPO / "engine").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                defined[node.name].append(f"{path.relative_to(REPO)}:{node.lineno}")
    twice = {name: places for name, places in defined.items() if len(places) > 1}
    assert twice == {}, f"class names defined more than once: {twice}"
