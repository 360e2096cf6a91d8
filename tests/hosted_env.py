"""Run a module of the package as a hosted-only install sees it: the packages of chosen
extras cannot be found (``import`` fails and ``importlib.util.find_spec`` says None, as
when they were never installed), in a child process.

    python tests/hosted_env.py torch,fastapi -m engine.run --help
"""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec, PathFinder
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the child must not import engine (tinker imports torch) before hiding
    from engine.common.extras import Extra

REPO = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).resolve()


def modules_of(*extras: Extra) -> list[str]:
    """The top-level modules the given extras install (with ``starlette``, which comes
    with FastAPI): what a core-only install lacks."""
    from engine.common.extras import EXTRA_MODULES

    names = [m for extra in extras for m in EXTRA_MODULES[extra]]
    return [*names, "starlette"] if "local" in extras else names


def run_without(
    hidden: Sequence[str],
    module: str,
    args: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    timeout: float = 240,
) -> subprocess.CompletedProcess[str]:
    """``python -m module args`` in a child where ``hidden`` modules cannot be found."""
    child_env = dict(os.environ if env is None else env)
    child_env.setdefault("HF_HUB_OFFLINE", "1")
    child_env["PYTHONPATH"] = str(REPO)
    return subprocess.run(
        [sys.executable, str(SCRIPT), ",".join(hidden), "-m", module, *args],
        env=child_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        cwd=REPO,
    )


class _HidingPathFinder:
    """The standard path finder, blind to some top-level packages."""

    def __init__(self, hidden: set[str]) -> None:
        self._hidden = hidden

    def find_spec(
        self, name: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if name.partition(".")[0] in self._hidden:
            return None
        return PathFinder.find_spec(name, path, target)

    def __getattr__(self, name: str) -> Any:
        return getattr(PathFinder, name)


def _main() -> None:
    hidden = {name for name in sys.argv[1].split(",") if name}
    assert sys.argv[2] == "-m", "usage: hosted_env.py MODULES -m MODULE [ARGS...]"
    loaded = hidden & {name.partition(".")[0] for name in sys.modules}
    assert not loaded, f"already imported at start-up: {loaded}"
    sys.meta_path[:] = [
        _HidingPathFinder(hidden) if finder is PathFinder else finder for finder in sys.meta_path
    ]
    module = sys.argv[3]
    sys.argv = [module, *sys.argv[4:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    _main()
