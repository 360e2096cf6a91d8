"""What the command-line entry points share: the program name shown in usage lines (the
console script's own name, else ``python -m <module>``), ``--version`` and a parser whose
usage errors are one line (a mistyped flag with the nearest flags)."""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Iterable, Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import NoReturn

__all__ = [
    "OneLineErrorParser",
    "add_version_flag",
    "did_you_mean",
    "engine_version",
    "port_number",
    "positive_int",
    "program_name",
]


def engine_version() -> str:
    try:
        return version("engine")
    except PackageNotFoundError:  # a checkout on PYTHONPATH, not installed
        return "unknown (not installed)"


def program_name(module: str, script: str) -> str:
    """``script`` when the process was started as that console script, else
    ``python -m module`` (also when ``main`` is called in-process, e.g. by tests)."""
    started_as = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else ""
    return script if started_as == script else f"python -m {module}"


def add_version_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--version", action="version", version=f"%(prog)s {engine_version()}")


def port_number(text: str) -> int:
    """argparse type: a TCP port, 0 (any free one) to 65535."""
    port = int(text) if text.strip().isdigit() else -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number in 0..65535, got {text!r}")
    return port


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = int(text) if text.strip().lstrip("+-").isdigit() else 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """`` (did you mean X or Y?)`` with the names closest to ``name`` (difflib, leading
    dashes aside: ``--bacth`` is near ``--batch``, ``--bogus`` near nothing), or ``""``."""
    names = {k.lstrip("-"): k for k in known}
    close = difflib.get_close_matches(name.lstrip("-"), list(names), n=3, cutoff=0.75)
    return f" (did you mean {' or '.join(names[c] for c in close)}?)" if close else ""


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, but a usage error is ONE line on stderr and exit code 2, and an unknown
    flag is answered with the nearest known ones (``--bacth``: did you mean --batch?)."""

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(self._unrecognized(extras))
        return parsed

    def _unrecognized(self, extras: Sequence[str]) -> str:
        flags = [f for f in self._option_string_actions if f.startswith("--")]
        for item in extras:
            name = item.partition("=")[0]
            hint = did_you_mean(name, flags) if name.startswith("-") else ""
            if hint:
                return f"unrecognized argument {name}{hint}"
        return f"unrecognized arguments: {' '.join(extras)}"

    def error(self, message: str) -> NoReturn:
        print(f"Error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)
