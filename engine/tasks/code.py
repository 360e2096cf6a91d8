"""Code tasks: ``--task code:PATH``, problems with tests, the response's code run in the
sandbox (:mod:`engine.sandbox`) and rewarded with the share of tests it passes.

Each JSONL line (each row of a Hugging Face dataset on disk, ``--task-arg format=hf``) is
one problem: a prompt (``prompt_field``; default ``messages``, ``prompt``, ``question``
or ``text``) and tests (``tests_field``; default ``tests``, ``test_list``, ``test`` or
``input_output``) in one of these shapes:

* **asserts** (MBPP): a list of Python statements, e.g. ``"assert add(1, 2) == 3"``;
  ``test_setup_code`` or ``test_imports`` (MBPP's) run before them. Each statement is
  one test.
* **a check function** (HumanEval): ``test`` defines ``check(candidate)`` and
  ``entry_point`` names the function: one test, ``check(entry_point)``. The prompt is the
  function's head; a response that does not define ``entry_point`` itself completes it
  (the program is the prompt followed by the response).
* **stdin/stdout** (APPS, LiveCodeBench): a list of ``{"input": ..., "output": ...}``, or
  ``{"inputs": [...], "outputs": [...]}``, either possibly as a JSON string. Each pair is
  one test: the program runs with that input, and passes when its output has the same
  whitespace-separated tokens.

The program is the first fenced code block of the response (```` ```python ````), else
the whole response. The reward is the share of tests passed; its components are each
test's outcome (``test_0``, ``test_1``... 1 or 0), ``error`` (1: the program failed
before any assert test ran, e.g. a syntax error, or a stdin/stdout run ended with a
non-zero status) and ``limit_<name>`` (1: a sandbox limit stopped a run: ``limit_wall``,
``limit_memory``...), so a rollout says why it scored 0.

Assert tests run in one sandbox run per response: a small harness loads the program, runs
each test and reports each outcome on a line tagged with a random nonce. The program runs
in the harness's interpreter, so code that aims to can still forge its results (it can
reach the harness's frames); what it cannot do is leave early with exit status 0 and pass
(no report, no pass), or print results without the nonce. Stdin/stdout tests run the
program once per test, in parallel up to the sandbox's ``max_concurrent``.
"""

from __future__ import annotations

import functools
import json
import re
import secrets
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Unpack

import anyio

from engine.core.problems import Problem, RewardBreakdown
from engine.errors import ConfigError
from engine.sandbox import Sandbox, SandboxLimits, SandboxResult
from engine.sandbox.isolation import isolation_problem_now
from engine.tasks.dataset import (
    DATASET_ARGS,
    DataFormat,
    Row,
    RowArgs,
    RowTask,
    _rows_digest,
    flag_arg,
    int_arg,
    known_args,
    row_args,
    rows_of,
)
from engine.tasks.rewards import _positive

__all__ = [
    "CODE_ARGS",
    "FEEDBACK_CHARS",
    "CodeCheck",
    "CodeTask",
    "code_spec",
    "extract_code",
    "program_of",
]

CODE_ARGS: Final[Mapping[str, str]] = {
    "prompt_field": "field holding the prompt: a string or chat messages (default: messages, "
    "else prompt, else question, else text)",
    "tests_field": "field holding the tests (default: tests, else test_list, else test, "
    "else input_output)",
    "format": "jsonl (default) or hf: a Hugging Face dataset saved to disk",
    "timeout": "wall-clock seconds of one sandbox run (default 10)",
    "memory_mb": "memory of one sandbox run's processes, each (default 512)",
    "max_concurrent": "sandbox runs at once (default: the CPU count)",
    "unsafe_no_isolation": "true: where neither bubblewrap nor unshare can isolate, run the "
    "code without isolation (it sees this machine's files and network); default: refuse",
    **{
        k: DATASET_ARGS[k]
        for k in (
            "system",
            "chat",
            "epochs",
            "shuffle",
            "eval_size",
            "eval_path",
            "stop",
            "enable_thinking",
        )
    },
}

_PROMPT_FIELDS: Final = ("messages", "prompt", "question", "text")
_TESTS_FIELDS: Final = ("tests", "test_list", "test", "input_output")
_SPEC: Final = "__engine_code_tests"
FEEDBACK_CHARS: Final = 2000
"""The most characters of failing tests' output a revision prompt holds."""
_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.S | re.I)

