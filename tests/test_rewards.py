"""The arithmetic task's reward is the MinT quickstart's, component by component."""

from __future__ import annotations

import random

import pytest

from engine.tasks import ArithmeticTask, RewardBreakdown, extract_prediction, score_arithmetic
from engine.tasks.arithmetic import default_eval_size


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


def test_held_out_pairs_are_fixed_and_never_drawn_for_training() -> None:
    task = ArithmeticTask("+", 10, 99, eval_size=64)
    held_out = task.eval_problems()
    assert len(held_out) == 64 and [p.id for p in held_out] == list(range(64))
    assert [p.question for p in ArithmeticTask("+", 10, 99, 64).eval_problems()] == [
        p.question for p in held_out
    ]  # the same for every task built alike (and every run seed)
    for p in held_out:
        a, plus, b = p.question.removeprefix("What is ").removesuffix("?").split()
        assert plus == "+" and p.answer == int(a) + int(b) and 10 <= int(a) <= 99
    held = {p.question for p in held_out}
    assert len(held) == 64
    for seed in (0, 1, 42):
        source = task.source(seed)
        drawn = [source.next().question for _ in range(3000)]
        assert held.isdisjoint(drawn)
    # The quickstart's stream, except that a held-out pair is drawn again.
    rng = random.Random(42)
    quickstart = [f"What is {rng.randint(10, 99)} + {rng.randint(10, 99)}?" for _ in range(100)]
    first = next(i for i, q in enumerate(quickstart) if q in held)
    source = task.source(42)
    ours = [source.next().question for _ in range(first + 1)]
    assert ours[:first] == quickstart[:first]
    assert ours[first] == quickstart[first + 1]  # the held-out draw was skipped
    plain = ArithmeticTask("+", 10, 99).source(42)  # by default none is held out
    assert [plain.next().question for _ in range(100)] == quickstart
    assert ArithmeticTask("+", 10, 99).eval_problems() == []


def test_held_out_size_follows_the_operand_range() -> None:
    assert default_eval_size(10, 99) == 64
    assert default_eval_size(0, 9) == 10  # a tenth of 100 pairs
    assert default_eval_size(1, 3) == 0  # 9 pairs: none held out
    assert default_eval_size("9", "1") == default_eval_size("x", "9") == 0  # the task says why
    half = ArithmeticTask.from_args({"min_operand": "0", "max_operand": "9", "eval_size": "50"})
    assert len(half.eval_problems()) == 50
    with pytest.raises(ValueError, match=r"eval_size must be in 0..50 \(half of the 100"):
        ArithmeticTask.from_args({"min_operand": "0", "max_operand": "9", "eval_size": "51"})
    with pytest.raises(ValueError, match="eval_size must be an integer"):
        ArithmeticTask.from_args({"eval_size": "many"})


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
