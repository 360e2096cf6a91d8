"""Does the packaged code model learn from the sandbox's reward? Held-out share of tests
passed before, during and after RL runs on the local server, over seeds.

    python -m benchmarks.code_learning                  # 30 steps of 16 x 8, seeds 1,2,3
    python -m benchmarks.code_learning --quick          # 2 steps of 4 x 4, 1 seed (smoke test)

Each seed is one run of the documented command (docs/sandbox.md, "A model that learns
it"): ``python -m engine.run --local --local-model tiny-code --task
code:examples/tiny_code.jsonl --task-arg eval_size=128 --stop-at-eos --batch 16 --group 8
--lr 3e-3 --steps 30 --eval-every 15`` with the engine's defaults otherwise (temperature
0.8, K=1, the LoRA rank the model recommends); the engine's default 8 problems x 6
samples at lr 1e-3 or 2e-3 showed no gain in 30 steps (docs/sandbox.md). Its held-out
evaluation (the task's 128 held-out problems, one greedy answer each, run in the
sandbox: the mean share of tests passed) comes from the run's ``eval.jsonl``: step 0 is
the model before training. Reported: each seed's curve, the gain (last - first) per
seed and its mean and sample standard deviation over the seeds. Writes
``code_learning.json``, ``code_learning.md`` and ``code_learning.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio

from benchmarks.report import command_line, load_average, markdown_table, run_context, write_json
from engine import Engine, EngineConfig
from engine.common.cli import OneLineErrorParser, positive_int
from engine.observe.plotting import color, new_figure, save

__all__ = ["main", "run_seed"]

ROOT = Path(__file__).resolve().parents[1]
PROBLEMS = ROOT / "examples" / "tiny_code.jsonl"
DEFAULT_OUT = Path(__file__).resolve().parent / "results"
EVAL_SIZE = 128


def run_seed(
    seed: int,
    *,
    steps: int,
    eval_every: int,
    batch: int,
    group: int,
    learning_rate: float,
    run_dir: Path,
) -> dict[str, Any]:
    """One RL run: its held-out curve (step, mean share of tests passed) and wall time."""
    config = EngineConfig(
        local=True,
        local_model=Path("tiny-code"),
        task=f"code:{PROBLEMS}",
        task_args={"eval_size": str(EVAL_SIZE)},
        stop_at_eos=True,
        steps=steps,
        batch=batch,
        group=group,
        learning_rate=learning_rate,
        eval_every=eval_every,
        seed=seed,
        run_dir=run_dir,
        progress=False,
    )

    async def go() -> None:
        async with Engine(config) as engine:
            await engine.run()

    load = load_average()
    start = time.monotonic()
    anyio.run(go)
    wall = time.monotonic() - start
    records = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    curve = [(int(r["step"]), float(r["eval/reward/total"])) for r in records]
    return {
        "seed": seed,
        "curve": curve,
        "before": curve[0][1],
        "after": curve[-1][1],
        "gain": curve[-1][1] - curve[0][1],
        "wall_s": round(wall, 1),
        "load_before": load,
        "load_after": load_average(),
    }


def plot(runs: Sequence[dict[str, Any]], path: Path) -> Path:
    fig = new_figure(6, 4)
    ax = fig.subplots()
    for i, run in enumerate(runs):
        steps, shares = zip(*run["curve"], strict=True)
        ax.plot(steps, shares, marker="o", ms=3, color=color(i), label=f"seed {run['seed']}")
    ax.set_xlabel("training step")
    ax.set_ylabel(f"held-out share of tests passed\n(greedy, {EVAL_SIZE} problems)")
    ax.set_title("tiny-code: RL with the sandbox's reward")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return save(fig, path)


def _seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if not seeds:
        raise argparse.ArgumentTypeError("no seeds")
    return seeds


def build_parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(
        prog="python -m benchmarks.code_learning",
        description="Held-out tests passed by the packaged code model before/after RL.",
    )
    p.add_argument("--steps", type=positive_int, default=30, help="steps per run (default 30)")
    p.add_argument("--batch", type=positive_int, default=16, help="problems a step (default 16)")
    p.add_argument("--group", type=positive_int, default=8, help="samples a problem (default 8)")
    p.add_argument("--eval-every", type=positive_int, default=15, help="default 15")
    p.add_argument("--seeds", type=_seeds, default=[1, 2, 3], help="default 1,2,3")
    p.add_argument(
        "--learning-rate",
        type=float,
        default=3e-3,
        help="RL learning rate (default 3e-3)",
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"default {DEFAULT_OUT}")
    p.add_argument("--quick", action="store_true", help="2 steps of 4 x 4, 1 seed")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.steps, args.eval_every, args.seeds = 2, 2, args.seeds[:1]
        args.batch, args.group = 4, 4
    context = run_context(vars(args))
    with tempfile.TemporaryDirectory() as tmp:
        runs = [
            run_seed(
                s,
                steps=args.steps,
                eval_every=args.eval_every,
                batch=args.batch,
                group=args.group,
                learning_rate=args.learning_rate,
                run_dir=Path(tmp) / str(s),
            )
            for s in args.seeds
        ]
    gains = [r["gain"] for r in runs]
    spread = statistics.stdev(gains) if len(gains) > 1 else None
    rows = [
        [
            str(r["seed"]),
            f"{r['before']:.3f}",
            f"{r['after']:.3f}",
            f"{r['gain']:+.3f}",
            f"{r['wall_s']:.0f}",
        ]
        for r in runs
    ]
    text = (
        f"`{command_line('benchmarks.code_learning', argv)}` on {context['cpus']} CPUs, "
        f"commit {context['commit']}.\n\n"
        + markdown_table(("seed", "before", "after", "gain", "wall s"), rows)
        + f"\nmean gain {statistics.fmean(gains):+.3f}"
        + (f", SD {spread:.3f} over {len(gains)} seeds\n" if spread is not None else "\n")
        + "\n![curves](code_learning.png)\n"
    )
    write_json(
        args.out / "code_learning.json",
        {"context": context, "runs": runs, "mean_gain": statistics.fmean(gains), "sd": spread},
    )
    plot(runs, args.out / "code_learning.png")
    (args.out / "code_learning.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
