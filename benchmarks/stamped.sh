# Sourced by the pace scripts (pace_check.sh, sdk_pace.sh, dpo_pace.sh): one standalone
# local server on the `mint` latency clock, and engine CLI runs against it whose step
# lines are stamped from outside (benchmarks/stamp.py: the pace over steps 3..N in seconds
# and 0.5 s clock cycles).

# start_server PYTHON OUT PORT KEY: `PYTHON -m engine.local` on PORT with KEY, its log in
# OUT/server.log, killed when the script exits; returns once it serves.
start_server() {
    pace_python=$1 pace_port=$3 pace_key=$4
    "$pace_python" -m engine.local --port "$pace_port" --api-key "$pace_key" --ephemeral \
        --latency mint > "$2/server.log" 2>&1 &
    server=$!
    trap 'kill $server 2>/dev/null || true' EXIT
    for _ in $(seq 120); do grep -q "serving" "$2/server.log" && break; sleep 1; done
}

# stamped_run PYTHON FILE ARG...: `PYTHON -m engine.run ARG...` against the server (no
# hosted key in its environment), its stamped step lines in FILE.
stamped_run() {
    local python=$1 file=$2
    shift 2
    env -u MINT_API_KEY -u TINKER_API_KEY "$python" -m engine.run --api-key "$pace_key" \
        --base-url "http://127.0.0.1:$pace_port" --no-progress "$@" 2>&1 \
        | "$pace_python" -m benchmarks.stamp --cycle 0.5 --skip 2 > "$file"
}
