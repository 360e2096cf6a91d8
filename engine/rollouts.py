"""Rollouts you can read: ``rollouts.jsonl`` in the run dir, and a command to print it.

Why: a run whose every response scored -0.1 cannot be explained from averages. The
engine writes the first ``--log-rollouts`` groups of every trained step (bounded: a few
groups per step, not every sample): the prompt as the model saw it, each response as
the task scored it, its reward components, advantage and the sampler version.

    python -m engine.rollouts runs/<dir> --step 5        # readable
    python -m engine.rollouts runs/<dir> --step 5 --json # the raw lines

Exit codes: 0 printed; 1 printed, but damaged lines were skipped (a warning names them);
2 nothing to print (no file, no such step).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from engine.common.cli import OneLineErrorParser
from engine.envs.datums import episode_group_datums
from engine.envs.records import episode_record
from engine.loop.results import StepResult
from engine.loop.rl import group_advantages
from engine.loop.state import ScoredGroup
from engine.rundir.steplog import read_step_lines
from engine.tasks.render import PromptRenderer

__all__ = ["ROLLOUTS_FILE", "RolloutLog", "group_record", "main"]

ROLLOUTS_FILE = "rollouts.jsonl"


def group_record(step: int, group: ScoredGroup, renderer: PromptRenderer) -> dict[str, Any]:
    """One group as a JSON-friendly record (one line of rollouts.jsonl); an environment
    task's group has its episodes turn by turn instead of responses."""
    if group.episodes:
        return _episodes_record(step, group, renderer)
    totals = group.totals
    advantages = group_advantages(totals) if group.reward_error is None else [0.0] * len(totals)
    return {
        **_group_fields(step, group),
        "prompt": renderer.decode_prompt(group.prompt_tokens),
        "responses": [
            {
                "text": renderer.decode(c.tokens),
                "reward": r.total,
                "components": dict(r.components),
                "advantage": a,
                "tokens": len(c.tokens),
                "stop_reason": c.stop_reason,
            }
            for c, r, a in zip(group.completions, group.rewards, advantages, strict=True)
        ],
    }


def _episodes_record(step: int, group: ScoredGroup, renderer: PromptRenderer) -> dict[str, Any]:
    built = episode_group_datums(group.episodes, on_missing_logprobs="drop")
    advantages = built.advantages if group.reward_error is None else [0.0] * len(group.episodes)
    return {
        **_group_fields(step, group),
        "episodes": [
            episode_record(e, a, renderer.decode_prompt, renderer.decode)
            for e, a in zip(group.episodes, advantages, strict=True)
        ],
    }


def _group_fields(step: int, group: ScoredGroup) -> dict[str, Any]:
    """What every rollout record says of its group, whatever the task's kind."""
    return {
        "step": step,
        "index": group.index,
        "problem_id": group.problem.id,
        "question": group.problem.question,
        "answer": group.problem.answer,
        "sampler_version": group.version,
        "reward_error": group.reward_error,
    }


class RolloutLog:
    """Appends the first ``per_step`` groups of each step to ``rollouts.jsonl``."""

    def __init__(self, run_dir: Path, per_step: int, renderer: PromptRenderer) -> None:
        self._path = run_dir / ROLLOUTS_FILE
        self._per_step = per_step
        self._renderer = renderer

    def write(self, result: StepResult) -> None:
        if self._per_step <= 0:
            return
        lines = [
            json.dumps(group_record(result.step, g, self._renderer), default=str) + "\n"
            for g in result.groups[: self._per_step]
        ]
        with self._path.open("a", encoding="utf-8") as f:
            f.writelines(lines)


# ----------------------------------------------------------------------------- reading


_RESPONSE_FIELDS = {"text": str, "reward": float, "components": dict, "advantage": float}


