"""Exactly-once train steps, restores, and stops (breaker, watchdog, request deadline)
of the whole engine against the real local server, with faults injected in the server.

Each test starts a server with the faults it needs (``at=N`` picks the N-th matching
request, so a fault hits a known step) and runs the real Engine through the unmodified
SDK. What is checked is what the server applied: every step exactly once in the weights'
history, each step once in metrics.jsonl, the same problems per step as a clean run.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from engine import Engine, StepResult
from engine.errors import CircuitOpen, Stalled
from engine.local import LocalServer
from tests.clock import ManualClock
from tests.engine_support import run_engine
from tests.reliability_support import (
    BATCH,
    checkpoints,
    events,
    expected_ids,
    fast_config,
    metrics,
    optimizer_steps_of,
    read_json,
    run_and_keep_model,
    run_engine_driven,
    trained_steps,
    until,
)

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    ("fault", "failed_step", "restored_step"),
    [
        # optim_step of step 4 applied, its result expired (410): restore step 2, redo 3-4
        ("410@optim_step:at=4", 4, 2),
        # forward_backward of step 2 failed on the server: restore step 0, redo 1-2
        ("fail@forward_backward:at=2", 2, 0),
    ],
)
def test_a_step_of_unknown_outcome_is_restored_and_redone_exactly_once(
    fault: str, failed_step: int, restored_step: int, tmp_path: Path
) -> None:
    steps = 5
    with LocalServer(faults=fault) as server:
        config = fast_config(server, tmp_path / "run", steps=steps)
        seen, model_id = run_and_keep_model(config)
        applied = optimizer_steps_of(server, model_id)
        stats = server.stats

    run_dir = tmp_path / "run"
    lines = metrics(run_dir)
    # metrics.jsonl: every step once, in order, with the problems of a clean run
    assert [m["step"] for m in lines] == list(range(1, steps + 1))
    assert [m["problem_ids"] for m in lines] == expected_ids(steps)
    # the final weights hold exactly one optimizer step per trained step
    assert applied == trained_steps(lines) == steps
    # ... although the server applied more in total: the abandoned client's steps
    assert sum(stats.optimizer_steps.values()) > applied
    # the hook saw the redone steps again, with the same numbers
    redone = list(range(restored_step + 1, failed_step))
    assert [s.step for s in seen] == [*range(1, failed_step), *redone, *range(failed_step, 6)]
    # one unknown outcome, counted in the metrics of the step that was redone
    assert sum(m["retries/train_step"] for m in lines) == 1
    assert next(m for m in lines if m["retries/train_step"])["step"] == restored_step + 1
    plans = events(run_dir, "recovery.plan")
    assert [(p["resume_step"], p["redo_steps"]) for p in plans] == [
        (restored_step, failed_step - 1 - restored_step)
    ]
    [failure] = events(run_dir, "train_step.failed")
    assert failure["step"] == failed_step and failure["outcome"] == "unknown"
    assert [c["reason"] for c in checkpoints(run_dir)][-1] == "final"


def test_a_lost_answer_is_deduplicated_by_seq_id_not_redone(tmp_path: Path) -> None:
    """The server applied forward_backward/optim_step but the answer was lost: the SDK
    resubmits with the same seq_id, the server answers the original future, and the
    engine never needs a restore."""
    steps = 4
    faults = "drop~after@forward_backward:at=2,drop~after@optim_step:at=1+3"
    with LocalServer(faults=faults) as server:
        config = fast_config(server, tmp_path / "run", steps=steps)
        _, model_id = run_and_keep_model(config)
        applied = optimizer_steps_of(server, model_id)
        stats = server.stats
    lines = metrics(tmp_path / "run")
    assert [m["step"] for m in lines] == [1, 2, 3, 4]
    assert applied == stats.optimizer_steps[model_id] == steps
    assert stats.dedupe_hits.get("optim_step", 0) == 2
    assert stats.dedupe_hits.get("forward_backward", 0) == 1
    assert sum(m["retries/train_step"] for m in lines) == 0
    assert events(tmp_path / "run", "recovery.plan") == []


def test_the_breaker_stops_with_a_checkpoint_and_the_run_resumes(tmp_path: Path) -> None:
    """Every sample of step 2 fails on the server: after 3 consecutive failures the
    breaker stops the run between steps with a 'breaker' checkpoint. A new server on the
    same data dir (the old one is gone) loads that checkpoint and the resumed run
    finishes with the clean run's problems."""
    run_dir = tmp_path / "run"
    data = tmp_path / "server-data"
    steps = 4
    all_later_samples = "+".join(str(n) for n in range(5, 60))
    with LocalServer(faults=f"fail@asample:at={all_later_samples}", data_dir=data) as server:
        # K=0: step 2 is sampled only once step 1 is trained, so the breaker lands after it
        config = fast_config(
            server, run_dir, steps=steps, max_consecutive_failures=3, max_steps_off_policy=0
        )
        with pytest.raises(CircuitOpen) as info:
            run_engine(config)
    assert str(info.value).startswith(
        "stopping the run: 3 consecutive sample failures (last: the server failed the "
        "request (server): "
    )
    assert [m["step"] for m in metrics(run_dir)] == [1]
    assert [(c["step"], c["reason"]) for c in checkpoints(run_dir)] == [
        (0, "periodic"),
        (1, "breaker"),
    ]
    [stopped] = events(run_dir, "run.stopped")
    assert stopped["reason"] == "breaker" and stopped["checkpoint_step"] == 1
    summary = read_json(run_dir / "summary.json")
    assert (summary["status"], summary["stopped"]["reason"]) == ("stopped", "breaker")

    with LocalServer(data_dir=data) as server:
        again = config.replace(base_url=server.base_url, resume=run_dir)
        resumed, model_id = run_and_keep_model(again)
        applied = optimizer_steps_of(server, model_id)

    lines = metrics(run_dir)
    assert [s.step for s in resumed] == [2, 3, 4]
    assert [m["step"] for m in lines] == [1, 2, 3, 4]
    assert [m["problem_ids"] for m in lines] == expected_ids(steps)
    assert applied == trained_steps(lines) == steps
    assert checkpoints(run_dir)[-1]["reason"] == "final"


