#!/usr/bin/env bash
# Installs what the monitoring tests run, from Debian's packages, when missing:
#   prometheus      (a real Prometheus server + promtool: tests/test_monitoring.py, test_compose.py)
#   docker-compose  (1.29: validates docker-compose.yml in tests/test_compose.py)
# Idempotent; needs root (or sudo) and apt. `make test` / .ci/run call it before pytest, and the
# tests call it themselves when a tool is missing.
set -euo pipefail

need=()
command -v prometheus >/dev/null 2>&1 || need+=(prometheus)
command -v promtool >/dev/null 2>&1 || need+=(prometheus)
command -v docker-compose >/dev/null 2>&1 || need+=(docker-compose)
[ ${#need[@]} -eq 0 ] && exit 0

sudo=""
if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null 2>&1 || { echo "install-test-tools: need root or sudo to install ${need[*]}" >&2; exit 1; }
    sudo="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -q
# --no-install-recommends: docker-compose would otherwise pull the whole docker engine
$sudo apt-get install -y -q --no-install-recommends $(printf '%s\n' "${need[@]}" | sort -u)
