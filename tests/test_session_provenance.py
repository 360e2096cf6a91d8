"""``engine.session.provenance``: a datum's sampled runs found by their tokens and the
sampler's logprobs, and spans that tile model_input and target_tokens the way
``Datum.with_provenance`` wants (checked against the local server's reading in the
tinker 0.38 end-to-end tests)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from engine.errors import EngineError
from engine.session.provenance import SampledIndex, Span, datum_provenance


def index() -> SampledIndex:
    idx = SampledIndex()
    idx.add("a", [7, 8, 9], [-0.5, -0.25, -1.0])
    idx.add("b", [7, 8], [-0.5, -0.25])  # a prefix of a: the longest match wins
    idx.add("c", [4], [-2.0])
    return idx


def lay_out(
    full: Sequence[int], lps: Sequence[float], trained: Sequence[float]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The datum layout: targets = full[1:], with per-target logprobs and weights."""
    return (
        np.asarray(full[1:], dtype=np.int64),
        np.asarray(lps[1:], dtype=np.float32),
        np.asarray(trained[1:], dtype=np.float32),
    )


def test_a_single_turn_datum() -> None:
    # prompt [1, 2, 3], response a
    full = [1, 2, 3, 7, 8, 9]
    layout = lay_out(full, [0, 0, 0, -0.5, -0.25, -1.0], [0, 0, 0, 1, 1, 1])
    model_input, loss = datum_provenance(index(), *layout, "datum 0")
    assert model_input == [Span("prompt", "a", 0, 3), Span("sampled", "a", 0, 2)]
    assert loss == [Span("prompt", "a", 1, 2), Span("sampled", "a", 0, 3)]
    assert sum(s.length for s in model_input) == len(full) - 1
    assert sum(s.length for s in loss) == len(full) - 1


def test_two_turns_back_to_back_and_an_observation_between() -> None:
    """prompt [1, 2], turn c, observation [5], turn b, then turn a right after it: the
    greedy longest match splits b from a; each prompt run is the next request's prompt."""
    full = [1, 2, 4, 5, 7, 8, 7, 8, 9]
    lps = [0, 0, -2.0, 0, -0.5, -0.25, -0.5, -0.25, -1.0]
    trained = [0, 0, 1, 0, 1, 1, 1, 1, 1]
    model_input, loss = datum_provenance(index(), *lay_out(full, lps, trained), "datum 3")
    assert loss == [
        Span("prompt", "c", 1, 1),
        Span("sampled", "c", 0, 1),
        Span("prompt", "b", 3, 1),
        Span("sampled", "b", 0, 2),
        Span("sampled", "a", 0, 3),
    ]
    assert model_input == [
        Span("prompt", "c", 0, 2),
        Span("sampled", "c", 0, 1),
        Span("prompt", "b", 3, 1),
        Span("sampled", "b", 0, 2),
        Span("sampled", "a", 0, 2),
    ]


@pytest.mark.parametrize(
    ("lps", "trained", "message"),
    [
        ([0, 0, 0, -0.5, -0.3, -1.0], [0, 0, 0, 1, 1, 1], "match no response"),
        ([0, 0, 0, -0.5, -0.25, -1.0], [0, 0, 0, 1, 0, 1], "trains only part"),
        ([0, 0, 0, -0.5, -0.25, -1.0], [0, 0, 0, 0, 0, 0], "trains no sampled token"),
    ],
)
def test_a_datum_it_cannot_attribute_is_a_clear_error(
    lps: list[float], trained: list[float], message: str
) -> None:
    full = [1, 2, 3, 7, 8, 9]
    with pytest.raises(EngineError, match=message):
        datum_provenance(index(), *lay_out(full, lps, trained), "d")


def test_the_index_is_bounded() -> None:
    idx = SampledIndex(max_sequences=2)
    for i in range(5):
        idx.add(f"s{i}", [i + 1], [-1.0])
    assert len(idx) == 2
    assert idx.match(np.asarray([1]), np.asarray([-1.0])) is None
    assert idx.match(np.asarray([5]), np.asarray([-1.0])) == ("s4", 1)
