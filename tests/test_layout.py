"""The package layout keeps its layers: the local server loads nothing of the client but
the foundation (tests/test_layers.py), and the shared basics (``engine.common``,
``engine.basemodels``) import neither side; each class name is
defined once in the engine package, so a name says which type it is; no module is
longer than a reader can hold (600 lines); and no stage, pipeline or supervisor
constructor takes more than 7 parameters."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict

import pytest

from tests.hosted_env import REPO
from tests.test_layers import BESIDE, FOUNDATION

CHECK = """
import importlib, pkgutil, sys
import engine.local
for info in pkgutil.walk_packages(engine.local.__path__, "engine.local."):
    if not info.name.endswith("__main__"):
        importlib.import_module(info.name)
import engine.local.__main__
allowed = tuple(sys.argv[1:])
loaded = sorted(
    m for m in sys.modules
    if m.startswith("engine.") and not m.startswith(allowed)
)
print(",".join(loaded))
"""


def test_the_local_server_imports_nothing_of_the_client() -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHECK, BESIDE, *FOUNDATION],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "", f"engine.local loads client modules: {done.stdout}"


def test_the_shared_basics_import_neither_side() -> None:
    code = (
        "import sys, engine.common.cli, engine.common.extras, engine.common.protocol,"
        " engine.common.net, engine.basemodels.catalogue, engine.basemodels.recommended;"
        "print(','.join(m for m in sys.modules if m.startswith('engine.')"
        " and not m.startswith(('engine.common', 'engine.basemodels'))))"
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


MAX_MODULE_LINES = 600
"""A module longer than this is split by job (issue 42)."""
LONG_LEFT: tuple[str, ...] = ()
"""Folders whose split is still under way (issue 42's config work)."""


def test_no_engine_module_is_over_600_lines() -> None:
    long = {
        str(path.relative_to(REPO)): lines
        for path in sorted((REPO / "engine").rglob("*.py"))
        if (lines := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
        and not str(path.relative_to(REPO)).startswith(LONG_LEFT)
    }
    assert long == {}, f"modules over {MAX_MODULE_LINES} lines: {long}"


MAX_CONSTRUCTOR_PARAMETERS = 7
"""A stage, the pipeline or the supervisor takes its context and what it reads, not every
setting and collaborator one by one (issue 42)."""
STAGE_MODULES = ("engine/loop", "engine/supervision", "engine/stages.py")


def test_no_stage_constructor_takes_more_than_7_parameters() -> None:
    """Every ``__init__`` written in a class of the loop, the supervision or the stages
    (self not counted; positional, keyword-only, ``*args`` and ``**kwargs`` each count).
    A dataclass's generated one is a record's (a message, a context) and is not counted."""
    wide: dict[str, int] = {}
    for module in STAGE_MODULES:
        top = REPO / module
        for path in sorted(top.rglob("*.py") if top.is_dir() else [top]):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if not isinstance(node, ast.ClassDef):
                    continue
                for init in node.body:
                    if isinstance(init, ast.FunctionDef) and init.name == "__init__":
                        a = init.args
                        count = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) - 1
                        count += (a.vararg is not None) + (a.kwarg is not None)
                        if count > MAX_CONSTRUCTOR_PARAMETERS:
                            wide[f"{path.relative_to(REPO)}:{node.name}"] = count
    assert wide == {}, f"constructors over {MAX_CONSTRUCTOR_PARAMETERS} parameters: {wide}"


HELP = """
import contextlib, io, runpy, sys
sys.argv = [sys.argv[1], "--help"]
with contextlib.redirect_stdout(io.StringIO()) as page:
    try:
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        assert exc.code in (0, None), exc.code
assert "usage:" in page.getvalue()
heavy = ("torch", "transformers", "tokenizers", "safetensors", "peft", "accelerate", "tinker",
         "mint", "fastapi", "starlette", "uvicorn", "matplotlib", "datasets", "pyarrow", "ray",
         "wandb", "openai")
server = ("engine.local.http.app", "engine.local.compute.backend", "engine.local.launch",
          "engine.local.operations")
print(",".join(sorted(
    m for m in sys.modules
    if m.partition(".")[0] in heavy or m in server or m.startswith(tuple(s + "." for s in server))
)))
"""


@pytest.mark.parametrize(
    "module",
    [
        "engine.run",
        "engine.eval",
        "engine.serve",
        "engine.report",
        "engine.rollouts",
        "engine.export",
        "engine.local",
    ],
)
def test_a_help_page_imports_no_model_stack_sdk_or_server(module: str) -> None:
    """``--help`` builds the parser only: torch, transformers, the SDK, the HTTP server
    stack and the local server load when a command runs (each takes seconds cold)."""
    done = subprocess.run(
        [sys.executable, "-c", HELP, module], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "", f"{module} --help imports {done.stdout.strip()}"
