"""``python -m engine.eval`` refuses what it cannot do before it evaluates (and before it
starts a server): a result file it could not write (it evaluated in full, then lost the
result with a traceback), more samples per problem than the local server draws per
request (64 SDK error lines, then the refusal), a task without held-out problems (in
eval's own words, not about --eval-every, a flag eval has not got)."""

from __future__ import annotations

import json
import os
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from engine import EngineConfig
from engine import eval as eval_cli
from engine.basemodels.catalogue import DEFAULT_MODEL_DIR
from engine.basemodels.recommended import served_model_name
from engine.common.protocol import LOCAL_MAX_NUM_SAMPLES
from engine.rundir.directory import LOCAL_SERVER_DIR

STATE = "tinker://m/weights/final"


def _run_dir(root: Path, task: str = "arithmetic") -> Path:
    run = root / "run"
    ckpt = run / LOCAL_SERVER_DIR / STATE.removeprefix("tinker://")
    ckpt.mkdir(parents=True)
    meta = {"base_model": served_model_name(DEFAULT_MODEL_DIR), "lora_rank": 1}
    (ckpt / "meta.json").write_text(json.dumps(meta))
    (ckpt / "adapter.safetensors").write_bytes(b"weights")
    record = {"step": 2, "state_path": STATE, "reason": "final"}
    (run / "checkpoints.jsonl").write_text(json.dumps(record) + "\n")
    (run / "config.json").write_text(json.dumps({"task": task}))
    return run


@pytest.fixture(autouse=True)
def no_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every refusal here must come before a server is started."""
    monkeypatch.delenv("MINT_API_KEY", raising=False)
    monkeypatch.delenv("MINT_BASE_URL", raising=False)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a server was started for an evaluation that should be refused")

    monkeypatch.setattr(eval_cli, "open_session", refuse)


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one error line of ``argv`` (exit 2)."""
    with pytest.raises(SystemExit) as exit_:
        code = eval_cli.main(argv)
        raise SystemExit(code)
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err
    assert err.count("\n") == 1 and err.startswith("Error: "), err
    return err.removeprefix("Error: ").rstrip("\n")


def test_an_out_file_where_nothing_can_be_written_is_refused_before_evaluating(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _run_dir(tmp_path)
    error = _refused([str(run), "--out", "/sys/eval.json"], capsys)  # not even root writes
    assert re.fullmatch(r"cannot write --out /sys/eval\.json \(.+\): give another --out", error)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory")
def test_an_out_file_in_a_read_only_directory_is_refused_before_evaluating(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _run_dir(tmp_path)
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    error = _refused([str(run), "--out", str(locked / "eval.json")], capsys)
    assert error.startswith(f"cannot write --out {locked / 'eval.json'} (permission denied)")
    run.chmod(0o500)  # the default --out, <run dir>/eval-step2.json
    try:
        error = _refused([str(run)], capsys)
        assert error.startswith(f"cannot write the result in the run directory {run} (")
    finally:
        run.chmod(0o700)


@pytest.mark.parametrize("kind", ["directory", "missing-parent", "run-dir"])
def test_an_out_path_that_cannot_be_a_file_is_refused_before_evaluating(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _run_dir(tmp_path)
    out = {
        "directory": tmp_path,
        "missing-parent": tmp_path / "nowhere" / "eval.json",
        "run-dir": run,
    }[kind]
    error = _refused([str(run), "--out", str(out)], capsys)
    if kind == "missing-parent":
        assert error == f"--out {out}: directory {out.parent} does not exist"
    else:
        assert error == f"--out {out} is a directory: give the result file's path"


@pytest.mark.parametrize("flag", [["--samples", "100000"], ["--k", "1,129"]])
def test_more_samples_than_the_local_server_draws_per_request_are_refused(
    flag: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _run_dir(tmp_path)
    limit = LOCAL_MAX_NUM_SAMPLES
    drawn = flag[1].split(",")[-1]
    assert _refused([str(run), *flag], capsys) == (
        f"{drawn} samples per problem (--samples, or the largest --k) are more than the "
        f"{limit} the local server draws per request"
    )
    assert _refused([str(run), "--samples", str(limit + 1)], capsys).startswith(f"{limit + 1} ")


def test_a_task_without_held_out_problems_is_said_in_evals_words(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The task is loaded once the server said how to complete its arguments (the
    arithmetic task's operands): a session that only gives its config stands for it."""

    @asynccontextmanager
    async def opened(config: EngineConfig, **kwargs: Any) -> AsyncIterator[Any]:
        yield SimpleNamespace(config=config)

    monkeypatch.setattr(eval_cli, "open_session", opened)
    data = Path(__file__).resolve().parents[1] / "examples" / "rl_repeat.jsonl"
    run = _run_dir(tmp_path, task=f"jsonl:{data}")
    error = _refused([str(run)], capsys)
    assert error.startswith(
        "engine.eval evaluates a task's held-out problems, and task 'jsonl-rl_repeat' has none"
    )
    assert "--eval-every" not in error


def test_a_checkpoint_without_a_run_samples_at_its_servers_recommended_temperature(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No run dir recorded a temperature: the local server's (0.8) or a hosted one's (1);
    --temperature wins."""
    from engine.basemodels.recommended import LOCAL_TEMPERATURE
    from engine.checkpoint_files import CheckpointRef
    from engine.config.profile import HOSTED_TEMPERATURE
    from engine.eval import EvalRequest, _config

    ref = CheckpointRef(None, "tinker://m/sampler_weights/final")
    request = EvalRequest(checkpoint=ref.tinker_path or "", task="arithmetic")
    assert _config(request, ref, local=True).sampling.temperature == LOCAL_TEMPERATURE
    monkeypatch.setenv("MINT_API_KEY", "sk-abcdefghijkl")
    hosted = EvalRequest(
        checkpoint=ref.tinker_path or "", task="arithmetic", base_url="http://example.invalid"
    )
    assert _config(hosted, ref, local=False).sampling.temperature == HOSTED_TEMPERATURE
    given = EvalRequest(checkpoint=ref.tinker_path or "", task="arithmetic", temperature=0.5)
    assert _config(given, ref, local=True).sampling.temperature == 0.5
