"""Reading a run dir's per-step JSONL logs (metrics.jsonl, eval.jsonl, rollouts.jsonl)
when they may be damaged: what can be read, and which lines could not.

Why not fail on the first bad line: a run dir is read after the fact (a report, the
rollouts of one step), and a picture or a listing from every readable line is still
useful; the tools then say which lines they skipped and exit non-zero. A torn last line
(no newline after it) is what a run killed mid-write leaves: ignored, not damage.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["StepLines", "read_step_lines"]


@dataclass(frozen=True)
class StepLines:
    """The readable records of a file, and the 1-based numbers of its damaged lines."""

    path: Path
    records: list[dict[str, Any]] = field(default_factory=list)
    damaged: list[int] = field(default_factory=list)

    def warning(self) -> str | None:
        """One line naming the skipped lines, or None when there were none."""
        if not self.damaged:
            return None
        shown = ", ".join(str(n) for n in self.damaged[:5]) + (
            ", ..." if len(self.damaged) > 5 else ""
        )
        return (
            f"Warning: skipped {len(self.damaged)} damaged line(s) of {self.path} "
            f"(line {shown}); the rest was read"
        )


def read_step_lines(
    path: Path, valid: Callable[[Mapping[str, Any]], bool] = lambda record: True
) -> StepLines:
    """The JSON objects with an integer ``step`` in ``path`` that ``valid`` accepts;
    undecodable lines, other JSON and rejected records are damaged. OSError when the
    file cannot be read."""
    raw = path.read_bytes()
    lines = raw.split(b"\n")
    out = StepLines(path)
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            if number == len(lines):
                continue  # torn: the last write of a killed run
            out.damaged.append(number)
            continue
        step = record.get("step") if isinstance(record, dict) else None
        if isinstance(step, int) and not isinstance(step, bool) and valid(record):
            out.records.append(record)
        else:
            out.damaged.append(number)
    return out
