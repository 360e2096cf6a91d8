"""Code tasks (``--task code:PATH``): the shipped problems in each shape (asserts,
HumanEval's check function, stdin/stdout pairs) scored in the sandbox with the share of
tests passed and each test's outcome as a component; failures that name their reason;
rows and arguments checked when the task loads; the refusal where the machine cannot
isolate; and a pipeline run whose responses are not code goes on, scoring 0."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fake_session import FakeSession
from test_pipeline_stages import config, run_pipeline

import engine.sandbox.isolation as isolation
from engine.catalog import load_task
from engine.core.problems import Problem
from engine.errors import ConfigError
from engine.tasks.code import CODE_ARGS, CodeTask, extract_code, program_of
from engine.tasks.dataset import raw_prompts_warning
from tests.sandbox_support import require_isolation

PROBLEMS = Path(__file__).resolve().parents[1] / "examples" / "code_problems.jsonl"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def isolated() -> Iterator[None]:
    require_isolation()
    yield


@pytest.fixture
def task(isolated: None) -> CodeTask:
    loaded = load_task(f"code:{PROBLEMS}", {"timeout": "60"})
    assert isinstance(loaded, CodeTask)
    return loaded


def problem(task: CodeTask, index: int) -> Problem:
    return Problem(id=index, question="", answer=task._train[index].answer, data={"row": index})


PROMPT_0 = "Write a Python function add(a, b) that returns the sum of a and b."
FENCED_ADD = "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```\nDone."


@pytest.mark.anyio
async def test_asserts_score_the_share_passed_with_each_test_a_component(task: CodeTask) -> None:
    right = await task.score(FENCED_ADD, problem(task, 0))
    half = await task.score("def add(a, b):\n    return a + b if a else 99", problem(task, 0))
    assert right.total == 1.0 and right.components == {"test_0": 1, "test_1": 1, "test_2": 1}
    assert half.total == pytest.approx(2 / 3)
    assert half.components == {"test_0": 1, "test_1": 1, "test_2": 0}


@pytest.mark.anyio
async def test_humaneval_completions_and_whole_functions_both_count(task: CodeTask) -> None:
    body = "    return n % 2 == 0\n"
    whole = "```python\ndef is_even(n):\n    return not n % 2\n```"
    wrong = "    return n % 2 == 1\n"
    assert (await task.score(body, problem(task, 3))).total == 1.0
    assert (await task.score(whole, problem(task, 3))).total == 1.0
    assert (await task.score(wrong, problem(task, 3))).components == {"test_0": 0.0}


@pytest.mark.anyio
async def test_stdin_stdout_pairs_each_run_the_program(task: CodeTask) -> None:
    product = "a, b = map(int, input().split())\nprint(a * b)"
    counting = "for i in range(1, int(input()) + 1):\n    print(i)"
    assert (await task.score(product, problem(task, 5))).total == 1.0
    off_by_one = await task.score("print(int(input().split()[0]) * 3)", problem(task, 5))
    assert off_by_one.components == {"test_0": 1.0, "test_1": 0.0}
    assert (await task.score(counting, problem(task, 6))).total == 1.0


@pytest.mark.anyio
async def test_failures_score_0_and_say_why(isolated: None) -> None:
    task = CodeTask(PROBLEMS, limits=None)
    short = load_task(f"code:{PROBLEMS}", {"timeout": "1"})
    assert isinstance(short, CodeTask)
    broken = await task.score("def add(a, b) return a + b", problem(task, 0))
    assert broken.total == 0.0 and broken.components["error"] == 1.0
    spinning = await short.score("while True:\n    pass", problem(short, 0))
    assert spinning.total == 0.0 and spinning.components["limit_wall"] == 1.0
    stdio_spin = await short.score("while True:\n    pass", problem(short, 5))
    assert stdio_spin.total == 0.0 and stdio_spin.components["limit_wall"] == 1.0


@pytest.mark.anyio
async def test_attacks_in_a_response_score_0_with_the_reason(isolated: None) -> None:
    task = load_task(f"code:{PROBLEMS}", {"timeout": "1", "memory_mb": "128"})
    assert isinstance(task, CodeTask)
    fork_bomb = (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    )
    flood = "while True:\n    print('x' * 4096)"
    memory = "hog = [bytearray(16 << 20) for _ in range(64)]"
    bombed = await task.score(fork_bomb, problem(task, 0))
    flooded = await task.score(flood, problem(task, 5))
    hogged = await task.score(memory, problem(task, 5))
    assert bombed.total == 0.0 and bombed.components.keys() & {"limit_wall", "limit_cpu"}
    assert flooded.total == 0.0 and flooded.components["limit_output"] == 1.0
    assert hogged.total == 0.0 and hogged.components["limit_memory"] == 1.0


@pytest.mark.anyio
async def test_leaving_early_or_printing_results_does_not_pass(task: CodeTask) -> None:
    leaves = "import os\nos._exit(0)"
    forged = 'print(\'{"test": 0, "passed": true}\')\nprint(\'{"test": 1, "passed": true}\')'
    assert (await task.score(leaves, problem(task, 0))).total == 0.0
    assert (await task.score(forged, problem(task, 0))).total == 0.0


def test_the_program_is_the_first_fenced_block_else_the_response() -> None:
    assert extract_code(FENCED_ADD) == "def add(a, b):\n    return a + b\n"
    assert extract_code("```\nx = 1\n```\n```python\ny = 2\n```") == "x = 1\n"
    assert extract_code("print(1)") == "print(1)"
    spec = {"prefix": "def f(x):\n", "entry_point": "f"}
    assert program_of("    return x\n", spec) == "def f(x):\n    return x\n"
    assert program_of("def f(x):\n    return 2\n", spec) == "def f(x):\n    return 2\n"


def test_the_task_loads_its_rows_holds_out_and_records_its_spec(isolated: None) -> None:
    task = load_task(f"code:{PROBLEMS}", {"eval_size": "2", "timeout": "5"})
    assert isinstance(task, CodeTask)
    assert task.name == "code-code_problems"
    assert len(task.eval_problems()) == 2 and len(task._train) == 6
    assert task.spec == (f"code:{PROBLEMS}", {"eval_size": "2", "timeout": "5"})
    first = task.source(0).next()
    assert first is not None and isinstance(task.prompt(first), str)


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"prompt": "p"}, "has no tests field 'tests'"),
        ({"prompt": "p", "tests": 3}, "must be Python test statements"),
        ({"prompt": "p", "tests": []}, "must be Python test statements"),
        ({"tests": ["assert True"]}, "has no prompt field"),
    ],
)
def test_a_bad_row_is_one_line_naming_it(
    isolated: None, tmp_path: Path, row: dict[str, Any], message: str
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "ok", "tests": ["assert 1"]}) + "\n" + json.dumps(row))
    with pytest.raises(ConfigError, match=message) as raised:
        load_task(f"code:{path}")
    assert f"{path}:2" in str(raised.value) and "\n" not in str(raised.value)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"timout": "3"}, "unknown task argument 'timout'"),
        ({"timeout": "0"}, "timeout must be > 0"),
        ({"memory_mb": "lots"}, "memory_mb must be a number"),
        ({"max_concurrent": "0"}, "max_concurrent must be >= 1"),
        ({"format": "csv"}, "format must be jsonl or hf"),
        ({"split": "train"}, "unknown task argument 'split'"),
    ],
)
def test_bad_arguments_are_one_line(isolated: None, args: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_task(f"code:{PROBLEMS}", args)


def test_empty_path_is_one_line() -> None:
    with pytest.raises(ConfigError, match="name the problems"):
        load_task("code:")


def test_without_isolation_the_task_refuses_unless_told(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(isolation, "_probed", {})
    with pytest.raises(ConfigError, match="cannot isolate") as refused:
        load_task(f"code:{PROBLEMS}")
    assert "unsafe_no_isolation=true" in str(refused.value) and "\n" not in str(refused.value)
    task = load_task(f"code:{PROBLEMS}", {"unsafe_no_isolation": "true"})
    assert isinstance(task, CodeTask) and task.sandbox.allow_unisolated


@pytest.mark.anyio
async def test_a_pipeline_whose_responses_are_not_code_goes_on_scoring_0(
    task: CodeTask,
) -> None:
    _, results = await run_pipeline(FakeSession(), config(steps=2), task=task)
    assert len(results) == 2
    episodes = [t for r in results for g in r.groups for t in g.trajectories]
    assert episodes and all(t.total_reward == 0.0 for t in episodes)
    # the reason rides with the reward: the fake sampler's "<version> <i>" is no Python
    assert all(t.group_reward.components["error"] == 1.0 for t in episodes)


@pytest.mark.anyio
async def test_mbpp_test_imports_run_before_the_asserts(isolated: None, tmp_path: Path) -> None:
    row = {
        "prompt": "Write area(r), the area of a circle of radius r.",
        "test_list": ["assert math.isclose(area(1), math.pi)"],
        "test_imports": ["import math"],
    }
    path = tmp_path / "mbpp.jsonl"
    path.write_text(json.dumps(row) + "\n")
    task = load_task(f"code:{path}", {"timeout": "60"})
    assert isinstance(task, CodeTask)
    solution = "def area(r):\n    return 3.141592653589793 * r * r"
    assert (await task.score(solution, problem(task, 0))).total == 1.0


def test_every_task_argument_is_documented() -> None:
    page = (PROBLEMS.parents[1] / "docs" / "sandbox.md").read_text(encoding="utf-8")
    section = page.split("## Code tasks", 1)[1].split("\n## ", 1)[0]
    missing = [name for name in CODE_ARGS if f"`{name}`" not in section]
    assert not missing, f"docs/sandbox.md's code task arguments lack {missing}"


@pytest.mark.anyio
async def test_a_saved_hugging_face_dataset_of_mixed_shapes_loads_with_format_hf(
    isolated: None, tmp_path: Path
) -> None:
    datasets = pytest.importorskip("datasets")
    rows = [json.loads(line) for line in PROBLEMS.read_text().splitlines()]
    # One column set for every row (None where a row has no value), as datasets stores it;
    # a column holds one type (row 5's list of pairs would clash with row 0's list of str).
    splits = {"train": rows[:5], "test": rows[6:]}
    columns = {key for row in rows for key in row}
    datasets.DatasetDict(
        {
            name: datasets.Dataset.from_dict({k: [r.get(k) for r in part] for k in columns})
            for name, part in splits.items()
        }
    ).save_to_disk(str(tmp_path / "saved"))
    task = load_task(f"code:{tmp_path / 'saved'}", {"format": "hf", "eval_split": "test"})
    assert isinstance(task, CodeTask) and len(task._train) == 5
    assert [p.answer["kind"] for p in task.eval_problems()] == ["stdio", "asserts"]
    assert task.spec[1] == {"format": "hf", "eval_split": "test"}
    fenced = "```python\ndef add(a, b):\n    return a + b\n```"
    assert (await task.score(fenced, problem(task, 0))).total == 1.0


def test_plain_prompts_to_a_chat_model_get_the_datasets_warning(isolated: None) -> None:
    class ChatTokenizer:
        chat_template = "{{ messages }}"

    raw = load_task(f"code:{PROBLEMS}")
    chat = load_task(f"code:{PROBLEMS}", {"chat": "true"})
    warning = raw_prompts_warning(raw, ChatTokenizer())
    assert warning is not None and "--task-arg chat=true" in warning
    assert raw_prompts_warning(chat, ChatTokenizer()) is None
    assert isinstance(chat, CodeTask)
    assert chat.prompt(problem(chat, 0)) == [{"role": "user", "content": PROMPT_0}]
