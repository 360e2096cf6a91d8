"""Prompts the packaged model cannot answer, end to end on the local server: some get
empty responses (the run says why once), a user's own task gets numbers that score 0;
and the first page of the README says so, with the flag that serves the chat model."""

from __future__ import annotations

import json
import re
from pathlib import Path

from tests.reliability_support import run_cli


def test_a_run_whose_responses_are_all_empty_names_the_likely_cause(tmp_path: Path) -> None:
    data = tmp_path / "words.jsonl"
    rows = [
        {"prompt": "Name a primary color.", "answer": "red"},
        {"prompt": "What is the capital of France?", "answer": "Paris"},
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["--task", f"jsonl:{data}", "--steps", "2", "--batch", "2", "--no-progress"]
    done = run_cli([*args, "--run-dir", str(tmp_path / "run")], tmp_path)
    assert done.returncode == 0, done.stderr
    output = done.stdout + done.stderr
    assert output.count("every response was empty") == 1
    assert "the model likely cannot answer this prompt format" in output
    # The prompts are plain strings sent raw, and the served model has a chat template:
    # the run says so before its first step, and the empty-responses warning names the
    # fix (docs/tasks.md: raw unless chat=true).
    said = [line for line in output.splitlines() if "--task-arg chat=true" in line]
    assert len(said) == 2, output
    assert "plain strings, sent raw" in said[0] and "Step 1:" not in output.split(said[0])[0]
    assert "every response was empty" in said[1]
    quiet = run_cli(
        [*args, "--task-arg", "chat=false", "--run-dir", str(tmp_path / "r2")], tmp_path
    )
    assert quiet.returncode == 0, quiet.stderr
    assert "sent raw" not in quiet.stdout + quiet.stderr
    for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines():
        metrics = json.loads(line)
        assert metrics["response_len/empty_frac"] == 1.0 and metrics["groups/trained_frac"] == 0.0


ROOT = Path(__file__).resolve().parent.parent


def _prose(path: Path) -> str:
    return " ".join(path.read_text(encoding="utf-8").split())


def test_a_users_own_prompts_get_numbers_that_score_0_as_the_docs_say(tmp_path: Path) -> None:
    """'reverse the word: dog' as chat messages: the packaged model answers with digits
    (not empty strings, as docs/export-and-eval.md used to claim), every reward is 0 and
    nothing is trained; the README's data section names the chat model's flag."""
    data = tmp_path / "reverse.jsonl"
    words = ("dog", "cat", "sun", "tree", "book", "lamp", "fish", "bird")
    rows = [
        {"messages": [{"role": "user", "content": f"reverse the word: {w}"}], "answer": w[::-1]}
        for w in words
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["--task", f"jsonl:{data}", "--steps", "1", "--batch", "4", "--no-progress"]
    done = run_cli([*args, "--run-dir", str(tmp_path / "run")], tmp_path)
    assert done.returncode == 0, done.stderr
    groups = [json.loads(line) for line in (tmp_path / "run" / "rollouts.jsonl").open()]
    texts = [e["turns"][0]["action"] for g in groups for e in g["episodes"]]
    assert any(t.strip() for t in texts)
    assert all(re.fullmatch(r"\s*\d*", t) for t in texts), texts
    [metrics] = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert metrics["avg_reward"] == 0.0 and metrics["groups/trained_frac"] == 0.0
    export = _prose(ROOT / "docs" / "export-and-eval.md")
    assert "its responses are empty strings" not in export
    assert "it answers with a number or with nothing" in export
    readme = _prose(ROOT / "README.md")
    data_section = readme.split("## Bring your own data", 1)[1].split("## ", 1)[0]
    assert "--local-model smollm2-135m" in data_section
    assert "Question: What is A + B?" in data_section
