"""Advantages, datum layout, skip rules and KL: the quickstart's rules, exactly."""

from __future__ import annotations

import numpy as np
import pytest
from tinker import types

from engine.core.datums import (
    Datum,
    MissingLogprobsError,
    group_advantages,
    group_datums,
    kl_sample_train,
    trajectory_datums,
    with_loss_inputs,
)
from engine.core.problems import RewardBreakdown
from engine.core.trajectory import Trajectory, Turn
from tests.datums import datum_to_dict


def _episode(
    prompt: list[int], tokens: list[int], logprobs: list[float] | None, reward: float = 0.0
) -> Trajectory:
    """A single-turn task's response: a one-turn trajectory of its prompt."""
    lp = None if logprobs is None else tuple(logprobs)
    turn = Turn(tuple(prompt), tuple(tokens), lp, 0, "stop")
    return Trajectory((turn,), group_reward=RewardBreakdown(reward))


def build_datum(
    prompt: list[int], response: list[int], logprobs: list[float], advantage: float
) -> Datum:
    (datum,) = trajectory_datums(_episode(prompt, response, logprobs), advantage)
    return datum


def _group(
    prompt: list[int], responses: list[tuple[list[int], list[float] | None]], rewards: list[float]
) -> list[Trajectory]:
    return [_episode(prompt, t, lp, r) for (t, lp), r in zip(responses, rewards, strict=True)]


def test_advantage_is_reward_minus_group_mean_without_std() -> None:
    assert group_advantages([1.0, 0.0, 0.5, 0.5]) == pytest.approx([0.5, -0.5, 0.0, 0.0])
    assert group_advantages([0.2, 0.2]) == [0.0, 0.0]
    assert group_advantages([]) == []


def test_datum_layout_matches_the_quickstart_position_for_position() -> None:
    prompt = [10, 11, 12, 13]
    response = [20, 21]
    d = datum_to_dict(build_datum(prompt, response, [-0.5, -1.5], 0.25))
    assert d["model_input"] == [10, 11, 12, 13, 20]  # full[:-1]
    assert d["target_tokens"] == [11, 12, 13, 20, 21]  # full[1:]
    assert d["weights"] == [0.0, 0.0, 0.0, 1.0, 1.0]
    assert d["logprobs"] == [0.0, 0.0, 0.0, -0.5, -1.5]
    assert d["advantages"] == pytest.approx([0.0, 0.0, 0.0, 0.25, 0.25])


def test_datum_tensors_have_the_dtypes_the_sdk_gives_plain_lists() -> None:
    ours = build_datum([1, 2], [3], [-0.1], 0.5)
    plain_lists: dict[str, list[int] | list[float]] = {
        "target_tokens": [2, 3],
        "weights": [0.0, 1.0],
        "logprobs": [0.0, -0.1],
        "advantages": [0.0, 0.5],
    }
    theirs = types.Datum(
        model_input=types.ModelInput.from_ints(tokens=[1, 2]),
        # Plain lists on purpose: the SDK makes them tensors at runtime, though its
        # LossFnInputs annotation names only TensorData.
        loss_fn_inputs=plain_lists,  # type: ignore[arg-type]
    )
    assert datum_to_dict(ours) == datum_to_dict(theirs)
    for key in theirs.loss_fn_inputs:
        assert ours.loss_fn_inputs[key].dtype == theirs.loss_fn_inputs[key].dtype


def _c(tokens: list[int], logprobs: list[float] | None = None) -> tuple[list[int], list[float]]:
    return tokens, [-0.1] * len(tokens) if logprobs is None else logprobs


def test_gspo_datums_mark_the_sampled_tokens_for_the_sequence_ratio() -> None:
    datum = build_datum([10, 11, 12], [20, 21], [-0.5, -1.5], 0.25)
    assert with_loss_inputs(datum, "ppo") is datum
    gspo = with_loss_inputs(datum, "gspo")
    mask = gspo.loss_fn_inputs["sequence_ratio_mask"]
    assert mask.tolist() == [0.0, 0.0, 1.0, 1.0] and mask.dtype == np.float32
    assert "sequence_ratio_mask" not in datum.loss_fn_inputs


def test_empty_responses_and_zero_advantages_are_skipped_and_counted() -> None:
    built = group_datums(
        _group(
            [1, 2],
            [_c([5]), _c([]), _c([6, 7]), _c([8])],
            [1.0, 0.0, 0.5, 0.5],  # mean 0.5 -> advantages 0.5, -0.5, 0, 0
        )
    )
    assert built.advantages == pytest.approx([0.5, -0.5, 0.0, 0.0])
    assert len(built.datums) == 1
    assert datum_to_dict(built.datums[0])["target_tokens"] == [2, 5]
    assert built.skipped_empty == 1
    assert built.skipped_zero_advantage == 2
    assert built.dropped_missing_logprobs == 0
    assert not built.constant_reward


def test_constant_reward_group_yields_no_datum() -> None:
    built = group_datums(_group([1], [_c([2]), _c([3])], [0.7, 0.7]))
    assert built.datums == []
    assert built.constant_reward
    assert built.skipped_zero_advantage == 2


def test_tiny_advantages_below_1e_12_are_skipped() -> None:
    built = group_datums(_group([1], [_c([2]), _c([3])], [0.3, 0.3 + 1e-13]))
    assert built.datums == []


def test_missing_logprobs_is_an_error_by_default() -> None:
    with pytest.raises(MissingLogprobsError, match="a turn of 2 tokens without matching"):
        group_datums(_group([1], [([2, 3], None), _c([4])], [1.0, 0.0]))
    with pytest.raises(MissingLogprobsError, match="--on-missing-logprobs drop"):
        group_datums(_group([1], [([2, 3], [-0.1]), _c([4])], [1.0, 0.0]))


def test_missing_logprobs_drop_mode_counts_and_never_zero_fills() -> None:
    built = group_datums(
        _group([1], [([2, 3], None), _c([4], [-0.7]), _c([5], [-0.2])], [1.0, 0.0, 0.5]),
        on_missing_logprobs="drop",
    )
    assert built.dropped_missing_logprobs == 1
    # the dropped response's reward still counts in the mean (0.5): advantages -0.5 and 0
    assert [datum_to_dict(d)["logprobs"] for d in built.datums] == [pytest.approx([-0.7])]
    assert all(0.0 not in datum_to_dict(d)["logprobs"][-1:] for d in built.datums)


def test_kl_metrics_use_only_trained_positions() -> None:
    d = build_datum([1, 2, 3], [4, 5], [-1.0, -2.0], 1.0)  # 4 positions, last 2 trained
    kl = kl_sample_train([d], [np.array([9.0, 9.0, -1.5, -1.0], np.float32)])
    # q - p = (-1 - -1.5, -2 - -1) = (0.5, -1.0)
    assert kl.tokens == 2
    assert kl.v1 == pytest.approx(-0.25)
    assert kl.v2 == pytest.approx(0.5 * (0.25 + 1.0) / 2)
    assert kl.entropy == pytest.approx(1.5)  # -mean(-1, -2): the sampled tokens only


def test_kl_of_no_tokens_is_none_not_nan() -> None:
    kl = kl_sample_train([], [])
    assert (kl.v1, kl.v2, kl.tokens) == (None, None, 0)
