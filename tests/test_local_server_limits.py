"""Server limits and hostile input, below HTTP: wire decoding checks declared shapes
before allocating anything, per-request work limits, and the per-model sequencer's
refusal of implausible seq_ids (with an injected clock: no real sleeps)."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from engine.local.config import Limits
from engine.local.http.wire import DatumW, WireError, datums_of
from engine.local.operations.sequencer import ModelSequencer, SeqRejected
from tests.clock import ManualClock


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def _advance(clock: ManualClock, seconds: float) -> None:
    """Move time on once every task waits, and let the woken ones run."""
    await anyio.wait_all_tasks_blocked()
    clock.advance(seconds)
    await anyio.wait_all_tasks_blocked()


def _datum(n: int, **inputs: dict[str, Any]) -> DatumW:
    tokens = list(range(10, 10 + n))
    return DatumW.model_validate(
        {
            "model_input": {"chunks": [{"tokens": tokens, "type": "encoded_text"}]},
            "loss_fn_inputs": {
                "target_tokens": {"data": tokens, "dtype": "int64", "shape": [n]},
                **inputs,
            },
        }
    )


# ---- defaults ------------------------------------------------------------------------


def test_default_work_limits_stay_above_what_the_sdk_sends() -> None:
    """The SDK splits forward_backward into chunks of at most MAX_CHUNK_LEN datums and
    about MAX_CHUNK_BYTES_COUNT estimated bytes (10 per token of model_input and of each
    loss input); RL datums carry 3 loss inputs or more."""
    from tinker.lib.public_interfaces.training_client import MAX_CHUNK_BYTES_COUNT, MAX_CHUNK_LEN

    limits = Limits()
    assert limits.max_datums >= MAX_CHUNK_LEN
    assert limits.max_request_tokens >= MAX_CHUNK_BYTES_COUNT // (10 * (1 + 3))


# ---- wire decoding -------------------------------------------------------------------


@pytest.mark.parametrize("width", [2**32, 2**40, 2**62])
def test_a_huge_declared_sparse_width_is_refused_before_allocating(width: int) -> None:
    """Issue 12 item 1: a ~400-byte datum declaring a sparse [1, width] tensor made the
    server expand it to a dense tensor of `width` values before checking the shape."""
    weights = {
        "data": [1.0],
        "dtype": "float32",
        "shape": [1, width],
        "sparse_crow_indices": [0, 1],
        "sparse_col_indices": [width - 1],
    }
    with pytest.raises(WireError, match=rf"weights has shape \[1, {width}\] but must be \[4\]"):
        datums_of([_datum(4, weights=weights)])


def test_declared_shapes_must_match_the_model_input() -> None:
    long_dense = {"data": [1.0] * 5, "dtype": "float32", "shape": [5]}
    with pytest.raises(WireError, match=r"weights has shape \[5\] but must be \[4\]"):
        datums_of([_datum(4, weights=long_dense)])
    lying = {"data": [1.0] * 3, "dtype": "float32", "shape": [4]}
    with pytest.raises(WireError, match=r"needs 4 values but data has 3"):
        datums_of([_datum(4, weights=lying)])
    sparse_1d = {
        "data": [1.0],
        "dtype": "float32",
        "shape": [4],
        "sparse_crow_indices": [0, 1],
        "sparse_col_indices": [0],
    }
    with pytest.raises(WireError, match="sparse CSR, which encodes 2-D tensors"):
        datums_of([_datum(4, weights=sparse_1d)])
    ok = {"data": [1.0] * 4, "dtype": "float32"}
    (decoded,) = datums_of([_datum(4, weights=ok)])
    assert decoded.inputs["weights"].tolist() == [1.0] * 4


@pytest.mark.parametrize(
    ("values", "message"),
    [([1, 2, 3.5, 4], "non-integer values"), ([1, 2, 2**70, 4], "outside the range of int64")],
)
def test_int64_loss_inputs_must_hold_int64_values(values: list[Any], message: str) -> None:
    targets = {"data": values, "dtype": "int64", "shape": [4]}
    with pytest.raises(WireError, match=rf"target_tokens .*{message}"):
        datums_of([_datum(4, target_tokens=targets)])


def test_a_float_loss_input_beyond_any_float_is_a_wire_error() -> None:
    weights = {"data": [1.0, 10**400, 1.0, 1.0], "dtype": "float32", "shape": [4]}
    with pytest.raises(WireError, match="weights holds a value outside the range of float32"):
        datums_of([_datum(4, weights=weights)])


# ---- sequencer: implausible seq_ids and gaps -------------------------------------------


def _sequencer(clock: ManualClock, max_seq_gap: int = 4) -> ModelSequencer:
    return ModelSequencer(gap_timeout=300, dedupe_window=64, max_seq_gap=max_seq_gap, clock=clock)


def test_a_far_future_seq_id_is_refused_at_once() -> None:
    seq = _sequencer(ManualClock())
    with pytest.raises(SeqRejected, match=r"seq_id 1000000 is implausible: .* expects seq_id 1 "):
        seq.claim(1_000_000, "stray")
    seq.claim(5, "lost-4")  # 1..4 missing: within --max-seq-gap 4
    with pytest.raises(SeqRejected, match="at most 4 seq_ids beyond it"):
        seq.claim(6, "too-far")
    assert seq.lookup(1_000_000) is None and seq.queued == 1


def test_operations_waiting_for_a_missing_seq_id_are_bounded_per_model() -> None:
    """One client cannot pile up operations behind a gap (they used to fill the
    server-wide future limit, so every other client got 429)."""
    seq = _sequencer(ManualClock())
    for n in (2, 3, 4, 5):  # seq_id 1 is missing
        seq.claim(n, f"r{n}")
    with pytest.raises(SeqRejected, match="expects seq_id 1 next"):
        seq.claim(6, "r6")
    assert seq.queued == 4
    seq.claim(1, "r1")  # the missing one arrives: the queue may grow again
    seq.claim(6, "r6")
    assert seq.queued == 6


def test_the_window_follows_the_operations_already_queued() -> None:
    seq = _sequencer(ManualClock(), max_seq_gap=2)
    for n in range(1, 41):  # a pipelining client queues many operations in order
        seq.claim(n, f"r{n}")
    assert seq.first_missing() == 41
    seq.claim(43, "after-two-lost")
    with pytest.raises(SeqRejected, match="expects seq_id 41 next"):
        seq.claim(44, "three-past")


@pytest.mark.anyio
async def test_a_gap_timeout_never_skips_the_real_clients_sequence() -> None:
    """Issue 12 item 7: a stray seq_id ahead of the real client made the server jump
    past the gap after its timeout, so the client's next seq_ids were refused for good."""
    clock = ManualClock()
    seq = _sequencer(clock)
    applied: list[str] = []
    refused: list[str] = []

    async def op(n: int, name: str) -> None:
        try:
            async with seq.turn(n):
                applied.append(name)
        except SeqRejected as exc:
            refused.append(f"{name}: {exc}")

    async with anyio.create_task_group() as tg:
        seq.claim(1, "client-1")
        tg.start_soon(op, 1, "client-1")
        seq.claim(4, "stray-4")  # the real client is busy elsewhere (scoring) for a while
        tg.start_soon(op, 4, "stray-4")
        await _advance(clock, 299)
        assert refused == []
        await _advance(clock, 2)
        assert len(refused) == 1 and "seq_id 4 waited 300 s for seq_id 2" in refused[0]
        for n in (2, 3, 4, 5):  # the real client's next operations, 4 included
            seq.claim(n, f"client-{n}")
            tg.start_soon(op, n, f"client-{n}")
    assert applied == [f"client-{n}" for n in (1, 2, 3, 4, 5)]
    assert seq.next_seq == 6 and seq.gap_timeouts == 1


