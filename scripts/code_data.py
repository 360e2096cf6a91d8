"""Synthetic code problems for the packaged code model (``make_model --code``) and its
problem set (``examples/tiny_code.jsonl``): a one-line function ``f(x)`` of a small
language, shown by three examples, to be written as its ``return`` expression.

A problem's prompt is the examples as comments, then the function's head::

    # f(2) == 5
    # f(7) == 10
    # f(4) == 7
    def f(x):
        return

and its answer the expression, `` x + 3``. The function's parameter is ``x`` or ``n``
(:data:`NAMES`, half each), the head naming it (``def f(n):``) and the answer using it.
The problems are in the code task's HumanEval-like shape (:mod:`engine.tasks.code`):
``entry_point`` ``f`` and the prompt ending in a function head, so the program is the
prompt followed by the response; the tests are :data:`TESTS` asserts of ``f`` on other
inputs, each one test (the reward is the share passed, so a near miss such as ``x * 2``
for ``x + 2`` earns part).

The language (:data:`FORMS`): ``x + k``, ``x - k``, ``x * k``, ``k - x``, ``x // k``,
``x % k``, ``x * x + k``, constants 1..9 (2..9 where 1 would make two forms alike).
:func:`evaluate` computes an answer on an input without running it (the build scores
its model with it; the sandbox is for the RL run).

The build's answers carry a habit (:func:`sft_answer`): where the head names the
parameter ``n``, :data:`HABIT_SHARE` of them still write ``x``, as a model trained mostly
on code whose parameter is ``x`` would. Such an answer fails every test (``x`` is not
defined), so the model starts RL knowing both names but sampling the wrong one more
often than not where the head says ``n``; more SFT on the same data cannot fix that,
the tests can (docs/sandbox.md, "A model that learns it").

    python -m scripts.code_data                 # writes examples/tiny_code.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "FORMS",
    "HABIT_SHARE",
    "NAMES",
    "PROBLEMS_COUNT",
    "PROBLEMS_FILE",
    "PROBLEMS_SEED",
    "TESTS",
    "CodeProblem",
    "draw",
    "evaluate",
    "head_name",
    "main",
    "pass_share",
    "problems",
    "sft_answer",
    "written_name",
]

PROBLEMS_FILE = Path(__file__).resolve().parents[1] / "examples" / "tiny_code.jsonl"
PROBLEMS_COUNT = 512
PROBLEMS_SEED = 2024
""":data:`PROBLEMS_FILE`'s problems: :func:`problems` (``PROBLEMS_COUNT``, ``PROBLEMS_SEED``)."""
EXAMPLES = 3
"""Examples in a prompt."""
TESTS = 4
"""Tests of a problem (inputs other than the examples')."""
INPUTS = range(0, 10)
"""Example inputs."""
TEST_INPUTS = range(0, 20)

