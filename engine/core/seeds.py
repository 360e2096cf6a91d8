"""Seeds for sample requests, derived from the run's seed and where the request sits.

A request's seed depends only on ``(run_seed, step, group, episode, turn)``: the same
run resumed,
or a request retried, asks for the same draws, and two different requests never share
a seed by construction (up to a 2^-63 collision). The derivation is a keyed BLAKE2b of
the integers, so it is the same in every process and on every platform (Python's
``hash()`` is salted per process). A group's first request, shared by all its episodes
when they open alike, is ``episode = ALL_EPISODES``; evaluation requests use
``step = EVAL_STEP``.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Final

MAX_SAMPLING_SEED: Final = (1 << 63) - 1
"""Derived seeds lie in 0..2^63-1 (what the SDKs' int64 / uint64 seed fields hold)."""
EVAL_STEP: Final = -1
"""The ``step`` of evaluation requests, so they never draw what a training step draws."""
ALL_EPISODES: Final = -1
"""The ``episode`` of a request that samples the first turn of every episode of a group."""

_DOMAIN: Final = b"engine.sampling-seed.v1"


def sampling_seed(run_seed: int, step: int, group: int, episode: int, turn: int) -> int:
    """The seed of the sample request for ``turn`` of episode ``episode`` of group
    ``group`` of step ``step`` (0-based; ``step`` may be ``EVAL_STEP``, ``episode``
    ``ALL_EPISODES``), for a run seeded with ``run_seed``."""
    for name, value in (("run_seed", run_seed), ("group", group), ("turn", turn)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    if step < EVAL_STEP:
        raise ValueError(f"step must be >= {EVAL_STEP}, got {step}")
    if episode < ALL_EPISODES:
        raise ValueError(f"episode must be >= {ALL_EPISODES}, got {episode}")
    data = struct.pack("<5q", run_seed & MAX_SAMPLING_SEED, step, group, episode, turn)
    digest = hashlib.blake2b(data, digest_size=8, key=_DOMAIN).digest()
    return int.from_bytes(digest, "little") & MAX_SAMPLING_SEED
