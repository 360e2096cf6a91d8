#!/usr/bin/env bash
# Creates .venv in the checkout (if missing) and installs the project with every extra
# (local server, report, trackers, Hugging Face datasets, Ray, dev tools) at the exact versions of constraints.txt.
# Idempotent: a second run with unchanged pyproject.toml and constraints.txt does nothing.
#   PYTHON=python3.12          the interpreter that creates .venv (default python3, >= 3.11)
#   TORCH_INDEX_URL=URL        where torch comes from, e.g. https://download.pytorch.org/whl/cpu
#                              on a machine where pip would otherwise pick a CUDA build
set -euo pipefail
cd "$(dirname "$0")/.."

python_bin="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    if ! "$python_bin" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
        echo "bootstrap: $python_bin is missing or older than Python 3.11; set PYTHON=python3.11 (or newer)" >&2
        exit 2
    fi
    echo "bootstrap: creating .venv with $("$python_bin" --version 2>&1)" >&2
    "$python_bin" -m venv .venv
fi

stamp=.venv/.engine-installed
want="$(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi

echo "bootstrap: installing engine and its pinned dependencies into .venv (first run takes a few minutes)" >&2
# torch first and pinned: resolving it alongside peft/accelerate could pull a CUDA build.
torch_index=()
if [ -n "${TORCH_INDEX_URL:-}" ]; then
    torch_index=(--index-url "$TORCH_INDEX_URL")
fi
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check -c constraints.txt)
"${pip[@]}" "${torch_index[@]}" "torch==2.13.0"
"${pip[@]}" -e ".[dev,datasets,ray]"
echo "$want" > "$stamp"
echo "bootstrap: done" >&2
