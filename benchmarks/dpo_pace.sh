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
source benchmarks/stamped.sh
start_server .venv/bin/python "$out" "$port" "$key"
for objective in sft dpo; do
    data=examples/sft_repeat.jsonl
    [ "$objective" = dpo ] && data=examples/dpo_repeat.jsonl
    uptime > "$out/$objective.load"
    stamped_run .venv/bin/python "$out/$objective.txt" --objective "$objective" \
        --task "jsonl:$data" --batch 8 --steps 20 --run-dir "$out/run-$objective"
    uptime >> "$out/$objective.load"
    echo "$objective: $(tail -1 "$out/$objective.txt")"
done
