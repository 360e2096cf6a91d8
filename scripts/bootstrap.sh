#!/usr/bin/env bash
# Creates .venv in the checkout (if missing) and installs the project with its pinned
# dependencies. Idempotent: a second run with an unchanged pyproject.toml does nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

python_bin="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    echo "bootstrap: creating .venv with $("$python_bin" --version 2>&1)" >&2
    "$python_bin" -m venv .venv
fi

stamp=.venv/.engine-installed
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi

echo "bootstrap: installing engine and its pinned dependencies into .venv (first run takes a few minutes)" >&2
# torch first and pinned: resolving it alongside peft/accelerate could pull a CUDA build.
.venv/bin/python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[dev]"
echo "$want" > "$stamp"
echo "bootstrap: done" >&2
