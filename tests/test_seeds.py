"""``engine.core.seeds.sampling_seed``: a pure function of (run seed, step, group,
episode, turn), the same in every process, different for every request of a run."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine.core.seeds import ALL_EPISODES, EVAL_STEP, MAX_SAMPLING_SEED, sampling_seed


def test_every_request_of_a_run_gets_its_own_seed_in_range() -> None:
    seeds = {
        sampling_seed(42, step, group, episode, turn)
        for step in range(EVAL_STEP, 30)
        for group in range(16)
        for episode in range(ALL_EPISODES, 3)
        for turn in range(4)
    }
    assert len(seeds) == 31 * 16 * 4 * 4
    assert all(0 <= s <= MAX_SAMPLING_SEED for s in seeds)
    assert sampling_seed(42, 3, 1, 0, 0) != sampling_seed(43, 3, 1, 0, 0)


def test_the_seed_is_the_same_in_another_process() -> None:
    """No salted hash(): a resumed run (a new process) asks for the same draws."""
    code = "from engine.core.seeds import sampling_seed; print(sampling_seed(7, 5, 3, 1, 2))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert int(out) == sampling_seed(7, 5, 3, 1, 2)


def test_a_fixed_value_pins_the_derivation() -> None:
    """Changing the derivation changes every run's samples: do it on purpose only."""
    assert sampling_seed(42, 0, 0, ALL_EPISODES, 0) == 5014111067758713204


@pytest.mark.parametrize(
    "args",
    [(-1, 0, 0, 0, 0), (0, -2, 0, 0, 0), (0, 0, -1, 0, 0), (0, 0, 0, -2, 0), (0, 0, 0, 0, -1)],
)
def test_negative_coordinates_are_refused(args: tuple[int, int, int, int, int]) -> None:
    with pytest.raises(ValueError, match="must be >="):
        sampling_seed(*args)
