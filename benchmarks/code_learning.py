"""Does the packaged code model learn from the sandbox's reward? Held-out share of tests
passed before, during and after RL runs on the local server, over seeds.

    python -m benchmarks.code_learning                  # 30 steps of 8 x 6, seeds 1,2,3
    python -m benchmarks.code_learning --quick          # 2 steps of 4 x 4, 1 seed (smoke test)

Each seed is one run of the documented command (docs/sandbox.md, "A model that learns
it"): ``python -m engine.run --local --local-model tiny-code --task
code:examples/tiny_code.jsonl --task-arg eval_size=128 --stop-at-eos --batch 8 --group 6
--lr 1e-3 --steps 30 --eval-every 15 --eval-samples 4`` with the engine's defaults
otherwise (temperature 0.8, K=1, the LoRA rank the model recommends). Its held-out
evaluation (the task's 128 held-out problems, run in the sandbox) comes from the run's
``eval.jsonl``, step 0 being the model before training: the mean share of tests passed
by one greedy answer each, and by ``--eval-samples`` answers each at the run's
temperature (RL's usual effect is to sharpen the sampled distribution, which greedy
answers may not show), with the sampled pass@1 (share of samples passing every test).
Reported: each seed's curves, the gains (last - first) per seed and their mean and
sample standard deviation over the seeds. Writes
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
    eval_samples: int,
    run_dir: Path,
) -> dict[str, Any]:
    """One RL run: its held-out curves (step, mean share of tests passed; greedy and
    sampled), the sampled pass@1's and its wall time."""
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
        eval_samples=eval_samples,
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

    def series(key: str) -> list[tuple[int, float]]:
        return [(int(r["step"]), float(r[key])) for r in records]

    curve = series("eval/reward/total")
    sampled = series("eval/sampled/reward/total")
    pass1 = series("eval/sampled/pass@1")
    return {
        "seed": seed,
        "curve": curve,
        "before": curve[0][1],
        "after": curve[-1][1],
        "gain": curve[-1][1] - curve[0][1],
        "sampled_curve": sampled,
        "sampled_before": sampled[0][1],
        "sampled_after": sampled[-1][1],
        "sampled_gain": sampled[-1][1] - sampled[0][1],
        "pass1_curve": pass1,
        "pass1_gain": pass1[-1][1] - pass1[0][1],
        "wall_s": round(wall, 1),
        "load_before": load,
        "load_after": load_average(),
    }


GAINS = {
    "gain": "greedy",
    "sampled_gain": "sampled",
    "pass1_gain": "sampled pass@1",
}


def _spread(values: Sequence[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (None for one value)."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else None


def _load(averages: Sequence[float] | None) -> str:
    return "?" if averages is None else f"{averages[0]:.1f}"


def plot(runs: Sequence[dict[str, Any]], path: Path) -> Path:
    fig = new_figure(6, 4)
    ax = fig.subplots()
    for i, run in enumerate(runs):
        for key, style, how in (("curve", "-", "greedy"), ("sampled_curve", "--", "sampled")):
            steps, shares = zip(*run[key], strict=True)
            label = f"seed {run['seed']}, {how}"
            ax.plot(steps, shares, style, marker="o", ms=3, color=color(i), label=label)
    ax.set_xlabel("training step")
    ax.set_ylabel(f"held-out share of tests passed\n({EVAL_SIZE} problems)")
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
    p.add_argument("--batch", type=positive_int, default=8, help="problems a step (default 8)")
    p.add_argument("--group", type=positive_int, default=6, help="samples a problem (default 6)")
    p.add_argument(
        "--eval-samples",
        type=positive_int,
        default=4,
        help="held-out answers a problem at the run's temperature (default 4)",
    )
    p.add_argument("--eval-every", type=positive_int, default=15, help="default 15")
    p.add_argument("--seeds", type=_seeds, default=[1, 2, 3], help="default 1,2,3")
    p.add_argument(
        "--learning-rate",
        type=float,
        default=1e-3,
        help="RL learning rate (default 1e-3)",
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
                eval_samples=args.eval_samples,
                run_dir=Path(tmp) / str(s),
            )
            for s in args.seeds
        ]
    summary = {key: _spread([r[key] for r in runs]) for key in GAINS}
    rows = [
        [
            str(r["seed"]),
            f"{r['before']:.3f} -> {r['after']:.3f}",
            f"{r['sampled_before']:.3f} -> {r['sampled_after']:.3f}",
            f"{r['pass1_curve'][0][1]:.3f} -> {r['pass1_curve'][-1][1]:.3f}",
            f"{r['wall_s']:.0f}",
            f"{_load(r['load_before'])} / {_load(r['load_after'])}",
        ]
        for r in runs
    ]
    header = (
        "seed",
        "greedy",
        f"sampled ({args.eval_samples} a problem)",
        "sampled pass@1",
        "wall s",
        "load before / after",
    )
    gains = "".join(
        f"\n- {how}: mean gain {mean:+.3f}"
        + (f", SD {sd:.3f} over {len(runs)} seeds" if sd is not None else "")
        for how, (mean, sd) in zip(GAINS.values(), summary.values(), strict=True)
    )
    text = (
        f"`{command_line('benchmarks.code_learning', argv)}` on {context['cpus']} CPUs, "
        f"commit {context['commit']}. Held-out share of tests passed, before -> after "
        "(load: 1-minute load average).\n\n"
        + markdown_table(header, rows)
        + gains
        + "\n\n![curves](code_learning.png)\n"
    )
    write_json(
        args.out / "code_learning.json",
        {
            "context": context,
            "runs": runs,
            **{key: {"mean": m, "sd": sd} for key, (m, sd) in summary.items()},
        },
    )
    plot(runs, args.out / "code_learning.png")
    (args.out / "code_learning.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
