"""The backend's datum checks run over a whole request at once; a bad value is still
reported with the datum it is in, and good datums come back as they went in."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from engine.local.compute.datums import DatumError, check_data

VOCAB = 50
NEEDS = ("target_tokens", "weights", "advantages")


@dataclass(frozen=True)
class _Datum:
    tokens: list[int]
    inputs: dict[str, torch.Tensor]


def _request(lengths: tuple[int, ...] = (3, 5, 2, 4, 6)) -> list[_Datum]:
    data = []
    for i, n in enumerate(lengths):
        inputs = {
            "target_tokens": torch.arange(n, dtype=torch.int32) + i,
            "weights": torch.full((n,), 0.5, dtype=torch.float64),
            "advantages": torch.linspace(-1.0, 1.0, n),
        }
        if i % 2:  # an optional input only some datums carry
            inputs["logprobs"] = torch.full((n,), -float(i))
        data.append(_Datum([(i * 7 + t) % VOCAB for t in range(n)], inputs))
    return data


def test_checked_datums_hold_their_own_values_as_int64_and_float32() -> None:
    data = _request()
    checked = check_data(data, NEEDS, vocab=VOCAB, max_len=64)
    assert len(checked) == len(data)
    for d, c in zip(data, checked, strict=True):
        assert c.tokens.dtype == torch.long and c.tokens.tolist() == d.tokens
        assert set(c.inputs) == set(d.inputs)
        assert c.inputs["target_tokens"].dtype == torch.long
        for key, value in d.inputs.items():
            assert c.inputs[key].tolist() == pytest.approx(value.tolist())
            if key != "target_tokens":
                assert c.inputs[key].dtype == torch.float32


@pytest.mark.parametrize("bad", [0, 2, 4])
def test_an_id_outside_the_vocabulary_names_its_datum(bad: int) -> None:
    data = _request()
    data[bad].tokens[-1] = VOCAB
    with pytest.raises(DatumError, match=rf"^datum {bad}: model_input contains token id {VOCAB},"):
        check_data(data, NEEDS, vocab=VOCAB, max_len=64)
    data = _request()
    data[bad].inputs["target_tokens"][1] = -1
    with pytest.raises(DatumError, match=rf"^datum {bad}: target_tokens contains token id -1,"):
        check_data(data, NEEDS, vocab=VOCAB, max_len=64)


@pytest.mark.parametrize(("bad", "key"), [(1, "logprobs"), (3, "logprobs"), (4, "weights")])
def test_a_nan_names_its_datum_even_in_an_input_only_some_datums_carry(bad: int, key: str) -> None:
    data = _request()
    data[bad].inputs[key][-1] = float("nan")
    with pytest.raises(DatumError, match=rf"^datum {bad}: loss input '{key}' contains NaN"):
        check_data(data, NEEDS, vocab=VOCAB, max_len=64)


def test_a_token_id_that_is_no_int64_is_refused_with_its_datum() -> None:
    data = _request()
    data[3].tokens[0] = 2**70
    with pytest.raises(DatumError, match=r"^datum 3: model_input contains token id 1180591"):
        check_data(data, NEEDS, vocab=VOCAB, max_len=64)
