"""A prompt the packaged model cannot answer: every response is empty, and the run says
why once (the model-capability hint), end to end on the local server."""

from __future__ import annotations

import json
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
    for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines():
        metrics = json.loads(line)
        assert metrics["response_len/empty_frac"] == 1.0 and metrics["groups/trained_frac"] == 0.0