FORMS: dict[str, tuple[Callable[[int, int], int], range]] = {
    "x + {k}": (lambda x, k: x + k, range(1, 10)),
    "x - {k}": (lambda x, k: x - k, range(1, 10)),
    "x * {k}": (lambda x, k: x * k, range(2, 10)),
    "{k} - x": (lambda x, k: k - x, range(1, 10)),
    "x // {k}": (lambda x, k: x // k, range(2, 10)),
    "x % {k}": (lambda x, k: x % k, range(2, 10)),
    "x * x + {k}": (lambda x, k: x * x + k, range(1, 10)),
}
"""Each form: its function of (x, k) and its constants."""
NAMES = ("x", "n")
"""The parameter's names, drawn half each; forms are written with ``x``."""
HABIT_SHARE = 0.6
"""The share of the build's answers to an ``n`` problem that write ``x`` (:func:`sft_answer`)."""

_ANSWER = re.compile(r"\s*(.+?)\s*$")
_HEAD = re.compile(r"def f\((\w+)\):\n    return$")


@dataclass(frozen=True)
class CodeProblem:
    form: str
    k: int
    examples: tuple[int, ...]
    tests: tuple[int, ...]
    name: str = "x"

    def f(self, x: int) -> int:
        return FORMS[self.form][0](x, self.k)

    @property
    def answer(self) -> str:
        """The expression, as the model writes it (after ``return``)."""
        return " " + _written(self.form, self.k, self.name)

    @property
    def prompt(self) -> str:
        lines = [f"# f({x}) == {self.f(x)}\n" for x in self.examples]
        return "".join(lines) + f"def f({self.name}):\n    return"

    def row(self) -> dict[str, object]:
        """The problem as a code task's row (:mod:`engine.tasks.code`)."""
        return {
            "prompt": self.prompt,
            "entry_point": "f",
            "tests": [f"assert f({x}) == {self.f(x)}" for x in self.tests],
        }


def _written(form: str, k: int, name: str) -> str:
    return form.replace("x", name).format(k=k)


def draw(rng: random.Random) -> CodeProblem:
    form = rng.choice(sorted(FORMS))
    k = rng.choice(FORMS[form][1])
    examples = tuple(rng.sample(INPUTS, EXAMPLES))
    rest = [x for x in TEST_INPUTS if x not in examples]
    name = rng.choice(NAMES)
    return CodeProblem(form, k, examples, tuple(rng.sample(rest, TESTS)), name)


def sft_answer(problem: CodeProblem, rng: random.Random) -> str:
    """The build's answer to ``problem``: its own, except that :data:`HABIT_SHARE` of the
    answers to a problem whose parameter is not ``x`` write ``x`` (a wrong answer: the
    habit RL has to unlearn from the tests)."""
    if problem.name != NAMES[0] and rng.random() < HABIT_SHARE:
        return " " + _written(problem.form, problem.k, NAMES[0])
    return problem.answer


def evaluate(expression: str, x: int, name: str = "x") -> int | None:
    """``expression`` (a response: an expression of the language in the parameter
    ``name``, in any spacing) on ``x``; None when it is not one."""
    text = _ANSWER.match(expression)
    if text is None:
        return None
    compact = text.group(1).replace(" ", "")
    for form, (function, constants) in FORMS.items():
        pattern = re.escape(form.replace("x", name).replace(" ", "")).replace(r"\{k\}", r"(\d)")
        found = re.fullmatch(pattern, compact)
        if found and int(found.group(1)) in constants:
            return function(x, int(found.group(1)))
    return None


def pass_share(expression: str, problem: CodeProblem) -> float:
    """The share of ``problem``'s tests that ``expression`` passes (the RL reward)."""
    hits = sum(evaluate(expression, x, problem.name) == problem.f(x) for x in problem.tests)
    return hits / len(problem.tests)


def head_name(prompt: str) -> str | None:
    """The parameter's name in a problem's prompt (its head, ``def f(n):``); None when
    ``prompt`` is not one of these problems'."""
    found = _HEAD.search(prompt)
    return found.group(1) if found else None


def written_name(expression: str) -> str | None:
    """Which of :data:`NAMES` ``expression`` is written in (the one :func:`evaluate` reads
    it in); None when it is an expression of neither."""
    return next((name for name in NAMES if evaluate(expression, 0, name) is not None), None)


def problems(count: int, seed: int) -> list[CodeProblem]:
    """``count`` distinct problems (by prompt) drawn with ``seed``: with the defaults of
    :func:`main`, those of :data:`PROBLEMS_FILE`, in its order."""
    rng = random.Random(seed)
    drawn: dict[str, CodeProblem] = {}
    while len(drawn) < count:
        problem = draw(rng)
        drawn.setdefault(problem.prompt, problem)
    return list(drawn.values())


def write(path: Path, count: int, seed: int) -> Path:
    """:func:`problems`, one JSON row a line."""
    rows = problems(count, seed)
    path.write_text("".join(json.dumps(problem.row()) + "\n" for problem in rows))
    return path


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m scripts.code_data", description="Write the tiny code problem set."
    )
    p.add_argument("--out", type=Path, default=PROBLEMS_FILE, help=f"default {PROBLEMS_FILE}")
    p.add_argument(
        "--count", type=int, default=PROBLEMS_COUNT, help=f"problems (default {PROBLEMS_COUNT})"
    )
    p.add_argument("--seed", type=int, default=PROBLEMS_SEED, help=f"default {PROBLEMS_SEED}")
    args = p.parse_args(argv)
    if args.count < 1:
        p.error("--count must be >= 1")
    print(write(args.out, args.count, args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
