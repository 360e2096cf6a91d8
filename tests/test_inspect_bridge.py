"""The inspect-ai bridge: a 1-step local run's checkpoint served by ``engine.serve`` and
evaluated by ``inspect eval`` (examples/inspect_arithmetic.py, inspect's OpenAI-compatible
provider) on the questions of ``engine.eval``'s JSON. Greedy sampling on the local server
is deterministic, so inspect sees the very responses the engine's own evaluator saw, and
its accuracy is the engine's pass rate.

inspect-ai runs in an environment of its own (docs/export-and-eval.md): the test uses
``ENGINE_TEST_INSPECT_PYTHON`` (a python that has inspect-ai and openai), else this python
when it has inspect-ai; with neither it is skipped."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import anyio
import pytest

from engine.eval import main as eval_main
from engine.serve import ServeRequest, serve
from tests.reliability_support import REPO, run_cli

INSPECT_PYTHON = os.environ.get("ENGINE_TEST_INSPECT_PYTHON") or (
    sys.executable if importlib.util.find_spec("inspect_ai") else None
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        INSPECT_PYTHON is None,
        reason="inspect-ai is not installed (ENGINE_TEST_INSPECT_PYTHON: a python that has it)",
    ),
]


def test_inspect_evaluates_a_served_checkpoint_as_the_engine_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert INSPECT_PYTHON is not None
    run = tmp_path / "run"
    done = run_cli(["--steps", "1", "--run-dir", str(run), "--no-progress"], tmp_path)
    assert done.returncode == 0, done.stderr
    monkeypatch.delenv("MINT_API_KEY", raising=False)
    monkeypatch.delenv("MINT_BASE_URL", raising=False)
    result = tmp_path / "eval.json"
    assert eval_main([str(run), "--samples", "0", "--out", str(result)]) == 0
    engine_eval = json.loads(result.read_text())
    capsys.readouterr()
    logs = tmp_path / "logs"

    async def go() -> None:
        ready = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: serve(ServeRequest(str(run)), ready=ready))
            with anyio.fail_after(120):
                await ready.wait()
            base_url = capsys.readouterr().out.strip().splitlines()[0]
            evaluated = await anyio.run_process(
                [
                    INSPECT_PYTHON,
                    "-m",
                    "inspect_ai",
                    "eval",
                    "examples/inspect_arithmetic.py",
                    "--model",
                    "openai-api/served/policy",
                    "--model-base-url",
                    base_url,
                    "-T",
                    f"problems={result}",
                    "--log-dir",
                    str(logs),
                    "--display",
                    "none",
                ],
                cwd=REPO,
                env={**os.environ, "SERVED_API_KEY": "unused"},
                check=False,
            )
            assert evaluated.returncode == 0, evaluated.stderr.decode()
            tg.cancel_scope.cancel()

    anyio.run(go)
    [log_file] = logs.glob("*.eval")
    dumped = anyio.run(
        lambda: anyio.run_process([INSPECT_PYTHON, "-m", "inspect_ai", "log", "dump", log_file])
    )
    log = json.loads(dumped.stdout)
    assert log["status"] == "success"
    records, samples = engine_eval["problems"], log["samples"]
    assert len(samples) == len(records) == engine_eval["metrics"]["problems"] > 0
    for record, sample in zip(records, sorted(samples, key=lambda s: s["id"]), strict=True):
        assert sample["input"] == record["question"] and sample["target"] == str(record["answer"])
        assert sample["output"]["completion"].strip() == record["greedy"]["response"].strip()
        assert (sample["scores"]["match"]["value"] == "C") == record["greedy"]["passed"]
    [score] = log["results"]["scores"]
    accuracy = score["metrics"]["accuracy"]["value"]
    assert accuracy == pytest.approx(engine_eval["metrics"]["pass_rate"])
