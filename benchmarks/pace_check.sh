#!/usr/bin/env bash
# Issue 20's done-when figures in one command (take them on a quiet machine):
#  1. the CLI's steady pace over STEPS (default 20) steps with default settings against
#     ONE standalone `python -m engine.local --latency mint`, its step lines stamped from
#     outside (benchmarks/stamp.py: pace over steps 3..STEPS in s and clock cycles), at
#     8x6x16 and 32x8x16;
#  2. the same workloads in the throughput benchmark (k1 = the defaults, beside the
#     quickstart loop), which starts its own server (one per workload);
#  3. process start to the 1st and 10th step, engine CLI vs quickstart loop, side by side
#     (benchmarks/startup.py, 8x6x16).
# `uptime` is written before and after every figure. Results go to OUT (default
# benchmarks/results/tmp/pace_check); the summary is printed and kept in OUT/summary.txt.
#   bash benchmarks/pace_check.sh
#   PYTHON=/path/to/python STEPS=20 WORKLOADS="8x6x16 32x8x16" bash benchmarks/pace_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
python="${PYTHON:-.venv/bin/python}"
out="${OUT:-benchmarks/results/tmp/pace_check}"
steps="${STEPS:-20}"
workloads="${WORKLOADS:-8x6x16 32x8x16}"
port="${PORT:-18778}"
key=tml-pace-check
rm -rf "$out" && mkdir -p "$out"
summary="$out/summary.txt"
note() { echo "$*" | tee -a "$summary"; }
load() { uptime | sed 's/.*load average: /load /'; }

source benchmarks/stamped.sh
start_server "$python" "$out" "$port" "$key"
for workload in $workloads; do
    IFS=x read -r batch group tokens <<< "$workload"
    before=$(load)
    stamped_run "$python" "$out/cli-$workload.txt" --steps "$steps" --batch "$batch" \
        --group "$group" --max-tokens "$tokens" --run-dir "$out/run-$workload"
    note "CLI $workload: $(tail -1 "$out/cli-$workload.txt") [$before -> $(load)]"
done
kill $server

before=$(load)
# $workloads is split into one argument per workload on purpose.
"$python" -m benchmarks.throughput --configs quickstart k1 --workloads $workloads \
    --latency mint --steps "$steps" --no-plots --out "$out/throughput" \
    > "$out/throughput.log" 2>&1
note "throughput benchmark, one server for all workloads [$before -> $(load)]:"
note "$(cat "$out/throughput/throughput.md")"

before=$(load)
"$python" -m benchmarks.startup --steps 10 --workload 8x6x16 --latency mint \
    --out "$out/startup" > "$out/startup.log" 2>&1
note "start-up, 8x6x16, 10 steps [$before -> $(load)]:"
note "$(cat "$out/startup/startup.md")"
