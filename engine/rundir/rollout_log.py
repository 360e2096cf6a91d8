"""``rollouts.jsonl`` in the run dir: the first ``--log-rollouts`` groups of every trained
step (bounded: a few groups per step, not every sample), each episode turn by turn as the
model saw it (a single-turn task's: its prompt and one response), its reward and
components, the advantage the trainer gave it and each turn's sampler version; a
supervised run's (``--objective sft``, ``"supervised": true``) each conversation, its
assistant messages as the turns it trained on. ``python -m engine.rollouts`` prints it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engine.core.state import GROUP_FORMAT, ScoredGroup
from engine.core.trajectory_json import episode_record
from engine.loop.results import StepResult
from engine.tasks.render import PromptRenderer

__all__ = ["ROLLOUTS_FILE", "RolloutLog", "group_record"]

ROLLOUTS_FILE = "rollouts.jsonl"


def group_record(
    step: int,
    group: ScoredGroup,
    advantages: Sequence[float],
    renderer: PromptRenderer,
    *,
    supervised: bool = False,
) -> dict[str, Any]:
    """One group as a JSON-friendly record (one line of rollouts.jsonl): each episode
    turn by turn, with the advantage the trainer computed for it (``supervised``: a
    conversation of ``--objective sft``, trained on its assistant messages)."""
    # A trained message is shown whole, its end token too.
    decode_action = renderer.decode_prompt if supervised else renderer.decode
    return {
        **({"supervised": True} if supervised else {}),
        "format": GROUP_FORMAT,
        "step": step,
        "index": group.index,
        "problem_id": group.problem.id,
        "question": group.problem.question,
        "answer": group.problem.answer,
        "sampler_version": group.version,
        "reward_error": group.reward_error,
        "episodes": [
            episode_record(t, a, renderer.decode_prompt, decode_action)
            for t, a in zip(group.trajectories, advantages, strict=True)
        ],
    }


class RolloutLog:
    """Appends the first ``per_step`` groups of each step to ``rollouts.jsonl``
    (``supervised``: the conversations of ``--objective sft``)."""

    def __init__(
        self, run_dir: Path, per_step: int, renderer: PromptRenderer, *, supervised: bool = False
    ) -> None:
        self._path = run_dir / ROLLOUTS_FILE
        self._per_step = per_step
        self._renderer = renderer
        self._supervised = supervised

    def write(self, result: StepResult) -> None:
        if self._per_step <= 0:
            return
        lines = [
            json.dumps(
                group_record(result.step, g, a, self._renderer, supervised=self._supervised),
                default=str,
            )
            + "\n"
            for g, a in zip(result.groups[: self._per_step], result.advantages, strict=False)
        ]
        with self._path.open("a", encoding="utf-8") as f:
            f.writelines(lines)
