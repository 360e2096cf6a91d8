"""Hugging Face ``datasets`` read from local files, offline: what ``--task hf:PATH`` trains on.

PATH is one of

* a directory written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``;
* a directory of data files, such as a dataset repository's files on disk (split names
  come from the file names, as on the Hub: ``data/train-*.parquet``, ``test.csv``...);
* one parquet, CSV, JSON or JSON Lines file, or a ``.arrow`` file.

Why only local files: a run must not depend on reaching the Hub. Nothing here names a
Hub dataset, and the builders used (parquet, csv, json, arrow) ship with ``datasets``;
runs work with ``HF_HUB_OFFLINE=1``. Why a temporary cache: ``load_dataset`` converts data
files into Arrow files in a cache; the rows are read into memory and that cache is
deleted, so a run leaves nothing in ``~/.cache``. ``datasets``' progress bars are off
while loading (and restored after): a run's console is for its steps.

Needs the ``datasets`` extra: ``pip install 'engine[datasets]'``.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

from engine.common.extras import require
from engine.errors import ConfigError

__all__ = ["FILE_BUILDERS", "HfSplits", "read_hf_splits"]

FILE_BUILDERS: Final = {
    ".parquet": "parquet",
    ".csv": "csv",
    ".json": "json",
    ".jsonl": "json",
    ".arrow": "arrow",
}
"""The ``datasets`` builder that reads a single data file, by its suffix."""

_SAVED_MARKERS: Final = ("dataset_dict.json", "state.json")  # what save_to_disk writes


class HfSplits:
    """The named splits of one local dataset; a lone ``Dataset`` is the split ``train``."""

    def __init__(self, path: Path, splits: dict[str, Any]) -> None:
        self.path = path
        self._splits = splits

    @property
    def names(self) -> list[str]:
        return list(self._splits)

    def default(self) -> str:
        """``train`` if there is one, else the only split (ConfigError when ambiguous)."""
        if "train" in self._splits or len(self._splits) != 1:
            return self.require("train")
        return self.names[0]

    def require(self, split: str) -> str:
        if split not in self._splits:
            raise ConfigError(
                f"dataset {self.path} has no split {split!r}; its splits: {', '.join(self.names)} "
                "(--task-arg split=NAME)"
            )
        return split

    def records(self, split: str) -> Iterator[tuple[str, Any]]:
        """``(where, record)`` for each row of ``split``; ``where`` names it in errors."""
        for number, record in enumerate(self._splits[self.require(split)].to_list()):
            yield f"{self.path} (split {split}) row {number}", record


def read_hf_splits(path: Path) -> HfSplits:
    """The splits of the local dataset at ``path`` (ConfigError, one line, when it
    cannot be read; the extra missing is one too)."""
    require("datasets", "--task hf:PATH")
    import datasets

    if not path.exists():
        raise ConfigError(f"cannot read dataset {path}: no such file or directory")
    bars = not datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        if path.is_dir() and any((path / marker).is_file() for marker in _SAVED_MARKERS):
            loaded = datasets.load_from_disk(str(path))
        else:
            loaded = _load_files(datasets, path)
    except ConfigError:
        raise
    except Exception as exc:  # datasets raises many kinds for unreadable data
        raise ConfigError(f"cannot read dataset {path}: {type(exc).__name__}: {exc}") from None
    finally:
        if bars:
            datasets.enable_progress_bars()
    splits = dict(loaded) if isinstance(loaded, datasets.DatasetDict) else {"train": loaded}
    if not splits:
        raise ConfigError(f"dataset {path} has no splits")
    return HfSplits(path, splits)


def _load_files(datasets: Any, path: Path) -> Any:
    if path.is_dir():
        where: dict[str, Any] = {"path": str(path)}
    else:
        builder = FILE_BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise ConfigError(
                f"cannot read dataset {path}: hf: reads a save_to_disk directory, a directory "
                f"of data files, or a {', '.join(FILE_BUILDERS)} file"
            )
        where = {"path": builder, "data_files": str(path)}
    with tempfile.TemporaryDirectory(prefix="engine-hf-") as cache:
        return datasets.load_dataset(**where, cache_dir=cache, keep_in_memory=True)
