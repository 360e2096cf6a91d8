"""Exactly-once train steps: a step is applied once, or the run goes back to a checkpoint.

Why: a train step is ``forward_backward`` + ``optim_step``, submitted back to back. Once
submitted it is NOT idempotent -- re-sending it after an applied attempt doubles the
gradient or the update. The SDK already re-submits a step's requests with the SAME
``seq_id`` (the server dedupes on ``(model_id, seq_id)``), so transport hiccups during
submission are safe. What is left is a step whose outcome the engine cannot know: the
future failed, expired or timed out after submission, or only one of the two requests
is known to have run. Then the engine never guesses and never retries the step in place:

1. :func:`~engine.session.train_step.run_train_step` turns any failure of the step into
   :class:`~engine.errors.StepOutcomeUnknown` (or, for a request the server refused as
   invalid, :class:`~engine.errors.PermanentServiceError`: redoing it would fail again),
   and counts it in the breaker (``train_step`` kind), so repeated recoveries stop the
   run with ``CircuitOpen`` instead of looping.
2. From that moment the current training client's weights are untrusted: no
   ``save_state`` from it (not even an ``interrupt``/``breaker`` checkpoint) -- even a
   refused ``forward_backward`` is followed by an ``optim_step`` that may have moved
   the weights (Adam momentum).
3. :func:`plan_recovery` says what to restore: the latest checkpoint's state (with
   optimizer) and loop state, and how many completed steps are redone. With no
   checkpoint yet the plan is a fresh LoRA client from the base model and the initial
   loop state.
4. The engine creates a NEW training client from ``plan.state_path``
   (``create_training_client_from_state_with_optimizer``; new model id, new seq_ids),
   drops every sampled-but-untrained group, resets its data cursor/RNG from
   ``plan.loop_state``, rewinds the run's record to ``plan.resume_step``
   (:meth:`engine.rundir.record.RunRecord.rewind`: every per-step log at once) and
   continues from there. This is the same code path as resuming a run after a crash.

Because each checkpoint's loop state is that of its last TRAINED step, the steps after
it are trained again on freshly sampled data from the same problems: no problem is
trained twice in the weights' history, and none is skipped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import structlog

from engine.rundir.checkpoint_log import CheckpointRecord

__all__ = ["RecoveryPlan", "plan_recovery"]

_log = structlog.get_logger("engine.supervision.recovery")


@dataclass(frozen=True)
class RecoveryPlan:
    """Where to go back to after a step with an unknown outcome.

    ``state_path`` None means: no checkpoint yet, recreate the LoRA client from the base
    model with the run's seed and start from the initial loop state (``loop_state``
    None). ``resume_step`` is the number of completed optimizer steps after the
    restore; ``redo_steps`` how many completed steps are lost and done again."""

    state_path: str | None
    sampler_path: str | None
    resume_step: int
    loop_state: dict[str, Any] | None
    redo_steps: int


def plan_recovery(
    latest: CheckpointRecord | None, *, completed_steps: int, log: Any = None
) -> RecoveryPlan:
    """Plan the restore after step ``completed_steps + 1`` failed with an unknown
    outcome, given the latest checkpoint (``CheckpointLog.latest()``)."""
    if completed_steps < 0:
        raise ValueError(f"completed_steps must be >= 0, got {completed_steps}")
    if latest is None:
        plan = RecoveryPlan(None, None, 0, None, completed_steps)
    else:
        if latest.step > completed_steps:
            raise ValueError(
                f"the latest checkpoint is at step {latest.step}, after the {completed_steps} "
                "completed steps: the checkpoint log does not belong to this run"
            )
        plan = RecoveryPlan(
            latest.state_path,
            latest.sampler_path,
            latest.step,
            dict(latest.loop_state),
            completed_steps - latest.step,
        )
    (log if log is not None else _log).warning(
        "recovery.plan",
        restore=plan.state_path or "base model",
        resume_step=plan.resume_step,
        redo_steps=plan.redo_steps,
    )
    return plan
