"""Server limits and hostile input, below HTTP: wire decoding checks declared shapes
before allocating anything, per-request work limits, and the per-model sequencer's
refusal of implausible seq_ids (with an injected clock: no real sleeps)."""

from __future__ import annotations

from typing import Any

import pytest

from engine.local.wire import DatumW, WireError, datums_of


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
        datums_of([_datum(4, weights=weights)], vocab_size=300, max_context=256)


def test_declared_shapes_must_match_the_model_input() -> None:
    long_dense = {"data": [1.0] * 5, "dtype": "float32", "shape": [5]}
    with pytest.raises(WireError, match=r"weights has shape \[5\] but must be \[4\]"):
        datums_of([_datum(4, weights=long_dense)], vocab_size=300, max_context=256)
    lying = {"data": [1.0] * 3, "dtype": "float32", "shape": [4]}
    with pytest.raises(WireError, match=r"needs 4 values but data has 3"):
        datums_of([_datum(4, weights=lying)], vocab_size=300, max_context=256)
    sparse_1d = {
        "data": [1.0],
        "dtype": "float32",
        "shape": [4],
        "sparse_crow_indices": [0, 1],
        "sparse_col_indices": [0],
    }
    with pytest.raises(WireError, match="sparse CSR, which encodes 2-D tensors"):
        datums_of([_datum(4, weights=sparse_1d)], vocab_size=300, max_context=256)
    ok = {"data": [1.0] * 4, "dtype": "float32"}
    (decoded,) = datums_of([_datum(4, weights=ok)], vocab_size=300, max_context=256)
    assert decoded.inputs["weights"].tolist() == [1.0] * 4
