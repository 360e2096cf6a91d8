"""Does dynamic sampling (``--refill-groups``) help on the default task?

The local default model on two-digit addition with the engine's defaults (K=1 ppo,
8 problems x 6 samples x 16 tokens), with and without reserves for the groups whose
rewards tie, per training seed: held-out greedy exact rate before/after (the learning
benchmark's held-out set and evaluation, :mod:`benchmarks.learning`), the datums and
groups with signal per step, and what the reserves cost (extra groups sampled, steps
that stayed short) and the wall time, with the load average beside it.

    python -m benchmarks.refill                          # 30 steps, seeds 42,1,2, refill 0 and 4
    python -m benchmarks.refill --quick                  # 2 steps, 20 held-out (smoke test)
    python -m benchmarks.refill --refill 0,8 --seeds 42
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio

from benchmarks.learning import API_KEY, evaluate, held_out
from benchmarks.measure import positive_int
from benchmarks.report import command_line, load_average, run_context, write_json
from engine import Engine, EngineConfig, RunResult
from engine.local import LocalServer

__all__ = ["main", "measure"]

DEFAULT_OUT = Path(__file__).parent / "results" / "refill.json"


def _ints(text: str) -> list[int]:
    try:
        return [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None


def _run(config: EngineConfig) -> RunResult:
    async def go() -> RunResult:
        async with Engine(config) as engine:
            return await engine.run()

    return anyio.run(go)


def _mean(rows: Sequence[dict[str, Any]], key: str) -> float:
    return statistics.fmean(r[key] for r in rows)


def _spread(rows: Sequence[dict[str, Any]], key: str) -> float:
    return statistics.stdev(r[key] for r in rows) if len(rows) > 1 else 0.0


def measure(args: argparse.Namespace) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    with LocalServer(api_key=API_KEY) as server, tempfile.TemporaryDirectory() as tmp:
        base = held_out(server, args.heldout, args.seeds, args.steps, 8)
        service, tokenizer, problems, stop = base.service, base.tokenizer, base.problems, base.stop
        before = evaluate(base.base_sampler, tokenizer, problems, stop)
        for refill in args.refill:
            for seed in args.seeds:
                config = EngineConfig(
                    base_url=server.base_url,
                    api_key=API_KEY,
                    steps=args.steps,
                    seed=seed,
                    refill_groups=refill,
                    run_dir=Path(tmp) / f"r{refill}-s{seed}",
                    progress=False,
                )
                load = load_average()
                start, cpu = time.perf_counter(), time.process_time()
                result = _run(config)
                wall_s, cpu_s = time.perf_counter() - start, time.process_time() - cpu
                assert result.final_path is not None
                sampler = service.create_sampling_client(model_path=result.final_path)
                after = evaluate(sampler, tokenizer, problems, stop)
                m = result.metrics
                rows.append(
                    {
                        "refill_groups": refill,
                        "seed": seed,
                        "steps": result.steps_completed,
                        "exact_before": before,
                        "exact_after": after,
                        "gain": after - before,
                        "gain_per_step": (after - before) / result.steps_completed,
                        "datums_per_step": statistics.fmean(x["datums"] for x in m),
                        "groups_with_signal_per_step": statistics.fmean(
                            x["groups/with_signal"] for x in m
                        ),
                        "extra_groups_per_step": statistics.fmean(
                            x["refill/extra_groups"] for x in m
                        ),
                        "short_steps": sum(x["refill/short"] for x in m),
                        "train_exact_rate_last": m[-1].get("exact_rate"),
                        "wall_s": round(wall_s, 1),
                        "client_cpu_s": round(cpu_s, 1),
                        "load_before": load,
                    }
                )
                row = rows[-1]
                print(
                    f"refill {refill} seed {seed}: {before:.1%} -> {after:.1%} "
                    f"datums/step {row['datums_per_step']:.1f} "
                    f"extra/step {row['extra_groups_per_step']:.2f} "
                    f"short {row['short_steps']} in {wall_s:.0f} s (load {load})",
                    flush=True,
                )
    summary = []
    for refill in args.refill:
        mine = [r for r in rows if r["refill_groups"] == refill]
        summary.append(
            {
                "refill_groups": refill,
                "runs": len(mine),
                **{
                    f"{key}_{stat}": round(fn(mine, key), 4)
                    for key in (
                        "gain",
                        "datums_per_step",
                        "groups_with_signal_per_step",
                        "extra_groups_per_step",
                        "short_steps",
                        "wall_s",
                    )
                    for stat, fn in (("mean", _mean), ("sd", _spread))
                },
            }
        )
    return {
        "benchmark": "refill",
        "context": run_context(vars(args) | {"out": str(args.out)}),
        "heldout": len(problems),
        "steps": args.steps,
        "seeds": list(args.seeds),
        "runs": rows,
        "summary": summary,
    }


def markdown_table(report: dict[str, Any]) -> str:
    lines = [
        "| --refill-groups | runs | held-out gain (mean ± sd) | datums/step | groups with "
        "signal/step | extra groups/step | short steps | wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in report["summary"]:
        lines.append(
            f"| {s['refill_groups']} | {s['runs']} | {s['gain_mean']:+.1%} ± {s['gain_sd']:.1%} "
            f"| {s['datums_per_step_mean']:.1f} | {s['groups_with_signal_per_step_mean']:.2f} "
            f"| {s['extra_groups_per_step_mean']:.2f} | {s['short_steps_mean']:.1f} "
            f"| {s['wall_s_mean']:.0f} |"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=positive_int, default=30)
    parser.add_argument("--heldout", type=positive_int, default=200, help="held-out problems")
    parser.add_argument("--seeds", type=_ints, default=[42, 1, 2], help="training seeds")
    parser.add_argument(
        "--refill", type=_ints, default=[0, 4], help="--refill-groups values (default 0,4)"
    )
    parser.add_argument("--quick", action="store_true", help="2 steps, 20 held-out, one seed")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON report path")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.heldout, args.seeds = 2, 20, args.seeds[:1]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    report = measure(args)
    table = markdown_table(report)
    print(table)
    write_json(args.out, report)
    command = command_line("benchmarks.refill", argv)
    load = report["context"]["load_average_start"]
    args.out.with_suffix(".md").write_text(
        f"`{command}` (commit {report['context']['commit']}, load average {load} at the start; "
        "each run's in the JSON)\n\n" + table + "\n"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
