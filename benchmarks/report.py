"""Writing results: the run's context (machine, load, commit), JSON files, markdown tables.

Why record the context: these are wall-clock figures on a shared 2-core machine; a
result without the load average and the commit it measured cannot be judged later.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["command_line", "fmt", "load_average", "markdown_table", "run_context", "write_json"]


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=Path(__file__).resolve().parent,
            check=False,
        )
    except OSError:
        return None
    return out.stdout.strip() or None


def run_context(args: Mapping[str, Any]) -> dict[str, Any]:
    """Where and when a benchmark ran, with what arguments."""
    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "commit": _git_commit(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "load_average_start": load_average(),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in args.items()},
    }


def command_line(module: str, argv: Sequence[str] | None, *, leave_out: Sequence[str] = ()) -> str:
    """The command a results page names: ``python -m MODULE`` and its arguments (``argv``,
    else the process's), without those in ``leave_out``."""
    given = sys.argv[1:] if argv is None else argv
    return " ".join([f"python -m {module}", *(a for a in given if a not in leave_out)])


def write_json(path: Path, data: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, sort_keys=False, allow_nan=False) + "\n")
    return path


def fmt(value: Any, spec: str = ".2f") -> str:
    """A table cell: ``n/a`` for a missing value."""
    if value is None:
        return "n/a"
    return format(value, spec)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub markdown table; the first column left-aligned, the rest right-aligned."""
    align = [":---"] + ["---:"] * (len(headers) - 1)
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"