def _is_group_record(record: Mapping[str, Any]) -> bool:
    """Whether ``record`` has what :func:`format_group` prints."""
    if not {"problem_id", "sampler_version", "prompt", "answer"} <= record.keys():
        return False
    responses = record.get("responses")
    return isinstance(responses, list) and all(
        isinstance(r, dict)
        and all(
            isinstance(r.get(k), int | float if kind is float else kind)
            for k, kind in _RESPONSE_FIELDS.items()
        )
        and all(isinstance(v, int | float) for v in r["components"].values())
        for r in responses
    )


def format_group(record: dict[str, Any]) -> str:
    """A group as readable text: header, prompt, answer, one line per response."""
    lines = [
        f"step {record['step']} - problem {record['problem_id']} - "
        f"sampler v{record['sampler_version']}",
        *([f"  prompt: {record['prompt']!r}"] if "prompt" in record else []),
        f"  answer: {record['answer']!r}",
    ]
    if record.get("reward_error"):
        lines.append(f"  reward error: {record['reward_error']}")
    if "episodes" in record:
        return "\n".join([*lines, *_format_episodes(record["episodes"])])
    for r in record["responses"]:
        parts = " ".join(f"{k}={v:g}" for k, v in sorted(r["components"].items()))
        lines.append(
            f"  reward {r['reward']:+.3f}  adv {r['advantage']:+.3f}  {parts:<24} | {r['text']!r}"
        )
    return "\n".join(lines)


def _format_episodes(episodes: Sequence[dict[str, Any]]) -> list[str]:
    """Each episode turn by turn: what the environment showed, what the model did,
    its tool calls and their results, the turn's reward."""
    lines: list[str] = []
    for n, e in enumerate(episodes):
        flags = " masked" if e["masked"] else ""
        lines.append(
            f"  episode {n}: {e['outcome']}{flags}  reward {e['reward']:+.3f}  "
            f"adv {e['advantage']:+.3f}  {len(e['turns'])} turns  {e['elapsed_s']:.2f}s"
        )
        if e.get("error"):
            lines.append(f"    error: {e['error']}")
        for i, t in enumerate(e["turns"]):
            where = "new context" if t["new_context"] else "appended"
            lines.append(f"    turn {i} (v{t['sampler_version']}) {where}: {t['observation']!r}")
            lines.append(
                f"      action [{t['tokens']} tok, {t['stop_reason']}] reward {t['reward']:+.3f}"
                f": {t['action']!r}"
            )
            logs = t.get("logs", {})
            for call in logs.get("tool_calls", ()):
                outcome = f"error: {call['error']}" if call["error"] else call["result"]
                lines.append(f"      tool {call['name']}({call['arguments']}) -> {outcome!r}")
            if logs.get("parse_error"):
                lines.append(f"      parse error: {logs['parse_error']}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineErrorParser(
        prog="python -m engine.rollouts",
        description="Print the rollouts a run logged (rollouts.jsonl in its run dir).",
    )
    parser.add_argument("run_dir", type=Path, help="the run directory")
    parser.add_argument("--step", type=int, help="only this step (default: every logged step)")
    parser.add_argument("--json", action="store_true", help="print the raw JSON lines")
    args = parser.parse_args(argv)
    path = args.run_dir / ROLLOUTS_FILE
    if not path.is_file():
        print(f"Error: {path} does not exist (is {args.run_dir} a run directory?)", file=sys.stderr)
        return 2
    try:
        read = read_step_lines(path, _is_group_record)
    except OSError as exc:
        print(f"Error: cannot read {path}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    records = read.records
    warning = read.warning()
    if warning is not None:
        print(warning, file=sys.stderr)
    chosen = [r for r in records if args.step is None or r["step"] == args.step]
    if not chosen:
        steps = sorted({r["step"] for r in records})
        logged = f"steps {steps[0]}..{steps[-1]}" if steps else "none"
        print(f"Error: no rollouts for step {args.step} (logged: {logged})", file=sys.stderr)
        return 2
    for i, record in enumerate(chosen):
        if args.json:
            print(json.dumps(record))
        else:
            print(("\n" if i else "") + format_group(record))
    return 1 if warning is not None else 0


if __name__ == "__main__":
    raise SystemExit(main())
