"""The loop's state, explicit and JSON-serialisable, so a run can be checkpointed.

Resuming an async loop must not lose the work that was sampled but not yet trained, must
not retrain problems already trained, and must draw the same problems next. Everything
needed for that lives in :class:`LoopState`: the next step to train, the problem
source's state before that step's problems, the ids of problems already trained, the
newest sampler version, and the scored-but-untrained groups (their trajectories).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.core.datums import carries_signal, trajectory_advantages
from engine.core.problems import Problem, RewardBreakdown
from engine.core.trajectory import Trajectory, Turn
from engine.core.trajectory_json import trajectory_from_dict, trajectory_to_dict

__all__ = ["GROUP_FORMAT", "LoopState", "ScoredGroup"]

GROUP_FORMAT = 2
"""The version of :meth:`ScoredGroup.to_dict`'s record: 2 holds trajectories for every
task; a record without ``format`` (1) held a single-turn group's completions."""


@dataclass(frozen=True)
class ScoredGroup:
    """One problem's group after its episodes and rewards. ``step`` is the 0-based step
    it belongs to and ``index`` its position in that step; ``version`` is the oldest
    sampler version of its turns. A single-turn task's group is ``--group`` one-turn
    trajectories. Timestamps are ``time.perf_counter()`` values (metrics only)."""

    step: int
    index: int
    problem: Problem
    version: int
    trajectories: tuple[Trajectory, ...]
    sample_started: float = 0.0
    sample_finished: float = 0.0
    score_started: float = 0.0
    score_finished: float = 0.0
    retries: int = 0
    """Retries of the group's sample requests (metrics only, like the clock values)."""
    reward_error: str | None = None
    """Set when the reward function failed on this group (``--on-reward-error skip``):
    the group is part of its step but yields no datums and no reward statistics."""
    too_long: str | None = None
    """Set when the prompt cannot fit the model's context with ``--max-tokens`` of
    response: the group was not sampled; like a reward error, it is part of its step but
    yields no datums."""
    teacher_started: float = 0.0
    teacher_finished: float = 0.0
    """When the teacher was asked for the group's logprobs and answered
    (``--objective distill``; metrics only, like the other clock values)."""

    @property
    def trainable(self) -> bool:
        """Whether the group's trajectories can be trained on (sampled and scored)."""
        return self.reward_error is None and self.too_long is None

    @property
    def has_signal(self) -> bool:
        """Whether the group can teach anything: it is trainable and its rewards do not
        all tie (a tied group is skipped; ``--refill-groups`` samples another for it)."""
        return self.trainable and carries_signal(trajectory_advantages(self.trajectories))

    @property
    def rewards(self) -> tuple[RewardBreakdown, ...]:
        """Each trajectory's total reward with its group reward's components."""
        return tuple(
            RewardBreakdown(t.total_reward, t.group_reward.components) for t in self.trajectories
        )

    @property
    def totals(self) -> list[float]:
        return [t.total_reward for t in self.trajectories]

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": GROUP_FORMAT,
            "step": self.step,
            "index": self.index,
            "problem": {
                "id": self.problem.id,
                "question": self.problem.question,
                "answer": self.problem.answer,
                "data": dict(self.problem.data),
            },
            "version": self.version,
            "trajectories": [trajectory_to_dict(t) for t in self.trajectories],
            "reward_error": self.reward_error,
            "too_long": self.too_long,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ScoredGroup:
        p = data["problem"]
        version = int(data["version"])
        if "format" in data:
            trajectories = tuple(trajectory_from_dict(t) for t in data["trajectories"])
        else:
            trajectories = _format_1_trajectories(data, version)
        return cls(
            step=int(data["step"]),
            index=int(data["index"]),
            problem=Problem(int(p["id"]), str(p["question"]), p["answer"], dict(p["data"])),
            version=version,
            trajectories=trajectories,
            reward_error=data.get("reward_error"),
            too_long=data.get("too_long"),
        )


def _format_1_trajectories(data: Mapping[str, Any], version: int) -> tuple[Trajectory, ...]:
    """A group checkpointed before format 2: an environment's ``episodes`` as they are,
    a single-turn task's ``completions`` and ``rewards`` as one-turn trajectories of
    its prompt (their group reward is the task's reward)."""
    if data.get("episodes"):
        return tuple(trajectory_from_dict(t) for t in data["episodes"])
    prompt = tuple(int(t) for t in data["prompt_tokens"])
    return tuple(
        Trajectory(
            turns=(
                Turn(
                    observation=prompt,
                    action=tuple(int(t) for t in c["tokens"]),
                    logprobs=None
                    if c["logprobs"] is None
                    else tuple(float(x) for x in c["logprobs"]),
                    version=version,
                    stop_reason=str(c["stop_reason"]),
                ),
            ),
            group_reward=RewardBreakdown(float(r["total"]), dict(r["components"])),
        )
        for c, r in zip(data["completions"], data["rewards"], strict=True)
    )


@dataclass(frozen=True)
class LoopState:
    """Where the loop stands after a step has been trained (or before the first).

    A group is drawn for a step (its ``step``, the step whose problems the source gave
    it). In problem order that step trains it; in completion order
    (``--step-order completion``) a group may train in another step, so the state also
    says where drawing resumes (``next_draw``: the oldest drawn step with an untrained
    group, ``source_state`` the source before it) and which groups drawn for that step
    or later are trained already (``trained_ahead``, their (step, index)); a resumed
    run draws those steps again and samples only their untrained, unkept groups."""

    next_step: int
    source_state: dict[str, Any]
    sampler_version: int
    trained_problem_ids: tuple[int, ...] = ()
    pending_groups: tuple[ScoredGroup, ...] = field(default=(), repr=False)
    next_draw: int | None = None
    """The step whose problems the source gives next (None: ``next_step``)."""
    trained_ahead: tuple[tuple[int, int], ...] = ()
    """The trained groups drawn for step ``next_draw`` or later, as (step, index)."""

    @property
    def draw_from(self) -> int:
        """The step whose problems the source (at ``source_state``) gives next."""
        return self.next_step if self.next_draw is None else self.next_draw

    def trained(self, group: ScoredGroup) -> bool:
        """Whether ``group`` (a group drawn so far) is trained in this state."""
        return group.step < self.draw_from or (group.step, group.index) in self.trained_ahead

    def to_dict(self) -> dict[str, Any]:
        record: dict[str, Any] = {
            "next_step": self.next_step,
            "source_state": self.source_state,
            "sampler_version": self.sampler_version,
            "trained_problem_ids": list(self.trained_problem_ids),
            "pending_groups": [g.to_dict() for g in self.pending_groups],
        }
        if self.next_draw is not None:
            record["next_draw"] = self.next_draw
            record["trained_ahead"] = [list(k) for k in self.trained_ahead]
        return record

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LoopState:
        next_draw = data.get("next_draw")
        return cls(
            next_step=int(data["next_step"]),
            source_state=dict(data["source_state"]),
            sampler_version=int(data["sampler_version"]),
            trained_problem_ids=tuple(int(i) for i in data["trained_problem_ids"]),
            pending_groups=tuple(ScoredGroup.from_dict(g) for g in data["pending_groups"]),
            next_draw=None if next_draw is None else int(next_draw),
            trained_ahead=tuple(
                (int(step), int(index)) for step, index in data.get("trained_ahead", ())
            ),
        )
