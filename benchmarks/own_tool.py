"""Does an agent keep its user's tool spelled right while it learns it, with the loss at
the model's logits (``--loss-temperature off``) or at the sampling temperature?

The agent model on ``examples/subtract_tool.py`` in ``tests/test_own_tool.py``'s set-up
(12 steps of 8 problems x 6 samples, 96 tokens, temperature 0.8, lr 2e-3, LoRA rank 8,
K=1 ppo), per seed and loss temperature: the tool calls per episode, the names called (any
name but ``subtract`` is a misspelling) and the reward, over the first three steps and the
last three. Seeded runs repeat on one machine, so each seed is one sample of what a run
on another machine may do.

    python -m benchmarks.own_tool                     # seeds 0-11, off and sampling
    python -m benchmarks.own_tool --seeds 0,1 --modes sampling
    python -m benchmarks.own_tool --quick             # 2 steps, one seed (smoke test)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio

from benchmarks.learning import API_KEY
from benchmarks.measure import positive_int
from benchmarks.report import (
    command_line,
    load_average,
    markdown_table,
    run_context,
    write_json,
)
from engine import Engine, EngineConfig, RunResult, StepResult
from engine.basemodels.catalogue import AGENT_MODEL_DIR
from engine.local import LocalServer
from examples.subtract_tool import SubtractTask, subtract

__all__ = ["SETUP", "WINDOW", "main", "measure", "step_row", "window"]

DEFAULT_OUT = Path(__file__).parent / "results" / "own_tool.json"
WINDOW = 3
"""Steps at each end compared: the first three against the last three."""
MODES = ("off", "sampling")
SETUP: dict[str, Any] = {
    "batch": 8,
    "group": 6,
    "max_tokens": 96,
    "temperature": 0.8,
    "learning_rate": 2e-3,
    "lora_rank": 8,
}
"""The run's settings beside its steps and seed, ``tests/test_own_tool.py``'s too."""


def _ints(text: str) -> list[int]:
    try:
        return [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None


def _modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        raise argparse.ArgumentTypeError(f"modes are {' and '.join(MODES)}, not {text!r}")
    return modes


def _run(config: EngineConfig) -> tuple[list[StepResult], RunResult]:
    steps: list[StepResult] = []

    async def go() -> RunResult:
        async with Engine(config, task=SubtractTask(), on_step=[steps.append]) as engine:
            return await engine.run()

    return steps, anyio.run(go)


def step_row(step: StepResult) -> dict[str, Any]:
    """A step's tool calls per episode, reward and the names its calls gave the tool."""
    names = Counter(
        calls[0]["name"]
        for group in step.groups
        for episode in group.trajectories
        for turn in episode.turns
        if (calls := turn.logs.get("tool_calls"))
    )
    return {
        "tool_calls_per_episode": step.metrics["env/all/tool_calls"],
        "reward": step.metrics["env/all/reward/total"],
        "names": dict(names),
    }


def window(steps: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Steps' rows (:func:`step_row`) summed: calls, misspelled calls, and the means."""
    called = sum(sum(s["names"].values()) for s in steps)
    misspelled = sum(n for s in steps for name, n in s["names"].items() if name != subtract.name)
    return {
        "calls": called,
        "misspelled": misspelled,
        "tool_calls_per_episode": statistics.fmean(s["tool_calls_per_episode"] for s in steps),
        "reward": statistics.fmean(s["reward"] for s in steps),
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    with (
        LocalServer(AGENT_MODEL_DIR, api_key=API_KEY) as server,
        tempfile.TemporaryDirectory() as tmp,
    ):
        for seed in args.seeds:
            for mode in args.modes:
                config = EngineConfig(
                    base_url=server.base_url,
                    api_key=API_KEY,
                    **SETUP,
                    steps=args.steps,
                    seed=seed,
                    loss_temperature=mode,  # type: ignore[arg-type]
                    run_dir=Path(tmp) / f"{mode}-{seed}",
                    progress=False,
                )
                load = load_average()
                start = time.perf_counter()
                steps, result = _run(config)
                rows = [step_row(s) for s in steps]
                misspelled = [window([r])["misspelled"] for r in rows]
                run = {
                    "loss_temperature": mode,
                    "seed": seed,
                    "steps_completed": result.steps_completed,
                    "first": window(rows[:WINDOW]),
                    "last": window(rows[-WINDOW:]),
                    "per_step": rows,
                    "wall_s": round(time.perf_counter() - start, 1),
                    "load_before": load,
                }
                runs.append(run)
                print(
                    f"{mode} seed {seed}: misspelled per step {misspelled} "
                    f"calls/episode {run['first']['tool_calls_per_episode']:.2f} -> "
                    f"{run['last']['tool_calls_per_episode']:.2f} in {run['wall_s']:.0f} s "
                    f"(load {load})",
                    flush=True,
                )
    return {
        "benchmark": "own_tool",
        "context": run_context(vars(args) | {"out": str(args.out)}),
        "steps": args.steps,
        "window": WINDOW,
        "runs": runs,
    }


def _mean_se(values: Sequence[float]) -> str:
    se = statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.3f} ± {se:.3f}"


def table(report: dict[str, Any]) -> str:
    rows = []
    for mode in MODES:
        mine = [r for r in report["runs"] if r["loss_temperature"] == mode]
        if not mine:
            continue
        first_bad = sum(r["first"]["misspelled"] for r in mine)
        first_calls = sum(r["first"]["calls"] for r in mine)
        last_bad = sum(r["last"]["misspelled"] for r in mine)
        last_calls = sum(r["last"]["calls"] for r in mine)
        worst = max(r["last"]["misspelled"] / max(r["last"]["calls"], 1) for r in mine)
        rows.append(
            [
                f"`{mode}`",
                str(len(mine)),
                f"{first_bad}/{first_calls} ({first_bad / max(first_calls, 1):.1%})",
                f"{last_bad}/{last_calls} ({last_bad / max(last_calls, 1):.1%})",
                str(sum(r["last"]["misspelled"] == 0 for r in mine)),
                f"{worst:.1%}",
                _mean_se([r["first"]["tool_calls_per_episode"] for r in mine])
                + " -> "
                + _mean_se([r["last"]["tool_calls_per_episode"] for r in mine]),
                _mean_se([r["first"]["reward"] for r in mine])
                + " -> "
                + _mean_se([r["last"]["reward"] for r in mine]),
            ]
        )
    return markdown_table(
        [
            "--loss-temperature",
            "runs",
            "misspelled, first 3 steps",
            "misspelled, last 3 steps",
            "runs with none last",
            "worst run, last",
            "tool calls per episode (mean ± SE)",
            "reward (mean ± SE)",
        ],
        rows,
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=positive_int, default=12)
    parser.add_argument("--seeds", type=_ints, default=list(range(12)), help="training seeds")
    parser.add_argument("--modes", type=_modes, default=list(MODES), help="off,sampling")
    parser.add_argument("--quick", action="store_true", help="2 steps, one seed")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON report path")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.seeds = 2, args.seeds[:1]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    report = measure(args)
    text = table(report)
    print(text)
    write_json(args.out, report)
    command = command_line("benchmarks.own_tool", argv)
    loads = [r["load_before"][0] for r in report["runs"] if r["load_before"]]
    args.out.with_suffix(".md").write_text(
        f"`{command}` (commit {report['context']['commit']}, 1-minute load average "
        f"{min(loads, default=0):.1f}-{max(loads, default=0):.1f} at the runs' starts; "
        "each run's steps in the JSON)\n\n" + text
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
