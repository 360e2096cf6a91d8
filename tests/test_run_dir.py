"""Which directories a run may use, and what its files survive: a directory that is not a
run (the user's own files), one that holds a run, one left by a start-up killed before
its first checkpoint (reusable), one that cannot be written, and a full disk."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest

from engine import StepResult
from engine.common.files import write_file_atomically
from engine.errors import ConfigError, RunFileError, exit_code, format_error
from engine.local import LocalServer
from engine.objectives.rl import RL
from engine.observe.metrics import RunLog
from engine.run import main
from engine.rundir.checkpoint_log import CheckpointLog, CheckpointRecord
from engine.rundir.directory import prepare_run_dir, write_config
from engine.rundir.events import EventLog
from tests.engine_support import run_engine
from tests.reliability_support import (
    SMALL_RUN,
    checkpoints,
    events,
    fast_config,
    metrics,
    read_json,
    run_cli,
    start_cli,
)

ENGINE_CONFIG = {"task_name": "arithmetic-add", "server": "local", "batch": 4}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith(("MINT_", "TINKER_")) and name != "TINKER_TELEMETRY":
            monkeypatch.delenv(name)


def cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    assert out == ""
    return code, err


def users_dir(path: Path) -> dict[str, str]:
    """A directory of someone else's files that happen to share the engine's names."""
    path.mkdir()
    files = {"config.json": '{"mine": true}\n', "summary.md": "# my notes\n"}
    for name, text in files.items():
        (path / name).write_text(text)
    return files


def test_a_directory_of_user_files_is_refused_and_left_untouched(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    mine = tmp_path / "mine"
    files = users_dir(mine)
    code, err = cli(["--run-dir", str(mine)], capsys)
    assert (code, err) == (
        2,
        f"Error: run directory {mine} is not empty and holds no engine run; choose a new or "
        "empty --run-dir (the engine would overwrite files there)\n",
    )
    monkeypatch.chdir(mine)  # --run-dir . : the current directory
    code, err = cli(["--run-dir", "."], capsys)
    assert code == 2 and err.startswith("Error: run directory . is not empty")
    assert {p.name: p.read_text() for p in mine.iterdir()} == files


def engine_run_dir(path: Path, *, trained: bool = False, checkpoint: bool = False) -> None:
    """What a start-up killed before its step-0 checkpoint leaves (config.json, empty
    metrics.jsonl, events.jsonl, a torn checkpoint line, a summary of an earlier failed
    start-up), optionally with a trained step or a checkpoint."""
    write_config(path, ENGINE_CONFIG)
    (path / "metrics.jsonl").write_text('{"step": 1}\n' if trained else "")
    (path / "events.jsonl").write_text('{"event": "started"}\n')
    (path / "checkpoints.jsonl").write_text('{"step": 0, "state_pa')
    (path / "summary.json").write_text('{"status": "failed"}\n')
    (path / "local-server").mkdir()
    if checkpoint:
        CheckpointLog(path).append(CheckpointRecord(0, "tinker://m/weights/step-0", "periodic"))


def test_an_unfinished_start_up_is_reused_a_run_is_not(tmp_path: Path) -> None:
    startup = tmp_path / "startup"
    engine_run_dir(startup)
    assert prepare_run_dir(startup) is True
    assert not (startup / "summary.json").exists()  # the new run writes its own
    assert (startup / "events.jsonl").exists()  # the earlier start-up's history stays

    for name, kwargs in [("trained", {"trained": True}), ("saved", {"checkpoint": True})]:
        run = tmp_path / name
        engine_run_dir(run, **kwargs)
        with pytest.raises(ConfigError) as info:
            prepare_run_dir(run)
        assert str(info.value) == (
            f"run directory {run} already holds a run; continue it with --resume {run}, or "
            "choose another --run-dir"
        )
    fresh = tmp_path / "new" / "dir"
    assert prepare_run_dir(fresh) is False and fresh.is_dir()


def test_a_read_only_run_dir_is_one_line_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()

    def refuse(*args: object, **kwargs: object) -> None:
        raise PermissionError(errno.EACCES, "Permission denied")

    # chmod does not stop root; the OS answer a non-root user gets is injected instead
    monkeypatch.setattr("engine.common.files.tempfile.TemporaryFile", refuse)
    code, err = cli(["--run-dir", str(locked)], capsys)
    assert (code, err) == (
        2,
        f"Error: run directory {locked} is not writable (permission denied); fix its "
        "permissions or choose another --run-dir\n",
    )
    assert list(locked.iterdir()) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to read-only directories")
def test_a_chmod_read_only_run_dir_is_refused(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with pytest.raises(ConfigError, match="is not writable"):
            prepare_run_dir(locked)
    finally:
        locked.chmod(0o700)


def test_a_full_disk_names_the_file_and_keeps_its_previous_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    summary = tmp_path / "summary.json"
    summary.write_text('{"status": "finished"}\n')

    def disk_full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("engine.rundir.checkpoint_log.os.fsync", disk_full)
    with pytest.raises(RunFileError) as info:
        write_file_atomically(summary, b'{"status": "failed"}\n')
    assert str(info.value) == f"cannot write {summary}: no space left on device"
    assert summary.read_text() == '{"status": "finished"}\n'  # never a 0-byte file
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]  # no temp file left


@pytest.mark.slow
def test_a_start_up_killed_before_its_first_checkpoint_leaves_a_reusable_dir(
    tmp_path: Path,
) -> None:
    """kill -9 while the server holds create_model (so the engine is provably in its
    start-up); then both a fresh run in that dir and --resume of a copy of it train."""
    run_dir = tmp_path / "run"
    with LocalServer(faults="slow_s=600,slow@create_model:at=1") as server:
        env = {"MINT_BASE_URL": server.base_url, "MINT_API_KEY": "sk-engine-tests"}
        args = [
            *SMALL_RUN,
            *("--steps", "2"),
        ]
        proc = start_cli([*args, "--run-dir", str(run_dir)], cwd=tmp_path, **env)
        try:
            deadline = time.monotonic() + 120  # only keeps a broken start-up from hanging
            while not server.stats.faults_injected.get("slow@create_model"):
                assert proc.poll() is None, proc.communicate()[1]
                assert time.monotonic() < deadline, "the engine never asked for a model"
                time.sleep(0.05)
        finally:
            proc.kill()
            proc.communicate()
        assert proc.returncode == -signal.SIGKILL
        assert checkpoints(run_dir) == [] and metrics(run_dir) == []
        copy = tmp_path / "copy"
        shutil.copytree(run_dir, copy)

        fresh = run_cli([*args, "--run-dir", str(run_dir)], tmp_path, timeout=300, **env)
        assert fresh.returncode == 0, fresh.stderr
        resumed = run_cli(["--no-progress", "--resume", str(copy)], tmp_path, timeout=300, **env)
        assert resumed.returncode == 0, resumed.stderr

    for directory, how in [(run_dir, "this run"), (copy, "--resume")]:
        assert [m["step"] for m in metrics(directory)] == [1, 2]
        assert read_json(directory / "summary.json")["status"] == "finished"
        [restart] = events(directory, "run_dir.restarted")
        assert f"{how} starts the run over in it from step 0" in restart["message"]
    assert "starts the run over in it from step 0" in fresh.stdout + fresh.stderr
    assert (
        json.loads((copy / "config.json").read_text())["pipeline"]["batch"] == 4
    )  # its own settings


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs Linux's /dev/full")
def test_a_full_disk_under_metrics_and_events_names_the_file(tmp_path: Path) -> None:
    """/dev/full answers every write with ENOSPC, like a full disk."""
    (tmp_path / "metrics.jsonl").symlink_to("/dev/full")
    (tmp_path / "events.jsonl").symlink_to("/dev/full")
    run_log = RunLog(tmp_path / "metrics.jsonl", None, "console", step_detail=RL.step_detail)
    with pytest.raises(RunFileError) as info:
        run_log.step({"step": 1}, "Step 1: ...")
    assert str(info.value) == f"cannot write {tmp_path / 'metrics.jsonl'}: no space left on device"
    events_log = EventLog(tmp_path)
    with pytest.raises(RunFileError) as info:
        events_log.warning("retry", error="the server answered 503")
    assert str(info.value) == f"cannot write {tmp_path / 'events.jsonl'}: no space left on device"
    assert format_error(info.value) == f"Error: {info.value}" and exit_code(info.value) == 1


@pytest.mark.slow
def test_a_summary_that_cannot_be_written_is_the_runs_one_line_error(tmp_path: Path) -> None:
    """The run trains, then its summary.json cannot be replaced: the run fails with one
    line naming the file (it used to end in an OSError raised while handling it)."""
    run_dir = tmp_path / "run"

    def block_the_summary(step: StepResult) -> None:
        (run_dir / "summary.json").mkdir()  # os.replace onto a directory fails

    with LocalServer() as server, pytest.raises(RunFileError) as info:
        run_engine(fast_config(server, run_dir, steps=1), on_step=block_the_summary)
    assert str(info.value) == f"cannot write {run_dir / 'summary.json'}: is a directory"
    [failed] = events(run_dir, "summary.failed")
    assert failed["error"] == str(info.value)
    assert [m["step"] for m in metrics(run_dir)] == [1]
