"""The docs stay true: the README and the pages under docs/ are checked against the code
and against a real run: option tables, commands, code, the run-directory description,
links, and the README's length.

Why tests and not care: a flag renamed in ``engine/config/`` or a metric added to the
pipeline silently turns the docs into fiction; these checks fail instead.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from engine.catalog import load_task
from engine.local.__main__ import build_parser as build_local_parser
from engine.run import build_parser as build_run_parser
from engine.tasks import Problem
from examples.doubling_task import DoublingTask
from scripts.gen_config_table import GENERATED, update_sections

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
PAGES = {path: path.read_text(encoding="utf-8") for path in sorted((ROOT / "docs").glob("*.md"))}
"""Every page under docs/, by path."""
DOCS = {ROOT / "README.md": README, **PAGES}
"""The README and every page under docs/."""
RUN_DIRECTORY = (ROOT / "docs" / "run-directory.md").read_text(encoding="utf-8")
CI = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
README_MAX_LINES = 230

RUN_COMMAND = "bash scripts/bootstrap.sh && .venv/bin/python -m engine.run"
TEST_COMMAND = "bash scripts/bootstrap.sh && .venv/bin/python -m pytest"
TASK_SPEC = "examples.doubling_task:DoublingTask"


def _blocks(lang: str, text: str = README) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE)


def _section(title: str, text: str = README) -> str:
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.DOTALL | re.M)
    assert match is not None, f"no '## {title}' section"
    return match.group(1)


def _generated(name: str) -> str:
    pattern = (
        rf"<!-- BEGIN {re.escape(name)} \(generated\) -->\n(.*?)<!-- END {re.escape(name)} -->"
    )
    found = [m.group(1) for text in PAGES.values() for m in re.finditer(pattern, text, re.DOTALL)]
    assert len(found) == 1, f"docs/ should hold the generated '{name}' section once"
    return found[0]


def _parser_flags(parser: argparse.ArgumentParser) -> set[str]:
    return {
        flag
        for action in parser._actions
        if not isinstance(action, argparse._HelpAction | argparse._VersionAction)
        for flag in action.option_strings
        if flag.startswith("--")
    }


def _table_flags(table: str) -> set[str]:
    return set(re.findall(r"^\| `(--[a-z-]+)` \|", table, flags=re.MULTILINE))


@pytest.mark.parametrize("page", sorted(GENERATED), ids=lambda page: page.name)
def test_option_tables_are_generated_from_the_current_code(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    assert update_sections(text, GENERATED[page]) == text, (
        f"{page.name} option tables are stale: run python -m scripts.gen_config_table --write"
    )


@pytest.mark.parametrize(
    ("name", "parser"),
    [("engine.run options", build_run_parser()), ("engine.local options", build_local_parser())],
)
def test_every_flag_is_in_its_table_and_every_row_is_a_flag(
    name: str, parser: argparse.ArgumentParser
) -> None:
    assert _table_flags(_generated(name)) == _parser_flags(parser)


def _commands() -> list[str]:
    """Every line of every bash block in the docs, continuation lines joined."""
    blocks = [block for text in DOCS.values() for block in _blocks("bash", text)]
    return [line for block in blocks for line in block.replace("\\\n", " ").splitlines()]


def test_every_flag_used_in_a_documented_command_exists() -> None:
    run_flags, local_flags = _parser_flags(build_run_parser()), _parser_flags(build_local_parser())
    checked = 0
    for line in _commands():
        code = line.split("#", 1)[0]
        for program, known in (("engine.run", run_flags), ("engine.local", local_flags)):
            if f"-m {program}" in code:
                used = set(re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", code))
                assert used <= known, f"unknown {program} flags {used - known} in: {line}"
                checked += 1
    assert checked >= 5


def test_the_two_commands_are_documented_and_ci_runs_the_test_command() -> None:
    commands = _section("Two commands")
    assert f"\n{RUN_COMMAND}\n" in commands
    assert f"\n{TEST_COMMAND}\n" in commands
    ci_lines = [line.strip() for line in CI.splitlines() if not line.lstrip().startswith("#")]
    assert TEST_COMMAND in ci_lines
    assert "set -euo pipefail" in ci_lines


def test_ci_lints_paths_that_exist() -> None:
    for line in CI.splitlines():
        if line.startswith(".venv/bin/ruff"):
            paths = [word for word in line.split()[2:] if not word.startswith("-")]
            assert paths, line
            for path in paths:
                assert (ROOT / path).exists(), f"{path} in .ci/run does not exist"


def test_python_blocks_compile_and_their_imports_resolve() -> None:
    blocks = [block for text in DOCS.values() for block in _blocks("python", text)]
    assert len(blocks) >= 2
    for block in blocks:
        tree = ast.parse(block)
        imports = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
        assert imports, f"a Python block imports nothing:\n{block}"
        module = ast.Module(body=list[ast.stmt](imports), type_ignores=[])
        exec(compile(module, "<docs>", "exec"), {})


def test_the_embedding_snippet_defines_a_working_coroutine() -> None:
    snippet = next(b for b in _blocks("python") if "async with Engine(" in b)
    namespace: dict[str, object] = {}
    exec(compile(snippet, "README.md", "exec"), namespace)
    assert inspect.iscoroutinefunction(namespace["train"])
    assert callable(namespace["on_step"])


def test_the_task_example_is_the_file_and_loads() -> None:
    snippet = next(b for b in _blocks("python") if "class DoublingTask" in b)
    source = (ROOT / "examples" / "doubling_task.py").read_text(encoding="utf-8")
    assert snippet.strip() in source
    assert f"--task {TASK_SPEC}" in README
    task = load_task(TASK_SPEC)
    assert isinstance(task, DoublingTask)
    first = task.source(7).next()
    again = task.source(7).next()
    assert first == again and first.id == 0
    assert task.score(f" {first.answer}", first).total == 1.0
    assert task.score(" 1", Problem(id=0, question="", answer=2)).total == pytest.approx(0.1)
    assert task.score(" none", first).total == 0.0


def test_the_agent_snippet_copied_as_written_runs_on_the_agent_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/agents.md's AgentTask snippet, saved as a module and named by ``--task``,
    asks the local server for the packaged agent model (the one that knows the tool-call
    format), not the server's default model."""
    from engine.basemodels.catalogue import AGENT_MODEL_DIR
    from engine.catalog import preferred_local_model

    page = PAGES[ROOT / "docs" / "agents.md"]
    snippet = next(b for b in _blocks("python", page) if "AgentTask(episode" in b)
    (tmp_path / "my_agent_snippet.py").write_text(snippet, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert preferred_local_model(None, "my_agent_snippet:task") == AGENT_MODEL_DIR


def test_the_own_reward_example_scores_the_documented_jsonl_task(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/tasks.md's ``reward=module:function`` example, saved as the file it names
    and run with the task and arguments of its command, scores the data's rows."""
    from engine.tasks.dataset import DatasetTask

    page = PAGES[ROOT / "docs" / "tasks.md"]
    snippet = next(b for b in _blocks("python", page) if b.startswith("# my_reward.py"))
    command = next(b for b in _blocks("bash", page) if "reward=my_reward:reward" in b)
    (tmp_path / "my_reward.py").write_text(snippet, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = re.search(r"--task (\S+)", command)
    args = dict(a.split("=", 1) for a in re.findall(r"--task-arg (\S+)", command))
    assert spec is not None and args["reward"] == "my_reward:reward"
    monkeypatch.chdir(ROOT)
    task = load_task(spec.group(1), args)
    assert isinstance(task, DatasetTask)  # (its score is a plain function: my_reward's)
    problem = task.source(0).next()
    assert problem is not None
    right = task.score(f" {problem.answer}", problem)
    assert (right.total, dict(right.components)) == (1.1, {"correct": 1.0, "brief": 0.1})
    assert task.score(" 0", problem).components == {"correct": 0.0, "brief": 0.0}


def _documented_metrics() -> list[re.Pattern[str]]:
    section = _section("Fields of each `metrics.jsonl` line", RUN_DIRECTORY)
    rows = [line.split(" | ")[0] for line in section.splitlines() if line.startswith("| `")]
    names = [name for row in rows for name in re.findall(r"`([a-z0-9_/<>]+)`", row)]
    return [re.compile(re.escape(n).replace("<component>", "[a-z_]+") + "$") for n in names]


@pytest.mark.slow
def test_the_documented_task_command_trains_and_the_run_dir_is_as_documented(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MINT_", "TINKER_"))}
    done = subprocess.run(
        [
            sys.executable,
            *["-m", "engine.run", "--task", TASK_SPEC, "--steps", "1", "--batch", "2"],
            *["--group", "2", "--max-tokens", "4", "--run-dir", str(run_dir), "--no-progress"],
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1].startswith("Saved: tinker://")
    assert "/sampler_weights/doubling-final" in done.stdout

    files = _section("Files", RUN_DIRECTORY)
    documented = re.findall(r"^\| `([\w./-]+)`", files, flags=re.MULTILINE)
    documented += re.findall(r"^\| `[\w./-]+`, `([\w./-]+)`", files, flags=re.MULTILINE)
    assert {"config.json", "metrics.jsonl", "local-server/"} <= set(documented)
    for name in documented:
        assert (run_dir / name.rstrip("/")).exists(), (
            f"run-directory.md documents {name}; not written"
        )

    line = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    patterns = _documented_metrics()
    structlog_keys = {"event", "level", "time"}
    undocumented = [
        key for key in line if key not in structlog_keys and not any(p.match(key) for p in patterns)
    ]
    assert not undocumented, f"metrics.jsonl fields missing from run-directory.md: {undocumented}"
    # The real server's calls were billed (docs/settings.md#tokens-and-cost).
    assert all(line[f"tokens/{kind}"] > 0 for kind in ("prefill", "sampled", "trained"))
    assert "- tokens billed: prefill " in (run_dir / "summary.md").read_text()


def test_every_module_the_architecture_page_names_exists() -> None:
    page = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    modules = set(re.findall(r"\b([a-z_]+(?:/[a-z_]+)*\.py)\b", page))
    assert len(modules) >= 20
    sources = {
        str(p.relative_to(ROOT)) for top in ("engine", "tests") for p in (ROOT / top).rglob("*.py")
    }
    missing = [m for m in modules if not any(s == m or s.endswith("/" + m) for s in sources)]
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"


def test_the_readme_teaches_in_a_few_pages() -> None:
    lines = README.splitlines()
    assert len(lines) < README_MAX_LINES, (
        f"README.md has {len(lines)} lines (< {README_MAX_LINES}): move details to docs/"
    )
    headings = [i for i, line in enumerate(lines) if line == "## Bring your own data"]
    assert headings and headings[0] < 80, "the README reaches 'Bring your own data' by line 80"


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(text: str) -> set[str]:
    prose = re.sub(r"^```.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", prose, flags=re.MULTILINE)}


def _links(text: str) -> list[str]:
    prose = re.sub(r"^```.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)
    prose = re.sub(r"`[^`\n]*`", "", prose)
    return re.findall(r"\]\(([^)\s]+)\)", prose)


@pytest.mark.parametrize("page", sorted(DOCS), ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_points_at_an_existing_file_and_heading(page: Path) -> None:
    broken = []
    for link in _links(DOCS[page]):
        if re.match(r"[a-z]+:", link):
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{link} (no such file)")
        elif target.suffix == ".md" and anchor and anchor not in _anchors(target.read_text()):
            broken.append(f"{link} (no such heading)")
    assert not broken, f"{page.relative_to(ROOT)} links nowhere: {broken}"