def test_the_watchdog_stops_a_run_that_makes_no_progress(tmp_path: Path) -> None:
    """Step 2's samples are held by the server: once they all are, 1800 s pass on the
    run's clock and the watchdog stops the run (between steps, so with a checkpoint)
    instead of waiting."""
    run_dir = tmp_path / "run"
    clock = ManualClock()
    with LocalServer(faults="slow_s=600,slow@asample:at=5+6+7+8") as server:
        # Each attempt's deadline is past the watchdog's: no retried sample can make
        # progress between the two clock moves below.
        config = fast_config(
            server,
            run_dir,
            steps=3,
            stall_timeout=1800.0,
            request_timeout=3600.0,
            max_steps_off_policy=0,
        )

        async def stall() -> None:
            await until(lambda: server.stats.faults_injected.get("slow@asample") == BATCH)
            clock.advance(1799)
            await anyio.wait_all_tasks_blocked()
            assert metrics(run_dir) != [] and not events(run_dir, "run.stopped")
            clock.advance(1)

        with pytest.raises(Stalled) as info:
            run_engine_driven(config, clock, stall)
    assert str(info.value) == (
        "stopping the run: no progress for 1800s (last progress: step 1 trained)"
    )
    assert [m["step"] for m in metrics(run_dir)] == [1]
    assert [(c["step"], c["reason"]) for c in checkpoints(run_dir)][-1] == (1, "watchdog")


