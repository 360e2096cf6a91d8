#!/usr/bin/env bash
# Creates .venv-tinker in the checkout (if missing) with the engine (editable, the extras
# `tinker` and `agents-endpoint`: no torch, no local server) on the current tinker SDK
# (0.38.0), at the exact versions of constraints-tinker.txt. tests/test_local_server_tinker038.py
# runs the unmodified SDK from it, and tests/test_sdk_matrix.py the engine (agent tasks
# too), against a local server
# started from .venv (which holds the engine on mint / tinker 0.22 and the local server);
# without .venv-tinker those tests are skipped (and fail under CI).
# Idempotent: a second run with unchanged pyproject.toml and constraints-tinker.txt does
# nothing.
#   PYTHON=python3.12          the interpreter that creates .venv-tinker (default python3, >= 3.11)
set -euo pipefail
cd "$(dirname "$0")/.."

python_bin="${PYTHON:-python3}"
if [ ! -x .venv-tinker/bin/python ]; then
    if ! "$python_bin" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
        echo "bootstrap_tinker: $python_bin is missing or older than Python 3.11; set PYTHON=python3.11 (or newer)" >&2
        exit 2
    fi
    echo "bootstrap_tinker: creating .venv-tinker with $("$python_bin" --version 2>&1)" >&2
    "$python_bin" -m venv .venv-tinker
fi

stamp=.venv-tinker/.tinker-installed
want="$(cat pyproject.toml constraints-tinker.txt | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi

echo "bootstrap_tinker: installing engine[tinker,agents-endpoint] and its pinned dependencies into .venv-tinker" >&2
.venv-tinker/bin/python -m pip install --quiet --disable-pip-version-check \
    -c constraints-tinker.txt -e ".[tinker,agents-endpoint]"
echo "$want" > "$stamp"
echo "bootstrap_tinker: done" >&2
