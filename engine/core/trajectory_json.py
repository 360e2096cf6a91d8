"""Trajectories as JSON: exact (for checkpoints) and readable (for ``rollouts.jsonl``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

from engine.core.datums import turn_reverse_kl
from engine.core.problems import RewardBreakdown
from engine.core.trajectory import Outcome, Trajectory, Turn

__all__ = ["episode_record", "trajectory_from_dict", "trajectory_to_dict"]


def trajectory_to_dict(trajectory: Trajectory) -> dict[str, Any]:
    """Everything needed to train the trajectory after a resume."""
    return {
        "turns": [
            {
                "observation": list(t.observation),
                "action": list(t.action),
                "logprobs": None if t.logprobs is None else list(t.logprobs),
                "version": t.version,
                "stop_reason": t.stop_reason,
                "reward": t.reward,
                "metrics": dict(t.metrics),
                "logs": dict(t.logs),
                **(
                    {}
                    if t.teacher_logprobs is None
                    else {"teacher_logprobs": list(t.teacher_logprobs)}
                ),
            }
            for t in trajectory.turns
        ],
        "outcome": trajectory.outcome,
        "group_reward": {
            "total": trajectory.group_reward.total,
            "components": dict(trajectory.group_reward.components),
        },
        "masked": trajectory.masked,
        "zeroed": trajectory.zeroed,
        "elapsed": trajectory.elapsed,
        "error": trajectory.error,
    }


def trajectory_from_dict(data: Mapping[str, Any]) -> Trajectory:
    reward = data["group_reward"]
    return Trajectory(
        turns=tuple(
            Turn(
                observation=tuple(int(x) for x in t["observation"]),
                action=tuple(int(x) for x in t["action"]),
                logprobs=_floats(t["logprobs"]),
                version=int(t["version"]),
                stop_reason=str(t["stop_reason"]),
                reward=float(t["reward"]),
                metrics={str(k): float(v) for k, v in t["metrics"].items()},
                logs=dict(t["logs"]),
                teacher_logprobs=_floats(t.get("teacher_logprobs")),
            )
            for t in data["turns"]
        ),
        outcome=cast(Outcome, str(data["outcome"])),
        group_reward=RewardBreakdown(float(reward["total"]), dict(reward["components"])),
        masked=bool(data["masked"]),
        zeroed=bool(data["zeroed"]),
        elapsed=float(data["elapsed"]),
        error=data.get("error"),
    )


def _floats(values: Sequence[float] | None) -> tuple[float, ...] | None:
    return None if values is None else tuple(float(x) for x in values)


def episode_record(
    trajectory: Trajectory,
    advantage: float,
    decode: Callable[[Sequence[int]], str],
    decode_action: Callable[[Sequence[int]], str],
) -> dict[str, Any]:
    """One episode turn by turn for a person: each turn's new observation text (what
    the environment appended since the previous action; the whole prompt when the
    prefix broke), the action text, its logs (tool calls and results) and reward; with
    a teacher's logprobs (``--objective distill``) the turn's mean reverse KL to the
    teacher and the teacher's mean logprob per action token."""
    turns: list[dict[str, Any]] = []
    context: tuple[int, ...] = ()
    for t in trajectory.turns:
        extends = bool(context) and t.observation[: len(context)] == context
        shown = t.observation[len(context) :] if extends else t.observation
        kl, teacher, scored = turn_reverse_kl(t)
        turns.append(
            {
                "observation": decode(shown),
                "new_context": not extends,
                "action": decode_action(t.action),
                "reward": t.reward,
                "sampler_version": t.version,
                "tokens": len(t.action),
                "stop_reason": t.stop_reason,
                **({"logs": dict(t.logs)} if t.logs else {}),
                **(
                    {"reverse_kl": kl / scored, "teacher_logprob": teacher / scored}
                    if scored
                    else {}
                ),
            }
        )
        context = (*t.observation, *t.action)
    return {
        "outcome": trajectory.outcome,
        "reward": trajectory.total_reward,
        "group_reward": trajectory.group_reward.total,
        "components": dict(trajectory.group_reward.components),
        "advantage": advantage,
        "masked": trajectory.masked,
        "error": trajectory.error,
        "elapsed_s": trajectory.elapsed,
        "turns": turns,
    }
