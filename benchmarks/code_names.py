"""The packaged code model's habit (:func:`scripts.code_data.sft_answer`): which name its
answers write where the head names the parameter ``n``, and what that costs.

    python -m benchmarks.code_names RUN_DIR --phases 1-3,4-27,28-30  # a logged RL run
    python -m benchmarks.code_names --untrained                       # the model before RL

``RUN_DIR``: a run on ``examples/tiny_code.jsonl`` with ``--log-rollouts``; by head name
(``x`` or ``n``) and phase (ranges of steps; default each logged step), its logged
samples, the share written in the head's name and their mean reward.
``--untrained``: the packaged model's greedy answers to the 512 shipped problems
(``scripts.make_model.generate``), the mean share of tests they pass
(``scripts.code_data.pass_share``, without running them) and the share they would pass
had each written the head's name. docs/sandbox.md, "A model that learns it", quotes both.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.report import markdown_table
from engine.common.cli import OneLineErrorParser
from engine.common.steplog import read_step_lines
from engine.rundir.rollout_log import ROLLOUTS_FILE
from scripts import code_data

__all__ = ["NameShare", "main", "name_shares", "untrained_shares"]


@dataclass(frozen=True)
class NameShare:
    """The logged samples of one phase on problems whose head names ``head``."""

    first: int
    last: int
    head: str
    samples: int
    head_share: float
    """The share written in the head's name (:func:`scripts.code_data.written_name`)."""
    reward: float


def name_shares(
    records: Sequence[Mapping[str, Any]], phases: Sequence[tuple[int, int]]
) -> list[NameShare]:
    """Per phase (first and last step) and head name, the samples of ``records`` (groups
    of rollouts.jsonl) of those steps; a phase or head without samples is left out."""
    out: list[NameShare] = []
    for first, last in phases:
        by_head: dict[str, list[tuple[bool, float]]] = {}
        for record in records:
            head = code_data.head_name(str(record["question"]))
            if head is None or not first <= record["step"] <= last:
                continue
            by_head.setdefault(head, []).extend(
                (code_data.written_name(e["turns"][0]["action"]) == head, float(e["reward"]))
                for e in record["episodes"]
            )
        for head in code_data.NAMES:
            samples = by_head.get(head, [])
            if samples:
                out.append(
                    NameShare(
                        first,
                        last,
                        head,
                        len(samples),
                        statistics.fmean(hit for hit, _ in samples),
                        statistics.fmean(reward for _, reward in samples),
                    )
                )
    return out


def _is_group(record: Mapping[str, Any]) -> bool:
    """Whether ``record`` has what :func:`name_shares` reads: the prompt, and each
    episode's reward and first turn's action."""
    episodes = record.get("episodes")
    return (
        isinstance(record.get("question"), str)
        and isinstance(episodes, list)
        and all(
            isinstance(e, dict)
            and isinstance(e.get("reward"), int | float)
            and isinstance(e.get("turns"), list)
            and e["turns"]
            and isinstance(e["turns"][0], dict)
            and isinstance(e["turns"][0].get("action"), str)
            for e in episodes
        )
    )


def _phases(text: str) -> list[tuple[int, int]]:
    try:
        pairs = [tuple(int(s) for s in part.split("-")) for part in text.split(",")]
    except ValueError:
        pairs = []
    if not pairs or any(len(p) != 2 or not 1 <= p[0] <= p[1] for p in pairs):
        raise argparse.ArgumentTypeError(f"not a list of step ranges such as 1-3,4-27: {text!r}")
    return [(p[0], p[1]) for p in pairs]


def untrained_shares() -> dict[str, float]:
    """The packaged code model's greedy answers to the shipped problems: the mean share
    of tests passed, overall and per head name, the share of the ``n`` problems' answers
    written in ``n``, and the mean share passed had each answer used the head's name."""
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    from scripts.make_model import CODE_MAX_TOKENS, CODE_OUT, generate

    problems = code_data.problems(code_data.PROBLEMS_COUNT, code_data.PROBLEMS_SEED)
    rows = [json.loads(line) for line in code_data.PROBLEMS_FILE.read_text().splitlines()]
    if rows != [p.row() for p in problems]:
        raise ValueError(f"{code_data.PROBLEMS_FILE} is not `python -m scripts.code_data`'s")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(CODE_OUT)
    model = LlamaForCausalLM.from_pretrained(CODE_OUT)
    prompts = [tokenizer.encode(p.prompt) for p in problems]
    answers = [t[0] for t in generate(model, tokenizer, prompts, max_new_tokens=CODE_MAX_TOKENS)]
    scored = [(code_data.pass_share(a, p), a, p) for a, p in zip(answers, problems, strict=True)]
    # An answer in the wrong name, scored as if it had used the head's.
    fixed = [
        code_data.pass_share(a, dataclasses.replace(p, name=code_data.written_name(a) or p.name))
        for a, p in zip(answers, problems, strict=True)
    ]
    n_answers = [a for a, p in zip(answers, problems, strict=True) if p.name == "n"]
    return {
        "problems": len(problems),
        "passed": statistics.fmean(s for s, _, _ in scored),
        **{
            f"passed_{head}": statistics.fmean(s for s, _, p in scored if p.name == head)
            for head in code_data.NAMES
        },
        "n_written_n": statistics.fmean(code_data.written_name(a) == "n" for a in n_answers),
        "passed_name_fixed": statistics.fmean(fixed),
    }


def build_parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(
        prog="python -m benchmarks.code_names",
        description="The packaged code model's parameter names: in a logged RL run's samples "
        "(RUN_DIR), or in the untrained model's greedy answers (--untrained).",
    )
    p.add_argument("run_dir", type=Path, nargs="?", help="a run dir with rollouts.jsonl")
    p.add_argument(
        "--phases",
        type=_phases,
        help="step ranges to pool, such as 1-3,4-27,28-30 (default: each logged step)",
    )
    p.add_argument(
        "--untrained",
        action="store_true",
        help="the packaged model's greedy answers to the shipped problems instead",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if (args.run_dir is None) == (not args.untrained):
        parser.error("give RUN_DIR or --untrained (one of them)")
    if args.untrained and args.phases is not None:
        parser.error("--phases reads RUN_DIR's steps, not --untrained's answers")
    if args.untrained:
        try:
            shares = untrained_shares()
        except ValueError as exc:
            print(f"Error: {exc}", file=sys.stderr)
            return 1
        print(
            markdown_table(
                ("measure", "value"),
                [[k, f"{v:.1%}" if isinstance(v, float) else str(v)] for k, v in shares.items()],
            )
        )
        return 0
    path = args.run_dir / ROLLOUTS_FILE
    if not path.is_file():
        parser.error(f"{path} does not exist (a run with --log-rollouts writes it)")
    read = read_step_lines(path, _is_group)
    warning = read.warning()
    if warning is not None:
        print(warning, file=sys.stderr)
    if not read.records:
        print(f"Error: no logged groups in {path}", file=sys.stderr)
        return 2
    phases = args.phases or [(s, s) for s in sorted({r["step"] for r in read.records})]
    rows = [
        [
            f"{s.first}-{s.last}",
            s.head,
            str(s.samples),
            f"{s.head_share:.0%}",
            f"{s.reward:.2f}",
        ]
        for s in name_shares(read.records, phases)
    ]
    header = ("steps", "head's name", "samples", "written in the head's name", "mean reward")
    print(markdown_table(header, rows))
    return 1 if warning is not None else 0


if __name__ == "__main__":
    sys.exit(main())
