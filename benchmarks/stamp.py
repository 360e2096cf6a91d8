"""Stamp the CLI's step lines and report its steady pace, from outside the process.

    python -m engine.run --steps 20 ... | python -m benchmarks.stamp --cycle 0.5 --skip 2

Every input line is echoed with the seconds since this process started; ``Step N:``
lines are stamped as they arrive. At the end: the pace over the steady steps (steps after
the first ``--skip``), (t_last - t_first) / (n - 1), in seconds and, with ``--cycle``, in
latency clock cycles per step. The first stamps include this pipe's own start-up, so
start this command before (or with) the one it reads.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TextIO

from benchmarks.measure import pace

__all__ = ["main", "stamp_steps"]

STEP_LINE = re.compile(r"^Step (\d+):")


def stamp_steps(
    lines: Iterable[str], out: TextIO, now: Callable[[], float] = time.perf_counter
) -> dict[int, float]:
    """Echo ``lines`` with stamps; return step number -> stamp of its ``Step N:`` line."""
    start = now()
    steps: dict[int, float] = {}
    for line in lines:
        t = now() - start
        out.write(f"{t:9.3f} {line}")
        out.flush()
        match = STEP_LINE.match(line)
        if match:
            steps.setdefault(int(match.group(1)), t)
    return steps


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.stamp", description=__doc__)
    p.add_argument("--cycle", type=float, default=None, help="clock cycle seconds (mint: 0.5)")
    p.add_argument("--skip", type=int, default=2, help="start-up steps left out (default 2)")
    args = p.parse_args(argv)
    steps = stamp_steps(sys.stdin, sys.stdout)
    ends = [steps[s] for s in sorted(steps)]
    if not ends:
        print("no step lines read", file=sys.stderr)
        return 1
    first_step = f"first step at {ends[0]:.2f}s, step {len(ends)} at {ends[-1]:.2f}s"
    steady = ends[args.skip :]
    if len(steady) < 2:
        print(f"{first_step}; too few steps after --skip {args.skip} for a pace")
        return 0
    seconds = pace(steady)
    cycles = f" = {seconds / args.cycle:.2f} cycles/step" if args.cycle else ""
    print(
        f"{first_step}; pace over steps {args.skip + 1}..{len(ends)}: {seconds:.3f} s/step{cycles}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
