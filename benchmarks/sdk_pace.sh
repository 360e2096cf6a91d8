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
.venv/bin/python -m engine.local --port "$port" --api-key "$key" --ephemeral --latency mint \
    > "$out/server.log" 2>&1 &
server=$!
trap 'kill $server' EXIT
for _ in $(seq 120); do grep -q "serving" "$out/server.log" && break; sleep 1; done
for sdk in mint tinker; do
    python=.venv/bin/python
    [ "$sdk" = tinker ] && python=.venv-tinker/bin/python
    uptime > "$out/$sdk.load"
    env -u MINT_API_KEY -u TINKER_API_KEY "$python" -m engine.run --sdk "$sdk" \
        --api-key "$key" --base-url "http://127.0.0.1:$port" --steps 20 \
        --run-dir "$out/run-$sdk" --no-progress 2>&1 \
        | .venv/bin/python -m benchmarks.stamp --cycle 0.5 --skip 2 > "$out/$sdk.txt"
    uptime >> "$out/$sdk.load"
    echo "$sdk: $(tail -1 "$out/$sdk.txt")"
done
