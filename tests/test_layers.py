"""The engine's packages form layers that only import downward, with no circles.

The layer order is written once, here (docs/architecture.md draws it): a module may
import modules of its own layer or of a layer below it, never above. Within a layer the
packages may import each other only without a circle. The local server (``engine.local``)
stands beside the client, walled on both sides: it imports nothing of the client but the
foundation (where the model catalogue it shares with the client lives,
``engine.basemodels``), and one client module launches it (``LAUNCHER``). Every import
counts, also one inside a function or under ``TYPE_CHECKING``: a lazy import is still a
dependency.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[1] / "engine"

LAYERS: tuple[tuple[str, ...], ...] = (
    ("engine.errors", "engine.redact", "engine.common", "engine.basemodels"),  # foundation
    ("engine.core",),  # value types: problems, trajectories, datums, loop state
    ("engine.sandbox",),  # untrusted code, isolated
    ("engine.config",),  # settings
    ("engine.session",),  # the MinT session seam and its adapters
    ("engine.tasks",),  # single-turn tasks and rewards
    ("engine.envs", "engine.agents"),  # environments, scoring; agents as environments
    ("engine.loop",),  # the pipeline
    ("engine.objectives",),  # what a run trains for: RL, SFT, DPO, distillation
    ("engine.observe", "engine.rundir", "engine.supervision"),  # around the pipeline
    (  # the facade and the command lines
        "engine",
        "engine.engine",
        "engine.run",
        "engine.eval",
        "engine.doctor",
        "engine.export",
        "engine.report",
        "engine.rollouts",
        "engine.checkpoint_files",
        "engine.catalog",
        "engine.serve",
        "engine.stages",
    ),
)
BESIDE = "engine.local"
LAUNCHER = "engine.session.opening"
"""The one client module that imports the local server: it starts it for a session."""
FOUNDATION = LAYERS[0]


def _unit(module: str) -> str:
    """The package (or top-level module) a module belongs to."""
    parts = module.split(".")
    if len(parts) >= 2 and (ENGINE / parts[1]).is_dir():
        return ".".join(parts[:2])
    return module if len(parts) == 2 else "engine"


def _modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for path in ENGINE.rglob("*.py"):
        parts = list(path.relative_to(ENGINE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return {name for name in found if name == "engine" or name.startswith("engine.")}


def _arrows() -> dict[str, set[str]]:
    """Unit -> the units it imports (its own left out)."""
    arrows: dict[str, set[str]] = defaultdict(set)
    for module, path in _modules().items():
        source = _unit(module)
        for target in map(_unit, _imports(path)):
            if target != source:
                arrows[source].add(target)
    return arrows


def _layer(unit: str) -> int:
    for i, layer in enumerate(LAYERS):
        if unit in layer:
            return i
    raise AssertionError(f"{unit} is in no layer: add it to LAYERS in {__file__}")


def test_every_package_is_in_a_layer() -> None:
    units = {_unit(m) for m in _modules()} - {BESIDE}
    for unit in units:
        _layer(unit)


def test_no_package_imports_a_layer_above_it() -> None:
    upward = sorted(
        f"{source} -> {target}"
        for source, targets in _arrows().items()
        if source != BESIDE
        for target in targets
        if target != BESIDE and _layer(target) > _layer(source)
    )
    assert upward == []


def test_the_local_server_imports_nothing_of_the_client_but_the_foundation() -> None:
    assert _arrows()[BESIDE] <= set(FOUNDATION)


def test_only_the_launcher_imports_the_local_server() -> None:
    importers = sorted(
        module
        for module, path in _modules().items()
        if _unit(module) != BESIDE and any(_unit(name) == BESIDE for name in _imports(path))
    )
    assert importers == [LAUNCHER]


def test_no_import_circles_between_packages() -> None:
    arrows = _arrows()
    circles: list[str] = []

    def visit(unit: str, path: list[str]) -> None:
        for target in sorted(arrows.get(unit, ())):
            if target in path:
                circles.append(" -> ".join([*path[path.index(target) :], target]))
            elif len(path) < len(arrows) + 1:
                visit(target, [*path, target])

    for unit in sorted(arrows):
        visit(unit, [unit])
    assert circles == []


def _module_imports(path: Path, modules: set[str]) -> set[str]:
    """The engine modules ``path`` imports (``from engine.p import m``: module ``m``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            named = {f"{node.module}.{a.name}" for a in node.names} & modules
            found |= named or {node.module}
    return found & modules


def test_no_import_circles_between_the_modules_of_a_package() -> None:
    """Within one folder, the modules (its ``__init__`` aside) import each other without a
    circle: one that only a lazy import holds open is still one."""
    modules = {m: p for m, p in _modules().items() if p.name != "__init__.py"}
    arrows = {
        module: {
            target
            for target in _module_imports(path, set(modules))
            if target != module and target.rpartition(".")[0] == module.rpartition(".")[0]
        }
        for module, path in modules.items()
    }
    circles: list[str] = []
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:  # depth first; a circle closes a path
        for target in sorted(arrows.get(module, ())):
            if target in path:
                circles.append(" -> ".join([*path[path.index(target) :], target]))
            elif target not in done:
                visit(target, [*path, target])
        done.add(module)

    for module in sorted(arrows):
        if module not in done:
            visit(module, [module])
    assert circles == []
