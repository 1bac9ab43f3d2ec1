#!/usr/bin/env bash
# Installs the system packages the build and tests need (idempotent; quiet when present).
set -euo pipefail

packages=(pkg-config libucx-dev libclang-dev ucx-utils libfabric-dev libfabric-bin etcd-server fonts-dejavu-core iperf3 iproute2 nftables prometheus)
missing=()
for pkg in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
  sudo_cmd=""
  [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  for attempt in 1 2 3; do
    $sudo_cmd apt-get update -qq && \
      DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}" && break
    echo "apt-get failed (attempt $attempt), retrying" >&2
    sleep $((attempt * 5))
  done
fi
echo "system packages present: ${packages[*]}"
