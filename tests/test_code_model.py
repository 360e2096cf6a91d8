"""The packaged code model's data (scripts/code_data.py) and the model itself: the
shipped problems load as a code task and each one's reference answer passes every test
in the sandbox, a wrong one part or none; the language's evaluator agrees with the
tests; the build never trains on the shipped problems; and the packaged model is small,
named, and starts RL inside the band."""

from __future__ import annotations

import json
import random
from pathlib import Path

import anyio
import pytest

from engine.basemodels.catalogue import PACKAGED, packaged_name
from engine.catalog import load_task
from engine.core.problems import Problem
from engine.tasks.code import CodeTask
from scripts import code_data
from tests.sandbox_support import require_isolation

CODE_MODEL = PACKAGED["tiny-code"]


def test_the_evaluator_reads_each_form_and_nothing_else() -> None:
    assert code_data.evaluate(" x + 3", 4) == 7
    assert code_data.evaluate("x*x+2", 3) == 11
    assert code_data.evaluate(" 7 - x ", 2) == 5
    assert code_data.evaluate(" x // 3", 7) == 2
    for junk in (" x + 10", " x * 1", " import os", "", " x +"):
        assert code_data.evaluate(junk, 4) is None
    problem = code_data.CodeProblem("x + {k}", 2, (1, 2, 3), (0, 2, 4, 6))
    assert code_data.pass_share(" x + 2", problem) == 1.0
    assert code_data.pass_share(" x * 2", problem) == 0.25  # only f(2) agrees
    assert problem.prompt.endswith("# f(3) == 5\ndef f(x):\n    return")


def test_a_problem_names_its_parameter_and_the_build_keeps_the_x_habit() -> None:
    problem = code_data.CodeProblem("{k} - x", 7, (1, 2, 3), (0, 2, 4, 6), name="n")
    assert problem.prompt.endswith("def f(n):\n    return") and problem.answer == " 7 - n"
    assert code_data.evaluate(" 7 - n", 2, "n") == 5
    assert code_data.pass_share(" 7 - n", problem) == 1.0
    assert code_data.pass_share(" 7 - x", problem) == 0.0  # x is not defined
    rng = random.Random(0)
    answers = [code_data.sft_answer(problem, rng) for _ in range(1000)]
    assert 0.5 < answers.count(" 7 - x") / 1000 < 0.7  # HABIT_SHARE, 0.6
    assert set(answers) == {" 7 - x", " 7 - n"}
    with_x = code_data.CodeProblem("{k} - x", 7, (1, 2, 3), (0, 2, 4, 6))
    assert {code_data.sft_answer(with_x, rng) for _ in range(100)} == {" 7 - x"}


def test_the_problem_file_is_the_generators(tmp_path: Path) -> None:
    written = code_data.write(
        tmp_path / "tiny_code.jsonl", code_data.PROBLEMS_COUNT, code_data.PROBLEMS_SEED
    )
    assert written.read_text() == code_data.PROBLEMS_FILE.read_text()
    rows = [json.loads(line) for line in written.read_text().splitlines()]
    assert len({r["prompt"] for r in rows}) == 512
    assert {r["entry_point"] for r in rows} == {"f"}


def test_reference_answers_pass_every_test_in_the_sandbox(tmp_path: Path) -> None:
    require_isolation()
    path = code_data.write(tmp_path / "three.jsonl", 3, 7)
    task = load_task(f"code:{path}", {"timeout": "60"})  # (it probes isolation: no loop)
    assert isinstance(task, CodeTask)
    rng = random.Random(7)

    async def check() -> None:
        for index in range(3):
            problem = code_data.draw(rng)
            item = Problem(index, "", task._train[index].answer, data={"row": index})
            right = await task.score(problem.answer, item)  # the prompt's head + the answer
            assert right.total == 1.0 and len(right.components) == code_data.TESTS
            assert (await task.score(" x + 100", item)).total == 0.0

    anyio.run(check)


def test_the_packaged_code_model_is_small_named_and_in_band() -> None:
    meta = json.loads((CODE_MODEL / "engine_model.json").read_text())
    assert meta["model_name"] == "engine-local/tiny-code"
    assert (CODE_MODEL / "model.safetensors").stat().st_size < 2 * 1024 * 1024
    assert 0.2 <= meta["greedy_pass_rate"] <= 0.6
    assert packaged_name(CODE_MODEL) == "tiny-code"
    assert meta["made_by"].startswith("python -m scripts.make_model --code")


def test_the_code_build_is_its_own_mode(capsys: pytest.CaptureFixture[str]) -> None:
    from scripts import make_model

    args = make_model._parse_args(["--code"])
    assert (args.out, args.name) == (CODE_MODEL, "engine-local/tiny-code")
    with pytest.raises(SystemExit) as stop:
        make_model._parse_args(["--code", "--environments"])
    assert stop.value.code == 2
    assert "--code and --environments build different models" in capsys.readouterr().err


def test_the_build_never_trains_on_the_shipped_problems() -> None:
    from scripts import make_model

    shipped = [json.loads(line) for line in code_data.PROBLEMS_FILE.read_text().splitlines()]
    avoid = frozenset(str(row["prompt"]) for row in shipped[:200])
    tokenizer = make_model.build_tokenizer()
    rng = random.Random(0)
    ids, _ = make_model._code_batch(tokenizer, rng, 256, avoid)
    texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
    assert not any(text.split("\n    return")[0] + "\n    return" in avoid for text in texts)
    held = make_model.code_eval_problems(1, 256, avoid)
    assert not any(p.prompt in avoid for p in held)