@pytest.mark.anyio
async def test_operations_held_by_a_gap_are_refused_after_the_timeout_not_applied() -> None:
    clock = ManualClock()
    seq = _sequencer(clock)
    outcome: dict[int, str] = {}

    async def op(n: int) -> None:
        try:
            async with seq.turn(n):
                outcome[n] = "applied"
        except SeqRejected:
            outcome[n] = "refused"

    async with anyio.create_task_group() as tg:
        for n in (2, 3):  # seq_id 1 was lost
            seq.claim(n, f"r{n}")
            tg.start_soon(op, n)
        await _advance(clock, 300)
    assert outcome == {2: "refused", 3: "refused"}
    assert seq.next_seq == 1 and seq.queued == 0 and seq.gap_timeouts == 2
    seq.claim(2, "resubmitted")  # forgotten, so the number is free again
    assert seq.lookup(2) == ("resubmitted", "")


@pytest.mark.anyio
async def test_a_slow_current_turn_is_not_a_gap() -> None:
    clock = ManualClock()
    seq = _sequencer(clock)
    release = anyio.Event()
    order: list[int] = []

    async def first() -> None:
        async with seq.turn(1):
            await release.wait()
            order.append(1)

    async def second() -> None:
        async with seq.turn(2):
            order.append(2)

    async with anyio.create_task_group() as tg:
        seq.claim(1, "r1")
        seq.claim(2, "r2")
        tg.start_soon(first)
        tg.start_soon(second)
        await _advance(clock, 3600)  # many gap timeouts pass while seq 1 holds its turn
        release.set()
    assert order == [1, 2] and seq.gap_timeouts == 0
