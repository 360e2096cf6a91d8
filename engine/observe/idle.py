"""Steps that trained nothing: a run that learns nothing must say so, and say why.

A step trains nothing when none of its responses makes a datum: every group's rewards
were equal (all 0 on a task too hard for the model: no advantage to learn from), every
response was empty, every reward failed (``--on-reward-error skip``), or the sampler
sent no logprobs (``--on-missing-logprobs drop``). One such step is normal; a run of
:data:`NO_TRAINING_STEPS` in a row means the run is wasting its time, and the console
(:func:`no_training_warning`) and the summary (:func:`no_training_summary`) say so.

Two causes are named as they happen: a step whose every episode failed
(:func:`failed_episodes_warning`, with the first reason), and an agent whose calls offer
tools while no reply is read as a tool call (:func:`no_tool_calls_warning`: the model
does not know the tool-call format).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from engine.core.trajectory import Trajectory

__all__ = [
    "NO_TRAINING_STEPS",
    "failed_episodes_warning",
    "no_tool_calls_warning",
    "no_training_summary",
    "no_training_warning",
]

NO_TRAINING_STEPS: Final = 3
"""Consecutive steps without a datum after which the run warns."""


def _untrained(m: Mapping[str, Any]) -> bool:
    return m.get("datums") == 0


def _untooled(m: Mapping[str, Any]) -> bool:
    """An agent's calls offered tools, and no reply was read as a tool call."""
    return m.get("env/all/agent/tool_offers", 0) > 0 and not m.get("env/all/tool_calls")


def _streaks(
    metrics: Sequence[Mapping[str, Any]], test: Callable[[Mapping[str, Any]], bool] = _untrained
) -> list[list[Mapping[str, Any]]]:
    streaks: list[list[Mapping[str, Any]]] = []
    current: list[Mapping[str, Any]] = []
    for m in metrics:
        if test(m):
            current.append(m)
        elif current:
            streaks.append(current)
            current = []
    if current:
        streaks.append(current)
    return streaks


def likely_cause(streak: Sequence[Mapping[str, Any]]) -> str:
    """Why ``streak``'s steps trained nothing, from their counts."""
    groups = sum(int(m.get("groups/total", 0)) for m in streak)
    errors = sum(int(m.get("groups/reward_errors", 0)) for m in streak)
    equal = sum(int(m.get("groups/skipped", 0)) for m in streak)
    empty = sum(int(m.get("skipped/empty_responses", 0)) for m in streak)
    zero = sum(int(m.get("skipped/zero_advantage", 0)) for m in streak)
    no_logprobs = sum(int(m.get("dropped/missing_logprobs", 0)) for m in streak)
    rewards = [m["avg_reward"] for m in streak if isinstance(m.get("avg_reward"), int | float)]
    mean = sum(rewards) / len(rewards) if rewards else 0.0
    too_long = sum(int(m.get("groups/too_long", 0)) for m in streak)
    if groups and too_long == groups:
        return "every prompt was longer than the model's context allows with --max-tokens"
    if groups and errors == groups:
        return "every group's reward failed (--on-reward-error skip): fix the reward function"
    if empty and not zero and not no_logprobs:
        return (
            "every response was empty: check --max-tokens, the task's stop strings and the "
            "prompt format"
        )
    if no_logprobs and not zero:
        return "the sampler returned no logprobs (--on-missing-logprobs drop dropped them all)"
    return (
        f"all rewards within each group were equal ({equal} of {groups} groups, mean reward "
        f"{mean:.3f}), so no response had an advantage: the task may be too hard (all 0) or "
        "too easy for the model, or the reward never matches its answers "
        "(python -m engine.rollouts RUN_DIR shows them)"
        + (f"; also {empty} empty responses" if empty else "")
        + (f"; {errors} failed rewards" if errors else "")
    )


def _due(
    metrics: Sequence[Mapping[str, Any]], test: Callable[[Mapping[str, Any]], bool]
) -> list[Mapping[str, Any]] | None:
    """The run's latest steps that pass ``test``, once they are :data:`NO_TRAINING_STEPS`,
    2x, 4x... steps in a row (a warning's cadence: not every step); else None."""
    streaks = _streaks(metrics, test)
    if not streaks or not metrics or not test(metrics[-1]):
        return None
    times, rest = divmod(len(streaks[-1]), NO_TRAINING_STEPS)
    if times == 0 or rest or times & (times - 1):  # at N, 2N, 4N... steps
        return None
    return streaks[-1]


def no_training_warning(metrics: Sequence[Mapping[str, Any]]) -> str | None:
    """The console warning once the run's latest steps trained nothing for
    :data:`NO_TRAINING_STEPS`, 2x, 4x... steps in a row (not every step); else None."""
    streak = _due(metrics, _untrained)
    if streak is None:
        return None
    return (
        f"nothing was trained for {len(streak)} steps in a row (steps {streak[0]['step']}-"
        f"{streak[-1]['step']}: 0 datums): {likely_cause(streak)}"
    )


def no_tool_calls_warning(metrics: Sequence[Mapping[str, Any]]) -> str | None:
    """The console warning once an agent's calls offered tools and no reply was read as
    a tool call for :data:`NO_TRAINING_STEPS`, 2x, 4x... steps in a row; else None."""
    streak = _due(metrics, _untooled)
    if streak is None:
        return None
    unreadable = sum(float(m.get("env/all/parse_errors", 0)) for m in streak)
    return (
        f"no reply was read as a tool call for {len(streak)} steps in a row (steps "
        f"{streak[0]['step']}-{streak[-1]['step']}), though the agent offered tools"
        + (" (some replies tried: --on-parse-error)" if unreadable else "")
        + ": the model may not know the tool-call format. An agent task runs on the "
        "packaged agent model on the local server unless --local-model or "
        "AgentTask(local_model=...) names another (python -m engine.rollouts RUN_DIR "
        "shows the replies)"
    )


def failed_episodes_warning(step: int, episodes: Sequence[Trajectory]) -> str | None:
    """The console warning of a step whose every episode failed (an environment or an
    agent raised), with the first reason; else None."""
    if not episodes or any(e.error is None for e in episodes):
        return None
    return (
        f"step {step}: all {len(episodes)} episodes failed, so the step learned nothing "
        f"from them; the first: {episodes[0].error} (python -m engine.rollouts RUN_DIR "
        f"--step {step} shows each)"
    )


def no_training_summary(metrics: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """summary.json's ``no_training``: the untrained steps and the longest streak with
    its likely cause, when a streak reached :data:`NO_TRAINING_STEPS`; else None."""
    streaks = _streaks(metrics)
    longest = max(streaks, key=len, default=[])
    if len(longest) < NO_TRAINING_STEPS:
        return None
    return {
        "untrained_steps": sum(len(s) for s in streaks),
        "longest_streak": [longest[0]["step"], longest[-1]["step"]],
        "likely_cause": likely_cause(longest),
    }
