"""Checkpoint log durability, resume validation and metrics truncation."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from engine.common.files import truncate_metrics
from engine.errors import ResumeError
from engine.rundir.checkpoint_log import CHECKPOINTS_FILE, CheckpointLog, CheckpointRecord
from engine.rundir.directory import CONFIG_FILE, load_resume_state, write_config

pytestmark = pytest.mark.anyio

REPO = Path(__file__).resolve().parents[1]


def record(step: int, reason: str = "periodic", **loop: object) -> CheckpointRecord:
    return CheckpointRecord(
        step=step,
        state_path=f"tinker://model-1/weights/step-{step}",
        sampler_path=f"tinker://model-1/sampler_weights/step-{step}",
        reason=reason,  # type: ignore[arg-type]
        loop_state={"cursor": step * 8, **loop},
        time="2026-01-01T00:00:00+00:00",  # fixed, so two builds of one record compare equal
    )


# --------------------------------------------------------------------------- the log


def test_append_then_read_back(tmp_path: Path) -> None:
    log = CheckpointLog(tmp_path)
    assert log.latest() is None
    first, second = record(2, rng=[1, 2, 3]), record(4, "interrupt")
    log.append(first)
    assert log.latest() == first
    log.append(second)
    assert log.latest() == second
    lines = (tmp_path / CHECKPOINTS_FILE).read_text().splitlines()
    assert len(lines) == 2
    assert CheckpointRecord.from_dict(json.loads(lines[0])) == first
    data = json.loads(lines[0])
    assert data["step"] == 2 and data["reason"] == "periodic"
    assert data["state_path"] == "tinker://model-1/weights/step-2"
    assert data["loop_state"] == {"cursor": 16, "rng": [1, 2, 3]}
    assert data["time"].endswith("+00:00")


async def test_async_append(tmp_path: Path) -> None:
    log = CheckpointLog(tmp_path / "new-run")
    await log.aappend(record(1, "final"))
    saved = log.latest()
    assert saved is not None and saved.step == 1 and saved.reason == "final"


def test_torn_last_line_is_ignored_and_isolated(tmp_path: Path) -> None:
    log = CheckpointLog(tmp_path)
    log.append(record(2))
    full = record(4).to_line()
    with open(log.path, "a") as f:  # a crash in the middle of the second append
        f.write(full[: len(full) // 2])
    with capture_logs() as logs:
        assert log.latest() == record(2)
    assert [e["event"] for e in logs] == ["checkpoint.torn_line"]
    log.append(record(6))  # the next append must not glue onto the torn bytes
    with capture_logs() as logs:
        assert log.latest() == record(6)
    assert [e["event"] for e in logs] == ["checkpoint.bad_line"]  # the torn one, skipped


def test_kill_9_during_appends_leaves_a_readable_log(tmp_path: Path) -> None:
    """A real writer killed with SIGKILL mid-stream: every complete record survives,
    a torn tail is ignored, and the log stays appendable."""
    script = textwrap.dedent(
        f"""
        import sys
        from engine.rundir.checkpoint_log import CheckpointLog, CheckpointRecord
        from engine.rundir.events import QUIET
        log = CheckpointLog({str(tmp_path)!r}, log=QUIET)  # "ready" is its only output
        step = 0
        while True:
            step += 1
            log.append(CheckpointRecord(step=step, state_path="tinker://m/w/%d" % step,
                                        reason="periodic", loop_state={{"pad": "x" * 4000}}))
            if step == 20:
                print("ready", flush=True)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "ready\n"
    finally:
        # No timeout: a process killed inside fsync ends only once the fsync returns,
        # which on a loaded disk can take any time; SIGKILL always ends it.
        proc.kill()
        proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    *complete, _tail = (tmp_path / CHECKPOINTS_FILE).read_bytes().split(b"\n")
    steps = [json.loads(line)["step"] for line in complete]  # every newline-ended record
    assert len(steps) >= 20
    assert steps == list(range(1, len(steps) + 1))
    log = CheckpointLog(tmp_path)
    log.append(record(steps[-1] + 1))
    with capture_logs():
        assert log.latest() == record(steps[-1] + 1)