def test_a_hung_sample_times_out_and_is_sampled_again(tmp_path: Path) -> None:
    """One sample request of step 2 hangs on the server: the per-attempt deadline
    (--request-timeout) abandons it and a new request succeeds; the retry is counted in
    that step's metrics and logged."""
    run_dir = tmp_path / "run"
    clock = ManualClock()
    with LocalServer(faults="slow_s=600,slow@asample:at=6") as server:
        config = fast_config(server, run_dir, steps=2, request_timeout=300.0)

        async def expire_the_held_sample() -> None:
            # the held request is the only call still waiting (its siblings answered)
            await until(
                lambda: (
                    server.stats.faults_injected.get("slow@asample") == 1
                    and clock.deadlines() == [300.0]
                )
            )
            clock.advance(300)

        run_engine_driven(config, clock, expire_the_held_sample)
    lines = metrics(run_dir)
    assert [m["retries/sample"] for m in lines] == [0, 1]
    [retry] = events(run_dir, "retry")
    assert retry["kind"] == "sample"
    assert retry["error"] == "timed out after 300s waiting for sample"


def test_k1_resume_trains_the_checkpointed_groups_without_sampling_them_again(
    tmp_path: Path,
) -> None:
    """K=1: step 3's groups are sampled and scored while step 2 trains (the server holds
    step 2's optim_step answer for a while). A stop after step 2 checkpoints them with
    the loop state; the resumed run trains step 3 on exactly those responses, samples
    only step 4, and no problem is lost or trained twice."""
    run_dir = tmp_path / "run"
    with LocalServer(faults="slow_s=10,slow@optim_step:at=2") as server:
        config = fast_config(
            server,
            run_dir,
            steps=4,
            max_steps_off_policy=1,
            loss="ppo",
            checkpoint_every=0,
            submit_ahead=0,  # step 3 waits behind step 2, so the stop lands between them
            # by default step 3 samples once step 2's calls are answered, the held one too
            sample_ahead=1,
        )

        async def stop_after_step_2() -> None:
            async with Engine(config) as engine:

                def hook(step: StepResult) -> None:
                    if step.step == 2:
                        engine.request_stop()

                engine.add_step_hook(hook)
                assert (await engine.run()).stopped

        anyio.run(stop_after_step_2)
        stop = checkpoints(run_dir)[-1]
        assert (stop["reason"], stop["step"]) == ("stop", 2)
        pending = sorted(stop["loop_state"]["pending_groups"], key=lambda g: g["index"])
        assert [(g["step"], g["index"]) for g in pending] == [(2, i) for i in range(BATCH)]

        sampled_before = server.stats.requests["asample"]
        resumed, model_id = run_and_keep_model(config.replace(resume=run_dir))
        sampled = server.stats.requests["asample"] - sampled_before
        applied = optimizer_steps_of(server, model_id)

    step3 = resumed[0]
    assert step3.step == 3
    assert [[list(t.turns[0].action) for t in g.trajectories] for g in step3.groups] == [
        [t["turns"][0]["action"] for t in g["trajectories"]] for g in pending
    ]
    assert [g.version for g in step3.groups] == [g["version"] for g in pending]
    assert sampled == BATCH  # step 4 only
    lines = metrics(run_dir)
    assert [m["step"] for m in lines] == [1, 2, 3, 4]
    assert [m["problem_ids"] for m in lines] == expected_ids(4)
    assert all(m["off_policy/staleness"] <= 1 for m in lines)
    assert applied == trained_steps(lines) == 4


def test_a_busy_server_at_setup_is_retried_honouring_retry_after(tmp_path: Path) -> None:
    """Session setup is retried on transient answers (503, then 429 with Retry-After)
    instead of failing the run; both retries are logged and counted."""
    run_dir = tmp_path / "run"
    faults = "retry_after_s=0.2,503@client/config:at=1,429@client/config:at=2"
    with LocalServer(faults=faults) as server:
        run_engine(fast_config(server, run_dir, steps=1))
        injected = server.stats.faults_injected
    assert (injected["503"], injected["429"]) == (1, 1)
    retries = events(run_dir, "retry")
    assert [(r["op"], r["retry_after_s"]) for r in retries] == [
        ("reach the server", None),
        ("reach the server", 0.2),
    ]
    assert metrics(run_dir)[0]["retries/session"] == 2
