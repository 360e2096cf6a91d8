"""The loop's state, explicit and JSON-serialisable, so a run can be checkpointed.

Why explicit: resuming an async loop must not lose the work that was sampled but not yet
trained (a known gap of public loops), must not retrain problems already trained, and
must draw the same problems next. Everything needed for that lives in :class:`LoopState`:
the next step to train, the problem source's state before that step's problems, the ids
of problems already trained, the newest sampler version, and the scored-but-untrained
groups (with their responses, logprobs, rewards and sampler versions).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.envs.records import trajectory_from_dict, trajectory_to_dict
from engine.envs.types import Trajectory
from engine.loop.rl import Completion
from engine.tasks.base import Problem, RewardBreakdown

__all__ = ["LoopState", "ScoredGroup"]


@dataclass(frozen=True)
class ScoredGroup:
    """One problem's group after scoring. ``step`` is the 0-based step it belongs to and
    ``index`` its position in that step; ``version`` is the sampler version that
    produced it. Timestamps are ``time.perf_counter()`` values (metrics only)."""

    step: int
    index: int
    problem: Problem
    prompt_tokens: tuple[int, ...]
    version: int
    completions: tuple[Completion, ...]
    rewards: tuple[RewardBreakdown, ...]
    sample_started: float = 0.0
    sample_finished: float = 0.0
    score_started: float = 0.0
    score_finished: float = 0.0
    retries: int = 0
    """Retries of the group's sample request (metrics only, like the clock values)."""
    reward_error: str | None = None
    """Set when the reward function failed on this group (``--on-reward-error skip``):
    the group is part of its step but yields no datums and no reward statistics."""
    episodes: tuple[Trajectory, ...] = field(default=(), repr=False)
    """An environment task's trajectories, one per episode (``rewards`` then holds
    each one's total reward; ``completions`` is empty). Empty for a single-turn task."""
    too_long: str | None = None
    """Set when the prompt cannot fit the model's context with ``--max-tokens`` of
    response: the group was not sampled; like a reward error, it is part of its step but
    yields no datums."""

    @property
    def trainable(self) -> bool:
        """Whether the group's responses can be trained on (sampled and scored)."""
        return self.reward_error is None and self.too_long is None

    @property
    def totals(self) -> list[float]:
        return [r.total for r in self.rewards]

    def to_dict(self) -> dict[str, Any]:
        episodes = [trajectory_to_dict(t) for t in self.episodes]
        return {
            "step": self.step,
            "index": self.index,
            "problem": {
                "id": self.problem.id,
                "question": self.problem.question,
                "answer": self.problem.answer,
                "data": dict(self.problem.data),
            },
            "prompt_tokens": list(self.prompt_tokens),
            "version": self.version,
            "completions": [
                {
                    "tokens": list(c.tokens),
                    "logprobs": None if c.logprobs is None else list(c.logprobs),
                    "stop_reason": c.stop_reason,
                }
                for c in self.completions
            ],
            "rewards": [{"total": r.total, "components": dict(r.components)} for r in self.rewards],
            "reward_error": self.reward_error,
            **({"episodes": episodes} if episodes else {}),
            "too_long": self.too_long,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ScoredGroup:
        p = data["problem"]
        return cls(
            step=int(data["step"]),
            index=int(data["index"]),
            problem=Problem(int(p["id"]), str(p["question"]), p["answer"], dict(p["data"])),
            prompt_tokens=tuple(int(t) for t in data["prompt_tokens"]),
            version=int(data["version"]),
            completions=tuple(
                Completion(
                    tuple(int(t) for t in c["tokens"]),
                    None if c["logprobs"] is None else tuple(float(x) for x in c["logprobs"]),
                    str(c["stop_reason"]),
                )
                for c in data["completions"]
            ),
            rewards=tuple(
                RewardBreakdown(float(r["total"]), dict(r["components"])) for r in data["rewards"]
            ),
            reward_error=data.get("reward_error"),
            episodes=tuple(trajectory_from_dict(t) for t in data.get("episodes", ())),
            too_long=data.get("too_long"),
        )


@dataclass(frozen=True)
class LoopState:
    """Where the loop stands after a step has been trained (or before the first)."""

    next_step: int
    source_state: dict[str, Any]
    sampler_version: int
    trained_problem_ids: tuple[int, ...] = ()
    pending_groups: tuple[ScoredGroup, ...] = field(default=(), repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "next_step": self.next_step,
            "source_state": self.source_state,
            "sampler_version": self.sampler_version,
            "trained_problem_ids": list(self.trained_problem_ids),
            "pending_groups": [g.to_dict() for g in self.pending_groups],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LoopState:
        return cls(
            next_step=int(data["next_step"]),
            source_state=dict(data["source_state"]),
            sampler_version=int(data["sampler_version"]),
            trained_problem_ids=tuple(int(i) for i in data["trained_problem_ids"]),
            pending_groups=tuple(ScoredGroup.from_dict(g) for g in data["pending_groups"]),
        )