def test_records_are_validated(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        record(-1)
    with pytest.raises(ValueError, match="reason must be one of"):
        record(1, "whenever")
    with pytest.raises(ValueError, match="state_path"):
        CheckpointRecord(step=1, state_path="", reason="final")
    with pytest.raises(ValueError, match="not JSON-serialisable"):
        CheckpointRecord(
            step=1, state_path="tinker://x", reason="final", loop_state={"s": {1, 2}}
        ).to_line()
    log = CheckpointLog(tmp_path)
    log.path.write_text('{"step": 1, "reason": "periodic"}\n')
    with pytest.raises(ResumeError, match="line 1 is not a valid checkpoint record: missing field"):
        log.latest()


def test_write_config_redacts(tmp_path: Path) -> None:
    written = write_config(tmp_path, {"api_key": "sk-abcdefghijklmnopqrstuvwxyz", "lora_rank": 16})
    text = (tmp_path / CONFIG_FILE).read_text()
    assert "sk-abcdefghijklmnopqrstuvwxyz" not in text
    assert json.loads(text) == written == {"api_key": "[REDACTED]", "lora_rank": 16}


# --------------------------------------------------------------------------- resume

CONFIG = {
    "base_model": "tiny",
    "lora_rank": 8,
    "steps": 10,
    "api_key": "tml-secretsecretsecret",
    "loss": {"name": "ppo", "clip": 0.2},
}


def run_dir_with_checkpoints(tmp_path: Path) -> Path:
    write_config(tmp_path, CONFIG)
    log = CheckpointLog(tmp_path)
    log.append(record(3))
    log.append(record(6, "interrupt"))
    return tmp_path


def test_resume_returns_config_and_latest_checkpoint(tmp_path: Path) -> None:
    run_dir = run_dir_with_checkpoints(tmp_path)
    # More steps, another key and other trackers are allowed on resume (their resume markers).
    changed = {**CONFIG, "steps": 20, "api_key": "tml-anotheranotheranother", "log_to": ["wandb"]}
    state = load_resume_state(run_dir, current_config=changed)
    assert state.step == 6
    assert state.checkpoint == record(6, "interrupt")
    assert state.loop_state == {"cursor": 48}
    assert state.config["lora_rank"] == 8 and state.config["api_key"] == "[REDACTED]"


def test_resume_errors_are_one_clear_line(tmp_path: Path) -> None:
    with pytest.raises(ResumeError, match=r"does not exist$"):
        load_resume_state(tmp_path / "missing")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ResumeError, match="is not a directory"):
        load_resume_state(tmp_path / "file")
    with pytest.raises(ResumeError, match=r"is not a run directory \(no config.json\)"):
        load_resume_state(tmp_path)
    (tmp_path / CONFIG_FILE).write_text("{not json")
    with pytest.raises(ResumeError, match=r"config\.json is not valid JSON"):
        load_resume_state(tmp_path)
    write_config(tmp_path, CONFIG)
    with pytest.raises(ResumeError, match="has no checkpoint yet"):
        load_resume_state(tmp_path)
    assert ResumeError("x").exit_code == 2


def test_resume_refuses_a_different_config(tmp_path: Path) -> None:
    run_dir = run_dir_with_checkpoints(tmp_path)
    changed = {**CONFIG, "lora_rank": 16, "loss": {"name": "ppo", "clip": 0.3}, "group": 4}
    with pytest.raises(ResumeError) as info:
        load_resume_state(run_dir, current_config=changed)
    message = str(info.value)
    assert "\n" not in message
    assert "model.lora_rank is 8 in the run dir but 16 now" in message
    assert "training.loss.clip is 0.2 in the run dir but 0.3 now" in message
    assert "pipeline.group is new (4)" in message


# --------------------------------------------------------------------------- metrics


def test_truncate_metrics_drops_steps_after_the_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "reward": s / 10}) for s in range(1, 8)]
    lines.insert(0, json.dumps({"event": "start"}))
    path.write_text("\n".join(lines) + '\n{"step": 8, "rew')  # and a torn tail
    assert truncate_metrics(path, 4) == 4
    kept = [json.loads(line) for line in path.read_text().splitlines()]
    assert kept == [{"event": "start"}] + [{"step": s, "reward": s / 10} for s in range(1, 5)]
    assert truncate_metrics(path, 4) == 0
    assert truncate_metrics(tmp_path / "none.jsonl", 4) == 0