HARNESS: Final = """\
import json, os, sys
nonce = sys.stdin.read().strip()
with open("tests.json") as f:
    spec = json.load(f)
with open("solution.py") as f:
    program = f.read()
for name in ("tests.json", "solution.py", "main.py"):
    os.remove(name)
write, flush = sys.stdout.write, sys.stdout.flush


def report(item):
    write("\\n" + nonce + json.dumps(item) + "\\n")
    flush()


namespace = {"__name__": "solution"}
try:
    exec(compile(program, "solution.py", "exec"), namespace)
    exec(compile(spec["setup"], "setup", "exec"), namespace)
except BaseException as exc:
    report({"load_error": "%s: %s" % (type(exc).__name__, exc)})
    raise SystemExit(0)
for i, test in enumerate(spec["tests"]):
    try:
        exec(compile(test, "test_%d" % i, "exec"), namespace)
        report({"test": i, "passed": True})
    except BaseException as exc:
        report({"test": i, "passed": False, "error": "%s: %s" % (type(exc).__name__, exc)})
"""
"""Runs in the sandbox: loads the program, then each assert test, reporting each."""


def _json_or(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _stdio_pairs(value: Any) -> list[dict[str, str]] | None:
    """Input/output pairs in the APPS or LiveCodeBench shape, or None if not that shape."""
    if isinstance(value, dict) and isinstance(value.get("inputs"), list):
        outputs = value.get("outputs")
        if not isinstance(outputs, list) or len(outputs) != len(value["inputs"]):
            return None
        value = [{"input": i, "output": o} for i, o in zip(value["inputs"], outputs, strict=True)]
    if (
        isinstance(value, list)
        and value
        and all(isinstance(t, dict) and "input" in t and "output" in t for t in value)
    ):
        return [{"input": _text(t["input"]), "output": _text(t["output"])} for t in value]
    return None


def _text(value: Any) -> str:
    if isinstance(value, list):
        return "\n".join(str(v) for v in value)
    return str(value)


def code_spec(record: Mapping[str, Any], where: str, tests_field: str | None) -> dict[str, Any]:
    """A row's tests as the task runs them: ``{"kind": "asserts", "tests": [...],
    "setup": ..., "prefix": ..., "entry_point": ...}`` or ``{"kind": "stdio", "tests":
    [{"input", "output"}...]}``; a ConfigError names ``where`` when they are not one of
    the shapes in the module docstring."""
    # (a Hugging Face dataset's rows hold every column: None where a row has no value)
    field = tests_field or next(
        (f for f in _TESTS_FIELDS if record.get(f) is not None), _TESTS_FIELDS[0]
    )
    if record.get(field) is None:
        raise ConfigError(f"{where} has no tests field {field!r}")
    raw = record[field]
    stdio = _stdio_pairs(_json_or(raw))
    if stdio is not None:
        return {"kind": "stdio", "tests": stdio}
    entry_point = record.get("entry_point")
    setup = record.get("test_setup_code") or ""
    imports = record.get("test_imports")  # MBPP sanitized: a list of import lines
    if isinstance(imports, list) and all(isinstance(line, str) for line in imports):
        setup = "\n".join([*imports, setup] if setup else imports)
    if isinstance(raw, str) and raw.strip():
        tests = [raw + (f"\ncheck({entry_point})\n" if entry_point else "")]
    elif isinstance(raw, list) and raw and all(isinstance(t, str) and t.strip() for t in raw):
        tests = list(raw)
    else:
        raise ConfigError(
            f"{where}: tests field {field!r} must be Python test statements (a string or a "
            "list of strings) or stdin/stdout pairs ([{input, output}...])"
        )
    if not isinstance(setup, str) or (entry_point is not None and not isinstance(entry_point, str)):
        raise ConfigError(f"{where}: test_setup_code and entry_point must be strings")
    prompt = record.get("prompt")
    prefix = prompt if entry_point and isinstance(prompt, str) else ""
    return {
        "kind": "asserts",
        "tests": tests,
        "setup": setup,
        "prefix": prefix,
        "entry_point": entry_point or "",
    }


def extract_code(response: str) -> str:
    """The first fenced code block of ``response`` (```` ```python ```` or bare), else
    the response itself."""
    found = _FENCE.search(response)
    return found.group(1) if found else response


def program_of(response: str, spec: Mapping[str, Any]) -> str:
    """The program a response stands for: its code, after the prompt's function head
    when it completes one (HumanEval) rather than defining ``entry_point`` itself."""
    code = extract_code(response)
    entry_point = spec.get("entry_point") or ""
    prefix = spec.get("prefix") or ""
    if prefix and not re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", code, re.M):
        return prefix + code
    return code


def _code_rows(
    records: Iterable[tuple[str, Any]],
    name: str,
    *,
    prompt_field: str | None,
    tests_field: str | None,
) -> list[Row]:
    def shaped() -> Iterator[tuple[str, Any]]:
        for where, record in records:
            if isinstance(record, dict):
                record = {**record, _SPEC: code_spec(record, where, tests_field)}
                if prompt_field is None:
                    field = next(
                        (f for f in _PROMPT_FIELDS if record.get(f) is not None),
                        _PROMPT_FIELDS[0],
                    )
                    record[_SPEC + "_prompt"] = record.get(field)
                    if record.get(field) is None:
                        raise ConfigError(f"{where} has no prompt field {field!r}")
            yield where, record

    return rows_of(shaped(), prompt_field or _SPEC + "_prompt", _SPEC, name)


class CodeTask(RowTask):
    """Problems with tests, the response's program run in the sandbox; the reward is the
    share of tests passed (see the module docstring). Build it with :meth:`from_args`
    (what ``--task code:PATH`` with ``--task-arg KEY=VALUE`` does) or directly."""

    skip_special_tokens = True
    name_prefix = "code"

    def __init__(
        self,
        path: str | Path,
        *,
        prompt_field: str | None = None,
        tests_field: str | None = None,
        chat: bool | None = None,
        limits: SandboxLimits | None = None,
        max_concurrent: int | None = None,
        allow_unisolated: bool = False,
        stop: Sequence[str] = (),
        **rows: Unpack[RowArgs],
    ) -> None:
        if max_concurrent is not None and max_concurrent < 1:
            raise ConfigError(f"task argument max_concurrent must be >= 1, got {max_concurrent}")
        problem = isolation_problem_now()
        if problem is not None and not allow_unisolated:
            raise ConfigError(
                f"a code task runs the model's code, and this machine cannot isolate it: "
                f"{problem}; --task-arg unsafe_no_isolation=true runs it unisolated"
            )
        parse = functools.partial(_code_rows, prompt_field=prompt_field, tests_field=tests_field)
        super().__init__(path, parse, **rows)
        self.spec = (f"code:{self.path.resolve()}", self.spec[1])
        self._chat_or_raw(chat)
        self.stop = tuple(stop)
        self.sandbox = Sandbox(
            limits or SandboxLimits(wall_s=10.0),
            max_concurrent=max_concurrent,
            allow_unisolated=allow_unisolated,
        )
        self.data_digest = _rows_digest(self._train, self._held_out)

    @classmethod
    def from_args(cls, path: str, args: Mapping[str, str]) -> CodeTask:
        """Build from ``--task-arg`` strings (see :data:`CODE_ARGS`)."""
        data_format = args.get("format", "jsonl")
        if data_format not in ("jsonl", "hf"):
            raise ConfigError(f"task argument format must be jsonl or hf, got {data_format!r}")
        fmt: DataFormat = "hf" if data_format == "hf" else "jsonl"
        known_args(args, CODE_ARGS, fmt, "code tasks")
        rows = row_args({k: v for k, v in args.items() if k != "format"}, fmt)
        rows["args"] = dict(args)
        return cls(
            path,
            prompt_field=args.get("prompt_field"),
            tests_field=args.get("tests_field"),
            chat=flag_arg(args, "chat") if "chat" in args else None,
            limits=SandboxLimits(
                wall_s=_positive(args, "timeout", "10", allow_zero=False),
                memory_bytes=int(_positive(args, "memory_mb", "512", allow_zero=False)) << 20,
            ),
            max_concurrent=int_arg(args, "max_concurrent") if "max_concurrent" in args else None,
            allow_unisolated=flag_arg(args, "unsafe_no_isolation")
            if "unsafe_no_isolation" in args
            else False,
            stop=tuple(s for s in args.get("stop", "").split("|") if s),
            **rows,
        )

    def __repr__(self) -> str:
        return (
            f"CodeTask({str(self.path)!r}, {len(self._train)} train / "
            f"{len(self._held_out)} held-out rows)"
        )

    def prompt(self, problem: Problem) -> str | list[Mapping[str, Any]]:
        return self._prompt_of(problem)

    async def score(self, response: str, problem: Problem) -> RewardBreakdown:
        return (await self.check(response, problem)).breakdown()

    async def check(self, response: str, problem: Problem) -> CodeCheck:
        """Run ``response``'s program against ``problem``'s tests: each test's outcome,
        why runs failed, and what each failing test said."""
        spec = problem.answer
        program = program_of(response, spec)
        if spec["kind"] == "stdio":
            return await self._stdio(program, spec["tests"])
        return await self._asserts(program, spec)

    async def _asserts(self, program: str, spec: Mapping[str, Any]) -> CodeCheck:
        nonce = secrets.token_hex(16)
        tests = {"tests": spec["tests"], "setup": spec["setup"]}
        result = await self.sandbox.run_python(
            HARNESS,
            stdin=nonce,
            files={"solution.py": program, "tests.json": json.dumps(tests)},
        )
        check = CodeCheck([False] * len(spec["tests"]), _reasons(result))
        for line in result.stdout.splitlines():
            if not line.startswith(nonce):
                continue
            try:  # a line the output limit cut short is no report
                item = json.loads(line[len(nonce) :])
            except ValueError:
                continue
            if not isinstance(item, dict):
                continue
            if "load_error" in item:
                check.reasons.add("error")
                check.failures[-1] = f"the program failed to load: {item['load_error']}"
            elif isinstance(i := item.get("test"), int) and 0 <= i < len(check.outcomes):
                check.outcomes[i] = item.get("passed") is True
                if not check.outcomes[i]:
                    check.failures[i] = f"{spec['tests'][i].strip()}\n-> {item.get('error')}"
        if result.limit is not None:
            check.failures[-1] = f"stopped by the sandbox's {result.limit} limit"
        return check

    async def _stdio(self, program: str, tests: Sequence[Mapping[str, str]]) -> CodeCheck:
        results: list[SandboxResult | None] = [None] * len(tests)

        async def one(i: int) -> None:
            results[i] = await self.sandbox.run_python(program, stdin=tests[i]["input"])

        async with anyio.create_task_group() as tg:
            for i in range(len(tests)):
                tg.start_soon(one, i)
        check = CodeCheck([], set())
        for i, (test, result) in enumerate(zip(tests, results, strict=True)):
            assert result is not None
            passed = result.ok and result.stdout.split() == test["output"].split()
            check.outcomes.append(passed)
            check.reasons |= _reasons(result)
            if not passed:
                why = (
                    f"stopped by the sandbox's {result.limit} limit"
                    if result.limit is not None
                    else f"exit status {result.exit_code}: {result.stderr.strip()}"
                    if not result.ok
                    else f"expected {test['output'].strip()!r}, got {result.stdout.strip()!r}"
                )
                check.failures[i] = f"input {test['input'].strip()!r}\n-> {why}"
        return check


@dataclass
class CodeCheck:
    """One program against a problem's tests: each test's outcome, the reasons runs
    failed (``error``, ``limit_<name>``) and what each failing test said (test index ->
    text; -1: the program as a whole, e.g. it failed to load)."""

    outcomes: list[bool]
    reasons: set[str]
    failures: dict[int, str] = field(default_factory=dict)

    @property
    def share(self) -> float:
        return sum(self.outcomes) / len(self.outcomes)

    def breakdown(self) -> RewardBreakdown:
        """The reward: the share of tests passed; each test's outcome and each reason a
        component."""
        components = {f"test_{i}": 1.0 if ok else 0.0 for i, ok in enumerate(self.outcomes)}
        components.update({reason: 1.0 for reason in self.reasons})
        return RewardBreakdown(self.share, components)

    def feedback(self, max_chars: int = FEEDBACK_CHARS) -> str:
        """The failing tests' output for the model to read: each failure, at most
        ``max_chars`` characters in all (each failure a fair share of them)."""
        failed = len(self.outcomes) - sum(self.outcomes)
        head = f"{failed} of {len(self.outcomes)} tests failed."
        if not self.failures:
            return head
        each = max(80, (max_chars - len(head)) // len(self.failures) - 16)
        parts = [head]
        for i, text in sorted(self.failures.items()):
            text = text if len(text) <= each else text[: each - 3] + "..."
            parts.append(text if i < 0 else f"test {i}: {text}")
        return "\n".join(parts)[:max_chars]


def _reasons(result: SandboxResult) -> set[str]:
    if result.limit is not None:
        return {f"limit_{result.limit}"}
    return {"error"} if result.exit_code != 0 else set()
