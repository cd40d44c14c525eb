#!/usr/bin/env bash
# System packages the tests and experiments need, installed only when missing (idempotent).
# - haproxy: the `--ingress haproxy` baseline (Debian's package; fleet::ingress starts it as a child).
# - nginx-light: the proxy benchmark's second reference proxy (`cargo xtask proxy-bench`).
set -euo pipefail

need=()
if ! command -v haproxy >/dev/null 2>&1 && [ ! -x /usr/sbin/haproxy ]; then
    need+=(haproxy)
fi
if ! command -v nginx >/dev/null 2>&1 && [ ! -x /usr/sbin/nginx ]; then
    need+=(nginx-light)
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
