"""benchmarks.code_names: which parameter name a logged run's samples write, read from a
tiny synthetic rollouts.jsonl (the record shape :mod:`engine.rundir.rollout_log`
writes), by head name and phase; bad input is a one-line usage error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import code_names
from engine.rundir.rollout_log import ROLLOUTS_FILE
from scripts import code_data

N_PROBLEM = code_data.CodeProblem("x + {k}", 2, (1, 2, 3), (0, 2, 4, 6), name="n")
X_PROBLEM = code_data.CodeProblem("x * {k}", 3, (1, 2, 3), (0, 2, 4, 6))


def _group(step: int, problem: code_data.CodeProblem, actions: list[str]) -> dict[str, object]:
    return {
        "step": step,
        "question": problem.prompt,
        "episodes": [
            {"reward": code_data.pass_share(a, problem), "turns": [{"action": a}]} for a in actions
        ],
    }


RECORDS = [
    _group(1, N_PROBLEM, [" x + 2", " x + 2", " n + 2", " n * 2"]),
    _group(1, X_PROBLEM, [" x * 3", " x * 3"]),
    _group(2, N_PROBLEM, [" n + 2", " n + 2", " x + 2", " junk"]),
    _group(3, N_PROBLEM, [" n + 2", " n + 2"]),
]


def test_the_head_and_written_names_are_read_from_prompt_and_answer() -> None:
    assert code_data.head_name(N_PROBLEM.prompt) == "n"
    assert code_data.head_name(X_PROBLEM.prompt) == "x"
    assert code_data.head_name("What is 2 + 3?") is None
    assert code_data.written_name(" n*n + 4") == "n"
    assert code_data.written_name(" 7 - x") == "x"
    assert code_data.written_name(" y + 1") is None


def test_samples_are_pooled_by_phase_and_head_name() -> None:
    shares = code_names.name_shares(RECORDS, [(1, 1), (2, 3)])
    assert [(s.first, s.last, s.head, s.samples) for s in shares] == [
        (1, 1, "x", 2),
        (1, 1, "n", 4),
        (2, 3, "n", 6),  # no x problem in steps 2-3: no row
    ]
    x1, n1, n23 = shares
    assert x1.head_share == 1.0 and x1.reward == 1.0
    assert n1.head_share == 0.5  # n + 2 and n * 2
    assert n1.reward == pytest.approx((1.0 + 0.25) / 4)  # n * 2 passes f(2) only
    assert n23.head_share == pytest.approx(4 / 6)  # junk is written in neither name
    assert n23.reward == pytest.approx(4 / 6)


def test_the_command_prints_a_row_per_step_and_head(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = [json.dumps(r) + "\n" for r in RECORDS]
    (tmp_path / ROLLOUTS_FILE).write_text("".join(lines))
    assert code_names.main([str(tmp_path)]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert rows[2:] == [  # under the header and its rule
        "| 1-1 | x | 2 | 100% | 1.00 |",
        "| 1-1 | n | 4 | 50% | 0.31 |",
        "| 2-2 | n | 4 | 50% | 0.50 |",
        "| 3-3 | n | 2 | 100% | 1.00 |",
    ]
    # A damaged line is skipped with a warning, and the exit says so.
    (tmp_path / ROLLOUTS_FILE).write_text("".join([lines[0], '{"step": 2}\n', lines[1]]))
    assert code_names.main([str(tmp_path), "--phases", "1-3"]) == 1
    captured = capsys.readouterr()
    assert "| 1-3 | n | 4 | 50% | 0.31 |" in captured.out
    assert "skipped 1 damaged line(s)" in captured.err and "(line 2)" in captured.err


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["RUN", "--untrained"],
        ["--untrained", "--phases", "1-3"],
        ["RUN", "--phases", "3-1"],
        ["RUN", "--phases", "a"],
    ],
)
def test_bad_arguments_are_one_line_usage_errors(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        code_names.main([str(tmp_path) if a == "RUN" else a for a in argv])
    assert exit_info.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
