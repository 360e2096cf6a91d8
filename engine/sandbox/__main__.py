"""``python -m engine.sandbox FILE.py``: run a Python file in the sandbox with the default
limits and print the outcome as one JSON object (exit status, the limit that stopped it,
output sizes, the output itself bounded). Exit 0 whatever the code did; 2 for a usage
error or a machine that cannot isolate (one line)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import anyio

from engine.common.cli import OneLineErrorParser, add_version_flag
from engine.sandbox.limits import DEFAULT_LIMITS
from engine.sandbox.result import SandboxResult
from engine.sandbox.runner import Sandbox, SandboxUnavailable


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="python -m engine.sandbox",
        description="Run a Python file in the sandbox (no network, a private /tmp, the "
        "interpreter read-only, a clean environment, default limits) and print the "
        "outcome as one JSON object.",
    )
    parser.add_argument("file", type=Path, metavar="FILE.py")
    parser.add_argument(
        "--unsafe-no-isolation",
        action="store_true",
        help="where neither bubblewrap nor unshare can isolate, run with the limits alone: "
        "the code then sees this machine's files and network",
    )
    add_version_flag(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = args.file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        parser.error(f"cannot read {str(args.file)!r}: {getattr(exc, 'strerror', None) or exc}")

    async def go() -> SandboxResult:
        async with Sandbox(DEFAULT_LIMITS, allow_unisolated=args.unsafe_no_isolation) as sandbox:
            return await sandbox.run_python(code)

    try:
        result = anyio.run(go)
    except SandboxUnavailable as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return exc.exit_code
    print(json.dumps(result.to_dict()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
