"""An engine run as a user starts it, ``python -m engine.run``, in another environment's
Python (the tinker 0.38 one, ``.venv-tinker``, which has no torch), against a server this
process runs; what a benchmark needs comes back from the run directory.

Step ends are counted from the start of step 1 (its ``time/step`` before its metrics
line's timestamp), since the subprocess's own start-up is not the engine's work.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
TINKER_PYTHON = REPO / ".venv-tinker" / "bin" / "python"
RUN_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class CliRun:
    final_path: str
    steps_completed: int
    metrics: list[dict[str, Any]]
    step_ends: list[float]
    config: dict[str, Any]
    checkpoints: list[dict[str, Any]]
    """The rows of the run's checkpoints.jsonl (each with its ``step`` and ``sampler_path``)."""


def run_engine_cli(
    python: Path, base_url: str, api_key: str, run_dir: Path, args: Sequence[str]
) -> CliRun:
    """``python -m engine.run --run-dir run_dir *args`` of this checkout with the tinker
    SDK's variables set; RuntimeError with the run's last error line if it fails."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MINT_", "TINKER_"))}
    env.update(
        TINKER_API_KEY=api_key,
        TINKER_BASE_URL=base_url,
        PYTHONPATH=str(REPO),
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    done = subprocess.run(
        [str(python), "-m", "engine.run", "--no-progress", "--run-dir", str(run_dir), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
        cwd=REPO,
    )
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"engine.run exited {done.returncode}: {last}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if row.get("event") == "step"]
    checkpoints = [
        json.loads(line) for line in (run_dir / "checkpoints.jsonl").read_text().splitlines()
    ]
    final = next(c for c in reversed(checkpoints) if c["reason"] == "final")
    return CliRun(
        final_path=final["sampler_path"],
        steps_completed=final["step"],
        metrics=steps,
        step_ends=_step_ends(steps),
        config=json.loads((run_dir / "config.json").read_text()),
        checkpoints=checkpoints,
    )


def _step_ends(steps: Sequence[dict[str, Any]]) -> list[float]:
    if not steps:
        return []
    stamps = [datetime.fromisoformat(row["time"]).timestamp() for row in steps]
    start = stamps[0] - steps[0]["time/step"]
    return [t - start for t in stamps]
