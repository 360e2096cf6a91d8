"""``python -m engine.rollouts RUN``: print the rollouts a run logged (``rollouts.jsonl``,
written by :mod:`engine.rundir.rollout_log`), whatever the task's kind.

Why: a run whose every response scored -0.1 cannot be explained from averages.

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
from engine.common.steplog import read_step_lines
from engine.rundir.rollout_log import ROLLOUTS_FILE

__all__ = ["format_group", "main"]

# ----------------------------------------------------------------------------- reading


_RESPONSE_FIELDS = {"text": str, "reward": float, "components": dict, "advantage": float}
_EPISODE_FIELDS = {"outcome": str, "reward": float, "advantage": float, "turns": list}


def _is_group_record(record: Mapping[str, Any]) -> bool:
    """Whether ``record`` has what :func:`format_group` prints: a group's episodes, or
    (a run from before the one rollout form) a single-turn group's responses."""
    if not {"problem_id", "sampler_version", "answer"} <= record.keys():
        return False
    if "episodes" in record:
        return _all_have(record["episodes"], _EPISODE_FIELDS)
    return "prompt" in record and _all_have(record.get("responses"), _RESPONSE_FIELDS)


def _all_have(items: Any, fields: Mapping[str, type]) -> bool:
    return isinstance(items, list) and all(
        isinstance(item, dict)
        and all(
            isinstance(item.get(k), int | float if kind is float else kind)
            for k, kind in fields.items()
        )
        for item in items
    )


def format_group(record: dict[str, Any]) -> str:
    """A group as readable text: header, answer, then each episode turn by turn (a
    single-turn group's one-turn episodes as one line each, under their shared prompt)."""
    if record.get("supervised"):
        return "\n".join(_format_conversation(record))
    lines = [
        f"step {record['step']} - problem {record['problem_id']} - "
        f"sampler v{record['sampler_version']}",
    ]
    if "episodes" not in record:  # the single-turn record of a run before format 2
        lines.append(f"  prompt: {record['prompt']!r}")
        responses = [_response_line(r, r["text"]) for r in record["responses"]]
        return "\n".join([*lines, f"  answer: {record['answer']!r}", *_error(record), *responses])
    episodes = record["episodes"]
    one_turn = [e["turns"] for e in episodes if len(e["turns"]) == 1]
    if len(one_turn) == len(episodes) and len({t[0]["observation"] for t in one_turn}) <= 1:
        if one_turn:
            lines.append(f"  prompt: {one_turn[0][0]['observation']!r}")
        responses = [
            line
            for e in episodes
            for line in (_response_line(e, e["turns"][0]["action"], e["turns"][0]), *_failed(e))
        ]
        return "\n".join([*lines, f"  answer: {record['answer']!r}", *_error(record), *responses])
    lines.append(f"  answer: {record['answer']!r}")
    return "\n".join([*lines, *_error(record), *_format_episodes(episodes)])


def _format_conversation(record: Mapping[str, Any]) -> list[str]:
    """A supervised run's conversation (``--objective sft``): each assistant message it
    trained on, after the context the model was given for it (the whole context when it
    does not extend the previous one, else what was added)."""
    lines = [f"step {record['step']} - conversation {record['problem_id']}"]
    for e in record["episodes"]:
        for t in e["turns"]:
            lines.append(f"  {'context' if t['new_context'] else 'then'}: {t['observation']!r}")
            lines.append(f"  trained [{t['tokens']} tok]: {t['action']!r}")
    return lines


def _error(record: Mapping[str, Any]) -> list[str]:
    error = record.get("reward_error")
    return [f"  reward error: {error}"] if error else []


def _failed(episode: Mapping[str, Any]) -> list[str]:
    """What an episode's environment or agent raised, if it failed."""
    return [f"    error: {episode['error']}"] if episode.get("error") else []


def _response_line(
    item: Mapping[str, Any], text: str, turn: Mapping[str, Any] | None = None
) -> str:
    parts = " ".join(f"{k}={v:g}" for k, v in sorted(item["components"].items()))
    teacher = _teacher(turn or {})
    return (
        f"  reward {item['reward']:+.3f}  adv {item['advantage']:+.3f}  {parts:<24}{teacher} "
        f"| {text!r}"
    )


def _teacher(turn: Mapping[str, Any]) -> str:
    """A distilled turn's mean reverse KL to the teacher and the teacher's mean logprob
    per action token ("" without a teacher)."""
    if not isinstance(turn.get("reverse_kl"), int | float):
        return ""
    return f"  kl {turn['reverse_kl']:+.3f} teacher {turn['teacher_logprob']:.3f}"


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
        lines += _failed(e)
        for i, t in enumerate(e["turns"]):
            where = "new context" if t["new_context"] else "appended"
            lines.append(f"    turn {i} (v{t['sampler_version']}) {where}: {t['observation']!r}")
            lines.append(
                f"      action [{t['tokens']} tok, {t['stop_reason']}] reward {t['reward']:+.3f}"
                f"{_teacher(t)}: {t['action']!r}"
            )
            logs = t.get("logs", {})
            for call in logs.get("tool_calls", ()):
                lines.append(f"      tool {call['name']}({call['arguments']}){_outcome(call)}")
            if logs.get("parse_error"):
                lines.append(f"      parse error: {logs['parse_error']}")
    return lines


def _outcome(call: Mapping[str, Any]) -> str:
    """A logged tool call's result: an environment's (or its error), or what an agent
    answered it with in its next call; none when the episode ended first."""
    if call.get("error"):
        return f" -> {'error: ' + str(call['error'])!r}"
    return f" -> {call['result']!r}" if "result" in call else " -> (no result: the episode ended)"


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
