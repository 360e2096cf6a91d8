"""The arithmetic task's reward is the MinT quickstart's, component by component."""

from __future__ import annotations

import random

import pytest

from engine.tasks import ArithmeticTask, RewardBreakdown, extract_prediction, score_arithmetic


def test_exact_answer_scores_one_as_format_plus_distance_plus_exact() -> None:
    r = score_arithmetic("6574", 6574)
    assert r.components == {"format_reward": 0.2, "distance_reward": 0.5, "exact_bonus": 0.3}
    assert r.total == pytest.approx(1.0)
    assert r.total <= 1.0


def test_no_integer_scores_zero_in_every_component() -> None:
    r = score_arithmetic("I do not know", 42)
    assert r == RewardBreakdown(
        0.0, {"format_reward": 0.0, "distance_reward": 0.0, "exact_bonus": 0.0}
    )


def test_partial_credit_is_proportional_to_relative_error() -> None:
    # answer 200: scale max(200, 20) = 200; error 50 -> closeness 0.75 -> distance 0.375
    r = score_arithmetic("The answer is 250.", 200)
    assert r.components["format_reward"] == 0.2
    assert r.components["distance_reward"] == pytest.approx(0.375)
    assert r.components["exact_bonus"] == 0.0
    assert r.total == pytest.approx(0.575)


def test_small_answers_use_a_distance_scale_of_twenty() -> None:
    # answer 5: scale 20; error 10 -> closeness 0.5 -> distance 0.25
    r = score_arithmetic("15", 5)
    assert r.components["distance_reward"] == pytest.approx(0.25)
    assert r.total == pytest.approx(0.45)


def test_far_off_answers_keep_only_the_format_reward() -> None:
    r = score_arithmetic("99999", 100)
    assert r.components["distance_reward"] == 0.0
    assert r.total == pytest.approx(0.2)


def test_negative_predictions_and_answers() -> None:
    assert extract_prediction("x = -17 or 3") == -17
    assert score_arithmetic("-17", -17).total == pytest.approx(1.0)
    # error 34 against |answer| 17 -> scale 20 -> closeness clipped at 0
    assert score_arithmetic("17", -17).total == pytest.approx(0.2)


def test_only_the_first_integer_counts() -> None:
    assert extract_prediction(" 12 then 6574") == 12
    assert score_arithmetic(" 12 then 6574", 6574).components["exact_bonus"] == 0.0


def test_default_task_draws_the_quickstart_problems_for_seed_42() -> None:
    rng = random.Random(42)  # the quickstart: random.seed(42), randint(10, 199) twice
    expected = []
    for _ in range(20):
        a = rng.randint(10, 199)
        b = rng.randint(10, 199)
        expected.append((f"What is {a} * {b}?", a * b))
    task = ArithmeticTask()
    source = task.source(42)
    got = []
    for i in range(20):
        p = source.next()
        assert p is not None and p.id == i
        got.append((p.question, p.answer))
    assert got == expected
    first = task.source(42).next()
    assert first is not None
    assert task.prompt(first) == f"Question: {expected[0][0]}\nAnswer:"


def test_source_resumes_from_its_state() -> None:
    task = ArithmeticTask("+", 10, 99)
    a = task.source(7)
    for _ in range(5):
        a.next()
    b = task.source(7, a.state())
    assert [a.next() for _ in range(5)] == [b.next() for _ in range(5)]


@pytest.mark.parametrize(("op", "check"), [("+", int.__add__), ("-", int.__sub__)])
def test_configurable_operation_and_range(op: str, check: object) -> None:
    task = ArithmeticTask(op, 3, 5)
    source = task.source(1)
    for _ in range(50):
        p = source.next()
        assert p is not None
        a_text, sym, b_text = p.question.removeprefix("What is ").removesuffix("?").split()
        a, b = int(a_text), int(b_text)
        assert sym == op and 3 <= a <= 5 and 3 <= b <= 5
        assert p.answer == check(a, b)  # type: ignore[operator]


def test_bad_arithmetic_settings_are_rejected() -> None:
    with pytest.raises(ValueError, match="unknown operation '/'"):
        ArithmeticTask("/")
    with pytest.raises(ValueError, match="min operand 9 is greater than max operand 3"):
        ArithmeticTask("+", 9, 3)
