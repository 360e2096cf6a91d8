#!/usr/bin/env bash
# Installs bubblewrap (bwrap), which engine.sandbox isolates code with (docs/sandbox.md).
# Idempotent: does nothing where bwrap is on PATH. As root with apt-get (Debian, Ubuntu; CI)
# it installs the `bubblewrap` package quietly; elsewhere it says what to install and exits 0
# (the sandbox refuses to run code, in one line, until it is there).
set -euo pipefail

if command -v bwrap >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "install_sandbox: bwrap is missing; install bubblewrap (e.g. sudo apt-get install bubblewrap) for engine.sandbox" >&2
    exit 0
fi
echo "install_sandbox: installing bubblewrap with apt-get" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null
apt-get install -y -qq --no-install-recommends bubblewrap >/dev/null
command -v bwrap >/dev/null
