"""What reading a run directory trusts (docs/reliability.md): a checkpoint's files are
read and copied as regular files only, never through a link (``extra.bin -> /dev/zero``
filled the disk; a link to a file outside the run dir was read and copied), never from a
FIFO or a directory, and at most MAX_CHECKPOINT_BYTES of them; engine.eval,
engine.serve, engine.export and a distillation --teacher run dir refuse anything else
with one line naming the path, before a byte is copied or a server starts."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from engine import eval as eval_cli
from engine import export as export_cli
from engine import serve as serve_cli
from engine.errors import ConfigError
from engine.rundir.checkpoint_copy import MAX_CHECKPOINT_BYTES, copy_checkpoint_files
from engine.rundir.directory import LOCAL_SERVER_DIR
from engine.rundir.teacher_weights import teacher_weights

STATE = "tinker://m/weights/final"
SAMPLER = "tinker://m/sampler_weights/final"


def _checkpoint(directory: Path) -> Path:
    directory.mkdir(parents=True)
    (directory / "meta.json").write_text(json.dumps({"base_model": "x", "lora_rank": 1}))
    (directory / "adapter.safetensors").write_bytes(b"weights")
    return directory


def _run_dir(root: Path) -> Path:
    """A run dir whose final checkpoint (state and sampler weights) is in local-server/."""
    run = root / "run"
    for path in (STATE, SAMPLER):
        _checkpoint(run / LOCAL_SERVER_DIR / path.removeprefix("tinker://"))
    record = {"step": 2, "state_path": STATE, "sampler_path": SAMPLER, "reason": "final"}
    (run / "checkpoints.jsonl").write_text(json.dumps(record) + "\n")
    (run / "config.json").write_text(json.dumps({"task": "arithmetic"}))
    return run


def _outside(tmp_path: Path) -> Path:
    secret = tmp_path / "elsewhere" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text("not a checkpoint")
    return secret


def _tamper(kind: str, ckpt: Path, tmp_path: Path) -> Path:
    """Put an entry of ``kind`` into the checkpoint ``ckpt``; return its path."""
    extra = ckpt / "extra.bin"
    if kind == "dev-zero":
        extra.symlink_to("/dev/zero")
    elif kind == "outside-file":
        extra.symlink_to(_outside(tmp_path))
    elif kind == "linked-meta":
        extra = ckpt / "meta.json"
        extra.unlink()
        extra.symlink_to(_outside(tmp_path))
    elif kind == "fifo":
        os.mkfifo(extra)
    else:
        extra.mkdir()
    return extra


KINDS = {
    "dev-zero": "a symbolic link",
    "outside-file": "a symbolic link",
    "linked-meta": "a symbolic link",
    "fifo": "a FIFO",
    "directory": "a directory",
}


@pytest.mark.parametrize("tamper", sorted(KINDS))
def test_only_regular_files_are_copied_and_nothing_is_copied_otherwise(
    tamper: str, tmp_path: Path
) -> None:
    ckpt = _checkpoint(tmp_path / "ckpt")
    offending = _tamper(tamper, ckpt, tmp_path)
    dest = tmp_path / "copy"
    with pytest.raises(ConfigError) as refused:
        copy_checkpoint_files(ckpt, dest)
    assert str(refused.value) == (
        f"{offending} is {KINDS[tamper]}: a checkpoint's files are read as regular files "
        "only (docs/reliability.md)"
    )
    assert not dest.exists()


def test_a_checkpoint_over_the_bound_is_refused_before_a_byte_is_copied(tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path / "ckpt")
    big = ckpt / "optimizer.safetensors"
    with big.open("wb") as f:  # sparse: no disk is spent on it
        f.truncate(MAX_CHECKPOINT_BYTES + 1)
    dest = tmp_path / "copy"
    over = f"^{re.escape(str(big))} takes the checkpoint's files over {MAX_CHECKPOINT_BYTES} bytes"
    with pytest.raises(ConfigError, match=over):
        copy_checkpoint_files(ckpt, dest)
    assert not dest.exists()
    big.unlink()
    copy_checkpoint_files(ckpt, dest)
    assert {p.name: p.read_bytes() for p in dest.iterdir()} == {
        p.name: p.read_bytes() for p in ckpt.iterdir()
    }


def test_a_checkpoint_dir_that_leads_outside_its_run_is_refused(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    final = run / LOCAL_SERVER_DIR / "m" / "weights" / "final"
    elsewhere = _checkpoint(tmp_path / "elsewhere-ckpt")
    for path in final.iterdir():
        path.unlink()
    final.rmdir()
    final.symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(ConfigError, match=r"leads outside .*local-server: a run's checkpoints"):
        copy_checkpoint_files(final, tmp_path / "copy", within=run / LOCAL_SERVER_DIR)
    assert not (tmp_path / "copy").exists()


@pytest.fixture
def no_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refusal must come before any server starts."""
    monkeypatch.delenv("MINT_API_KEY", raising=False)
    monkeypatch.delenv("MINT_BASE_URL", raising=False)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a server was opened for a checkpoint that should be refused")

    monkeypatch.setattr(eval_cli, "open_session", refuse)  # serve opens through eval's too


