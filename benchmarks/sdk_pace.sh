#!/usr/bin/env bash
# The default row (8x6x16, K=1, 20 steps) on the `mint` latency profile, once from each
# SDK generation's environment, against ONE standalone local server started from .venv;
# each CLI's step lines are stamped from outside (benchmarks/stamp.py: the pace over steps
# 3..20 in seconds and clock cycles). Needs .venv (bootstrap.sh) and .venv-tinker
# (bootstrap_tinker.sh). Results and the machine load go to OUT (default
# benchmarks/results/tmp/sdk_pace).
#   bash benchmarks/sdk_pace.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
out="${OUT:-benchmarks/results/tmp/sdk_pace}"
port="${PORT:-18777}"
key=tml-sdk-pace
rm -rf "$out" && mkdir -p "$out"
source benchmarks/stamped.sh
start_server .venv/bin/python "$out" "$port" "$key"
for sdk in mint tinker; do
    python=.venv/bin/python
    [ "$sdk" = tinker ] && python=.venv-tinker/bin/python
    uptime > "$out/$sdk.load"
    stamped_run "$python" "$out/$sdk.txt" --sdk "$sdk" --steps 20 --run-dir "$out/run-$sdk"
    uptime >> "$out/$sdk.load"
    echo "$sdk: $(tail -1 "$out/$sdk.txt")"
done
