"""Does on-policy distillation reach a teacher's accuracy in fewer steps than RL?

On the local server's default model (two-digit addition), one RL run trains a teacher
(``--teacher-steps``, seed ``--teacher-seed``); then, for each seed, a fresh student is
distilled from the teacher's run directory (``--objective distill --teacher RUN_DIR``)
and a fresh model is trained by RL from scratch, on the same task and seed. Every run is
``python -m engine.run`` with the local defaults (8 problems x 6 samples, the server's
recommended lr and rank) and ``--eval-every``: the held-out accuracy is
``eval/exact_bonus/rate`` of ``eval.jsonl`` (greedy, ``eval_size`` held-out pairs that
no run trains on, the same pairs for every run).

The target (issue 33): the student reaches 90% of the teacher's held-out accuracy in at
most half the steps RL from scratch needs to reach it. A run that never reaches it
within its steps counts as "not reached".

    python -m benchmarks.distill                        # what results/distill.json holds
    python -m benchmarks.distill --seeds 1 --rl-steps 10 --distill-steps 5 --teacher-steps 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.measure import positive_int
from benchmarks.report import command_line

ACCURACY = "eval/exact_bonus/rate"


def engine_run(run_dir: Path, args: list[str]) -> tuple[dict[int, float], float, float]:
    """Run ``python -m engine.run`` into ``run_dir``: (held-out accuracy by step, wall
    seconds, CPU seconds of the run and its local server)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TINKER_TELEMETRY": "0"}
    env.pop("MINT_API_KEY", None)
    env.pop("MINT_BASE_URL", None)
    command = [sys.executable, "-m", "engine.run", "--run-dir", str(run_dir), "--no-progress"]
    start, cpu = time.perf_counter(), os.times()
    done = subprocess.run([*command, *args], env=env, capture_output=True, text=True)
    wall, after = time.perf_counter() - start, os.times()
    if done.returncode != 0:
        raise SystemExit(f"engine.run {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")
    curve = {}
    for line in (run_dir / "eval.jsonl").read_text().splitlines():
        record = json.loads(line)
        curve[int(record["step"])] = float(record[ACCURACY])
    used = (after.children_user + after.children_system) - (cpu.children_user + cpu.children_system)
    return curve, wall, used


def first_reaching(curve: dict[int, float], target: float) -> int | None:
    """The first evaluated step whose accuracy is at least ``target`` (None: never)."""
    return next((step for step in sorted(curve) if curve[step] >= target), None)


def first_staying(curve: dict[int, float], target: float) -> int | None:
    """The first evaluated step from which every later evaluation is at least
    ``target`` (None: the last one is below it)."""
    steps = sorted(curve)
    return next(
        (s for i, s in enumerate(steps) if all(curve[t] >= target for t in steps[i:])), None
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--teacher-seed", type=int, default=0)
    parser.add_argument("--teacher-steps", type=positive_int, default=40)
    parser.add_argument("--rl-steps", type=positive_int, default=40)
    parser.add_argument("--distill-steps", type=positive_int, default=20)
    parser.add_argument("--distill-coef", type=float, default=1.0)
    parser.add_argument("--distill-reward-weight", type=float, default=0.0)
    parser.add_argument("--eval-every", type=positive_int, default=5)
    parser.add_argument("--eval-size", type=positive_int, default=200)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/distill.json"))
    ns = parser.parse_args(argv)
    seeds = [int(s) for s in ns.seeds.split(",")]
    common = ["--eval-every", str(ns.eval_every), "--task-arg", f"eval_size={ns.eval_size}"]
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="distill-bench-") as tmp:
        root = Path(tmp)
        teacher_dir = root / "teacher"
        teacher_args = ["--steps", str(ns.teacher_steps), "--seed", str(ns.teacher_seed)]
        teacher_curve, teacher_wall, teacher_cpu = engine_run(teacher_dir, [*teacher_args, *common])
        teacher_acc = teacher_curve[max(teacher_curve)]
        target = 0.9 * teacher_acc
        print(f"teacher: {teacher_acc:.3f} after {ns.teacher_steps} steps; target {target:.3f}")
        runs: list[dict[str, Any]] = []
        for seed in seeds:
            for kind, args in (
                ("rl", ["--steps", str(ns.rl_steps)]),
                (
                    "distill",
                    [
                        "--steps",
                        str(ns.distill_steps),
                        "--objective",
                        "distill",
                        "--teacher",
                        str(teacher_dir),
                        "--distill-coef",
                        str(ns.distill_coef),
                        "--distill-reward-weight",
                        str(ns.distill_reward_weight),
                    ],
                ),
            ):
                curve, wall, cpu = engine_run(
                    root / f"{kind}-{seed}", [*args, "--seed", str(seed), *common]
                )
                reached = first_reaching(curve, target)
                runs.append(
                    {
                        "kind": kind,
                        "seed": seed,
                        "curve": curve,
                        "reached_target_at": reached,
                        "wall_s": round(wall, 1),
                        "cpu_s": round(cpu, 1),
                    }
                )
                print(f"{kind} seed {seed}: {curve} -> target at step {reached}")
    totals = summary(runs, seeds, target)
    result = {
        "benchmark": "distill",
        "command": command_line("benchmarks.distill", argv),
        "model": "local default (engine/local/default_model), two-digit addition",
        "metric": f"{ACCURACY} (greedy, {ns.eval_size} held-out pairs)",
        "teacher": {
            "steps": ns.teacher_steps,
            "seed": ns.teacher_seed,
            "curve": teacher_curve,
            "accuracy": teacher_acc,
            "wall_s": round(teacher_wall, 1),
            "cpu_s": round(teacher_cpu, 1),
        },
        "target": target,
        "distill_coef": ns.distill_coef,
        "distill_reward_weight": ns.distill_reward_weight,
        "runs": runs,
        "summary": totals,
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
    }
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(totals, indent=2))
    return 0


def summary(runs: list[dict[str, Any]], seeds: list[int], target: float) -> dict[str, Any]:
    """Mean accuracy by step of each kind; per seed and for the mean curve, the first
    step at the target and the first step from which it stays there; whether the
    student got there in at most half RL's steps (RL never reaching it: its steps
    count as more than it ran)."""
    out: dict[str, Any] = {}
    for kind in ("rl", "distill"):
        mine = [r for r in runs if r["kind"] == kind]
        steps = sorted(set.intersection(*({int(s) for s in r["curve"]} for r in mine)))
        curves = [{int(s): v for s, v in r["curve"].items()} for r in mine]
        mean = {s: round(statistics.mean(c[s] for c in curves), 4) for s in steps}
        out[f"{kind}_mean_curve"] = mean
        for name, rule in (("reaches", first_reaching), ("stays", first_staying)):
            out[f"{kind}_{name}_target_at"] = {
                r["seed"]: rule(c, target) for r, c in zip(mine, curves, strict=True)
            }
            out[f"{kind}_mean_curve_{name}_target_at"] = rule(mean, target)
    for name in ("reaches", "stays"):
        met = {}
        for seed in seeds:
            rl, distill = out[f"rl_{name}_target_at"][seed], out[f"distill_{name}_target_at"][seed]
            met[seed] = distill is not None and (rl is None or distill <= rl / 2)
        out[f"half_the_steps_{name}"] = met
    return out


if __name__ == "__main__":
    raise SystemExit(main())