@pytest.mark.parametrize("tamper", ["dev-zero", "outside-file"])
@pytest.mark.parametrize("command", ["eval", "serve", "export"])
@pytest.mark.usefixtures("no_server")
def test_eval_serve_and_export_refuse_a_linked_checkpoint_file(
    command: str, tamper: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _run_dir(tmp_path)
    final = run / LOCAL_SERVER_DIR / STATE.removeprefix("tinker://")
    _tamper(tamper, final, tmp_path)
    main = {"eval": eval_cli.main, "serve": serve_cli.main, "export": export_cli.main}[command]
    argv = [str(run)] + (["--out", str(tmp_path / "out")] if command == "export" else [])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == (
        f"Error: {final / 'extra.bin'} is a symbolic link: a checkpoint's files are read as "
        "regular files only (docs/reliability.md)\n"
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("tamper", ["dev-zero", "outside-file"])
def test_a_teacher_run_dir_with_a_linked_file_is_refused_and_nothing_copied(
    tamper: str, tmp_path: Path
) -> None:
    run = _run_dir(tmp_path)
    saved = run / LOCAL_SERVER_DIR / SAMPLER.removeprefix("tinker://")
    _tamper(tamper, saved, tmp_path)
    student = tmp_path / "student" / LOCAL_SERVER_DIR
    with pytest.raises(ConfigError, match=r"extra\.bin is a symbolic link"):
        teacher_weights(str(run), student)
    assert not (student / SAMPLER.removeprefix("tinker://")).exists()


def test_a_teacher_sampler_path_cannot_leave_the_server_dirs(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    record = {"step": 2, "state_path": STATE, "sampler_path": "tinker://../../x", "reason": "final"}
    (run / "checkpoints.jsonl").write_text(json.dumps(record) + "\n")
    with pytest.raises(ConfigError, match="must look like tinker://<run>/weights/<name>"):
        teacher_weights(str(run), tmp_path / "student")


@pytest.mark.parametrize("kind", ["dev-zero", "fifo"])
def test_a_checkpoints_log_that_is_not_a_regular_file_is_refused_not_read(
    kind: str, tmp_path: Path
) -> None:
    """``--teacher RUN`` reads RUN/checkpoints.jsonl: a link to /dev/zero filled memory,
    a FIFO hung the run; both are one line now."""
    run = _run_dir(tmp_path)
    log = run / "checkpoints.jsonl"
    log.unlink()
    if kind == "fifo":
        os.mkfifo(log)
    else:
        log.symlink_to("/dev/zero")
    what = "a FIFO" if kind == "fifo" else "a symbolic link"
    with pytest.raises(ConfigError, match=f"^{re.escape(str(log))} is {what}: "):
        teacher_weights(str(run), tmp_path / "student")
