"""``--task hf:PATH``: Hugging Face datasets read from local files (save_to_disk
directories, a directory of data files, single parquet/csv/json files), offline, with
the jsonl task's rules: field mapping, presets, shuffling, epochs and the cursor."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import datasets
import pytest

from engine.catalog import load_task
from engine.errors import ConfigError
from engine.tasks.dataset import DatasetTask


def addition_rows(n: int) -> list[dict[str, Any]]:
    return [
        {"messages": [{"role": "user", "content": f"What is {a} + 7?"}], "answer": str(a + 7)}
        for a in range(10, 10 + n)
    ]


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    """A DatasetDict (train: 12 rows, test: 4) written by save_to_disk."""
    rows = addition_rows(16)
    splits = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list(rows[:12]),
            "test": datasets.Dataset.from_list(rows[12:]),
        }
    )
    path = tmp_path / "sums"
    splits.save_to_disk(str(path))
    return path


def questions(task: Any, seed: int, n: int, state: Any = None) -> list[Any]:
    source = task.source(seed, state)
    out = []
    for _ in range(n):
        p = source.next()
        # str(answer): CSV reads "31" back as the number 31 (the presets compare text)
        out.append(None if p is None else (p.id, p.question, str(p.answer), p.data["epoch"]))
    return out


def test_a_saved_dataset_dict_trains_on_one_split_and_evaluates_another(saved: Path) -> None:
    task = load_task(f"hf:{saved}", {"eval_split": "test"})
    assert isinstance(task, DatasetTask)
    assert task.name == "hf-sums"
    assert task.spec == (f"hf:{saved.resolve()}", {"eval_split": "test"})
    held_out = task.eval_problems()
    assert [p.question for p in held_out] == [f"What is {a} + 7?" for a in range(22, 26)]
    assert task.prompt(held_out[0]) == addition_rows(16)[12]["messages"]
    drawn = {q for _, q, _, _ in questions(task, 0, 12)}
    assert drawn == {f"What is {a} + 7?" for a in range(10, 22)}  # the train split, once each
    problem = held_out[0]
    assert task.score(" 29 ", problem).total == 1.0  # the exact preset
    other = load_task(f"hf:{saved}", {"split": "test", "eval_split": "train"})
    assert len(other.eval_problems()) == 12  # type: ignore[attr-defined]
    second = saved.parent / "more.parquet"
    datasets.Dataset.from_list(addition_rows(20)[16:]).to_parquet(str(second))
    elsewhere = load_task(f"hf:{saved}", {"eval_path": str(second)})
    assert [p.question for p in elsewhere.eval_problems()] == [  # type: ignore[attr-defined]
        f"What is {a} + 7?" for a in range(26, 30)
    ]


def test_the_cursor_resumes_exactly_and_the_spec_rebuilds_the_task(saved: Path) -> None:
    task = DatasetTask.from_args(str(saved), {"epochs": "2"}, "hf")
    whole = questions(task, 5, 25)
    assert whole[-1] is None  # 2 epochs of 12 rows, then the source ends
    assert [e for *_, e in whole[:24]] == [0] * 12 + [1] * 12
    assert whole[:12] != whole[12:24]  # reshuffled per epoch
    source = task.source(5)
    for _ in range(7):
        source.next()
    state = json.loads(json.dumps(source.state()))  # as a checkpoint stores it
    spec, args = task.spec
    rebuilt = load_task(spec, args)  # what --resume does from config.json
    assert questions(rebuilt, 5, 18, state) == whole[7:25]


@pytest.mark.parametrize("kind", ["parquet", "csv", "json", "jsonl", "directory", "dataset"])
def test_every_local_form_draws_what_the_jsonl_task_draws(
    tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Same rows, same seed: the same problems in the same order as the jsonl task."""
    rows = [{"question": f"What is {a} + 7?", "answer": str(a + 7)} for a in range(10, 30)]
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = datasets.Dataset.from_list(rows)
    if kind == "directory":  # a dataset repository's files on disk
        path = tmp_path / "repo"
        table.to_parquet(str(path / "data" / "train-00000-of-00001.parquet"))
    elif kind == "dataset":  # a lone Dataset written by save_to_disk is the split train
        path = tmp_path / "saved"
        table.save_to_disk(str(path))
    else:
        path = tmp_path / f"rows.{kind}"
        if kind == "parquet":
            table.to_parquet(str(path))
        elif kind == "csv":
            table.to_csv(str(path), index=False)
        else:
            table.to_json(str(path), lines=kind == "jsonl")
    args = {"eval_size": "5", "reward": "numeric"}
    capsys.readouterr()
    ours = load_task(f"hf:{path}", args)
    assert capsys.readouterr().err == ""  # no progress bars of datasets' own
    reference = load_task(f"jsonl:{jsonl}", args)
    assert questions(ours, 3, 20) == questions(reference, 3, 20)
    assert [p.question for p in ours.eval_problems()] == [  # type: ignore[attr-defined]
        p.question
        for p in reference.eval_problems()  # type: ignore[attr-defined]
    ]


@pytest.mark.parametrize(
    ("where", "args", "message"),
    [
        ("saved", {"split": "validation"}, "has no split 'validation'; its splits: train, test"),
        ("saved", {"eval_split": "dev"}, "has no split 'dev'"),
        ("saved", {"eval_split": "train"}, "eval_split must differ from split"),
        ("saved", {"eval_split": "test", "eval_size": "2"}, "eval_size and eval_split both"),
        ("saved", {"answer_field": "gold"}, r"\(split train\) row 0 has no answer field 'gold'"),
        ("saved", {"colour": "red"}, "unknown task argument 'colour' for hf tasks"),
        ("missing", {}, "cannot read dataset .*missing: no such file or directory"),
        ("text", {}, "hf: reads a save_to_disk directory, a directory of data files, or a"),
        ("jsonl", {"split": "train"}, "unknown task argument 'split' for jsonl tasks"),
    ],
)
def test_bad_hf_tasks_are_one_line(
    saved: Path, tmp_path: Path, where: str, args: dict[str, str], message: str
) -> None:
    (tmp_path / "notes.txt").write_text("hello\n")
    (tmp_path / "d.jsonl").write_text(json.dumps(addition_rows(2)[0]) + "\n")
    spec = {
        "saved": f"hf:{saved}",
        "missing": f"hf:{tmp_path / 'missing'}",
        "text": f"hf:{tmp_path / 'notes.txt'}",
        "jsonl": f"jsonl:{tmp_path / 'd.jsonl'}",
    }[where]
    with pytest.raises(ConfigError, match=message):
        load_task(spec, args)


def test_a_jsonl_task_has_no_splits(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(addition_rows(2)[0]) + "\n")
    with pytest.raises(ConfigError, match="split and eval_split name splits of hf: datasets"):
        DatasetTask(path, eval_split="test")


def test_answers_that_a_checkpoint_cannot_store_are_refused(tmp_path: Path) -> None:
    rows = [{"question": "When?", "answer": datetime(2026, 1, 2)}]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "d.parquet"))
    with pytest.raises(ConfigError, match=r"row 0: the answer .* is not JSON"):
        load_task(f"hf:{tmp_path / 'd.parquet'}")
