"""``python -m engine.run`` as a process: kill -9 then ``--resume``, SIGINT/SIGTERM, and
reward functions that raise.

Every run here uses the embedded local server, whose data dir lives in the run dir
(``<run dir>/local-server``): killing the engine kills its server too, and the resumed
process starts a new server that loads the checkpoint from that dir. Progress is read
from metrics.jsonl, never guessed with sleeps.
"""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path

import pytest

from tests.reliability_support import (
    SMALL_RUN,
    checkpoints,
    events,
    metrics,
    problem_sequence,
    read_json,
    run_cli,
    saved_state_steps,
    start_cli,
    trained_steps,
    wait_for_metrics,
)

pytestmark = pytest.mark.slow

STEPS = 6
EVERY = 2
RUN_ARGS = [*SMALL_RUN, "--steps", str(STEPS), "--checkpoint-every", str(EVERY)]


def test_kill_9_then_resume_trains_the_requested_steps_on_the_same_problems(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    reference = tmp_path / "reference"
    done = run_cli([*RUN_ARGS, "--run-dir", str(reference)], tmp_path)
    assert done.returncode == 0, done.stderr

    # a seeded random kill point, after at least one periodic checkpoint (step 2)
    kill_after = random.Random(20261129).randint(EVERY + 1, STEPS - 1)
    run_dir = tmp_path / "run"
    proc = start_cli([*RUN_ARGS, "--run-dir", str(run_dir)], cwd=tmp_path)
    try:
        seen = wait_for_metrics(run_dir, kill_after, proc)
        assert proc.poll() is None, proc.communicate()[1]
    finally:
        proc.kill()  # SIGKILL: no cleanup, the embedded server dies with it
        proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    before = checkpoints(run_dir)
    assert max(c["step"] for c in before) >= EVERY

    resumed = run_cli(["--resume", str(run_dir)], tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert "Traceback" not in resumed.stderr

    lines = metrics(run_dir)
    # exactly the requested steps, each once, on the uninterrupted run's problems
    assert [m["step"] for m in lines] == list(range(1, STEPS + 1))
    assert problem_sequence(run_dir) == problem_sequence(reference)
    # the resumed process continued from its latest checkpoint with monotonic steps
    resume_step = max(c["step"] for c in before)
    printed = [line for line in resumed.stdout.splitlines() if line.startswith("Step ")]
    assert [int(line.split(":")[0].split()[1]) for line in printed] == list(
        range(resume_step + 1, STEPS + 1)
    )
    [resume_event] = events(run_dir, "resume")
    assert resume_event["step"] == resume_step
    # the final state holds one optimizer step per trained step (read from the server's
    # data dir: that server process is gone)
    final = checkpoints(run_dir)[-1]
    assert (final["reason"], final["step"]) == ("final", STEPS)
    assert saved_state_steps(run_dir, final["state_path"]) == trained_steps(lines)
    with capsys.disabled():
        print(
            f"\nkill -9 after {seen} metrics lines (asked {kill_after}); latest checkpoint "
            f"then: step {resume_step}; resumed to {STEPS}"
        )


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_writes_an_interrupt_checkpoint_and_exits_130(
    sig: signal.Signals, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    proc = start_cli(
        [*SMALL_RUN, "--steps", "50", "--checkpoint-every", "50", "--run-dir", str(run_dir)],
        cwd=tmp_path,
    )
    try:
        wait_for_metrics(run_dir, 2, proc)
        assert proc.poll() is None
        proc.send_signal(sig)
        sent = time.perf_counter()
        out, err = proc.communicate(timeout=120)
        exited = time.perf_counter() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err
    assert err == f"Error: interrupted by {sig.name}; stopping after a checkpoint\n"
    trained = len(metrics(run_dir))
    assert [m["step"] for m in metrics(run_dir)] == list(range(1, trained + 1))
    last = checkpoints(run_dir)[-1]
    assert (last["reason"], last["step"]) == ("interrupt", trained)
    assert last["loop_state"]["next_step"] == trained
    summary = read_json(run_dir / "summary.json")
    assert summary["status"] == "interrupted"
    assert summary["stopped"] == {
        "reason": "interrupt",
        "checkpoint_step": trained,
        "checkpoint_written": True,
    }
    assert (
        f"Warning: run stopped (interrupt): resume from step {trained} with: "
        f"python -m engine.run --resume {run_dir}"
    ) in out.splitlines()
    with capsys.disabled():
        print(f"\n{sig.name}: exited {exited:.2f}s after the signal, at step {trained}")


def test_a_failing_reward_function_names_the_problem_and_exits_1(tmp_path: Path) -> None:
    """--on-reward-error fail (the default): the run stops after the step in flight with
    an 'error' checkpoint and one line that names the problem. (K=0, so problem 5, of
    step 2, is scored only once step 1 is trained.)"""
    run_dir = tmp_path / "run"
    task = "tests.reliability_support:failing_reward_task"
    proc = run_cli(
        [*RUN_ARGS, "--max-steps-off-policy", "0", "--task", task, "--run-dir", str(run_dir)],
        tmp_path,
    )
    assert proc.returncode == 1
    [line] = proc.stderr.splitlines()
    assert line.startswith("Error: the reward function failed on problem 5 ('What is ")
    assert "?'): ZeroDivisionError: cannot score '" in line
    assert [m["step"] for m in metrics(run_dir)] == [1]
    assert (checkpoints(run_dir)[-1]["reason"], checkpoints(run_dir)[-1]["step"]) == ("error", 1)
