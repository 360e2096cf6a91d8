#!/usr/bin/env bash
# What the custom loss of --objective dpo costs per step: SFT (one server round a step)
# and DPO (two: the forward's logprobs, then the backward) on the same 20 steps of 8
# rows, on the `mint` latency profile (0.5 s clock cycles), against ONE standalone local
# server; each CLI's step lines are stamped from outside (benchmarks/stamp.py: the pace
# over steps 3..20 in seconds and clock cycles). Results and the machine load go to OUT
# (default benchmarks/results/tmp/dpo_pace).
#   bash benchmarks/dpo_pace.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
out="${OUT:-benchmarks/results/tmp/dpo_pace}"
port="${PORT:-18781}"
key=tml-dpo-pace
rm -rf "$out" && mkdir -p "$out"
.venv/bin/python -m engine.local --port "$port" --api-key "$key" --ephemeral --latency mint \
    > "$out/server.log" 2>&1 &
server=$!
trap 'kill $server' EXIT
for _ in $(seq 120); do grep -q "serving" "$out/server.log" && break; sleep 1; done
for objective in sft dpo; do
    data=examples/sft_repeat.jsonl
    [ "$objective" = dpo ] && data=examples/dpo_repeat.jsonl
    uptime > "$out/$objective.load"
    env -u MINT_API_KEY -u TINKER_API_KEY .venv/bin/python -m engine.run \
        --objective "$objective" --task "jsonl:$data" --batch 8 --steps 20 \
        --api-key "$key" --base-url "http://127.0.0.1:$port" \
        --run-dir "$out/run-$objective" --no-progress 2>&1 \
        | .venv/bin/python -m benchmarks.stamp --cycle 0.5 --skip 2 > "$out/$objective.txt"
    uptime >> "$out/$objective.load"
    echo "$objective: $(tail -1 "$out/$objective.txt")"
done
