"""Rewards that run in worker processes, in a module that imports nothing heavy: a worker
unpickles them by importing this module (a test module would pull in torch, whose dill
import fails in a worker spawned from a pytest-xdist worker, which has no ``__main__``)."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any


class NoisyTask:
    """A reward that runs a program without capturing its output and writes to fd 1."""

    name = "noisy"

    def score(self, response: str, problem: Any) -> float:
        subprocess.run([sys.executable, "-c", "print('from a child')"], check=True)
        os.write(1, b"straight to fd 1\n")
        print("and a print")
        return 1.0


class DyingTask:
    """A reward whose process exits under it."""

    name = "dying"

    def score(self, response: str, problem: Any) -> float:
        os._exit(3)
