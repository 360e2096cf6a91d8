"""The server's stability records (``engine.local.compute.stability``): behaviour logprobs taken
from what was sampled, attributed by provenance spans, scoped to the sampling session,
bounded in number and expiring after their last use."""

from __future__ import annotations

import pytest
import torch

from engine.local.compute.stability import StabilityRecords
from engine.local.http.wire import ProvenanceSpanW, WireError


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def span(kind: str, sid: str, length: int, offset: int = 0) -> ProvenanceSpanW:
    return ProvenanceSpanW(kind=kind, sequence_id=sid, offset=offset, length=length)  # type: ignore[arg-type]


def records(clock: Clock, max_records: int = 8) -> StabilityRecords:
    store = StabilityRecords(clock, max_records=max_records, ttl_s=60.0)
    store.record("s1", "7-0", [5, 6, 7], [-0.5, -1.0, -1.5])
    return store


def test_sampled_runs_take_the_recorded_logprobs_and_prompt_runs_are_masked() -> None:
    store = records(Clock())
    targets = torch.tensor([3, 4, 6, 7])  # two prompt positions, then tokens 1..2 of 7-0
    logprobs, mask = store.behaviour(
        "s1", [span("prompt", "7-0", 2, 1), span("sampled", "7-0", 2, 1)], targets, "data[0]"
    )
    assert logprobs.tolist() == [0.0, 0.0, -1.0, -1.5]
    assert mask.tolist() == [0.0, 0.0, 1.0, 1.0]


@pytest.mark.parametrize(
    ("session", "spans", "targets", "message"),
    [
        ("s2", [span("sampled", "7-0", 3)], [5, 6, 7], "has no stability record"),
        ("s1", [span("sampled", "9-0", 3)], [5, 6, 7], "has no stability record"),
        ("s1", [span("sampled", "7-0", 3)], [5, 6, 8], "are not the tokens"),
        ("s1", [span("sampled", "7-0", 2, 2)], [6, 7], "runs past the 3 tokens"),
        ("s1", [span("sampled", "7-0", 2)], [5, 6, 7], "cover 2 positions"),
    ],
)
def test_a_wrong_attribution_is_a_clear_error(
    session: str, spans: list[ProvenanceSpanW], targets: list[int], message: str
) -> None:
    with pytest.raises(WireError, match=message):
        records(Clock()).behaviour(session, spans, torch.tensor(targets), "data[0]")


def test_records_expire_after_their_last_use_and_the_oldest_go_first() -> None:
    clock = Clock()
    store = records(clock, max_records=2)
    clock.t += 50
    store.record("s1", "8-0", [1], [-0.1])
    store.behaviour("s1", [span("sampled", "7-0", 3)], torch.tensor([5, 6, 7]), "d")  # a use
    clock.t += 50  # 100 s after 7-0 was sampled, 50 after its use: still there
    assert len(store) == 2
    store.record("s1", "9-0", [2], [-0.2])  # over the bound: the least recently used goes
    with pytest.raises(WireError, match="no stability record"):
        store.behaviour("s1", [span("sampled", "8-0", 1)], torch.tensor([1]), "d")
    clock.t += 61
    with pytest.raises(WireError, match="no stability record"):
        store.behaviour("s1", [span("sampled", "7-0", 3)], torch.tensor([5, 6, 7]), "d")
