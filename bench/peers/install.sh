#!/usr/bin/env bash
# Installs the transfer peers we compare against, from registries only, into a cache that later
# runs reuse: iperf3 and ucx-utils (Debian), NIXL 1.5.1's Python agent (nixl-cu12) and Mooncake's
# transfer_engine_bench (mooncake-transfer-engine-non-cuda) in a virtual environment, and
# vllm-router for the end-to-end comparisons. Idempotent; retries downloads.
#
#   bench/peers/install.sh            # prints the venv path on its last line
set -euo pipefail
source "$(dirname "$0")/../../ci/lib/pip-venv.sh"

PY_PEERS=(nixl-cu12==1.5.1 mooncake-transfer-engine-non-cuda==0.3.13.post1 numpy msgpack vllm-router)

missing=()
command -v iperf3 >/dev/null || missing+=(iperf3)
command -v ucx_perftest >/dev/null || missing+=(ucx-utils)
[ -f /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ] || missing+=(fonts-dejavu-core)
if [ ${#missing[@]} -gt 0 ]; then
  sudo=()
  [ "$(id -u)" = 0 ] || sudo=(sudo)
  retried "${sudo[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive retried "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if ! venv_open peers "${PY_PEERS[*]}" bin/vllm-router; then
  venv_create
  pip_install --upgrade pip
  # nixl-cu12 declares torch but its agent runs without it; --no-deps keeps 2.6 GB of CUDA out.
  pip_install --no-deps "${PY_PEERS[@]:0:2}"
  pip_install "${PY_PEERS[@]:2}"
  "$py" -c 'import nixl_cu12._api'
  test -n "$(find "$venv" -name transfer_engine_bench -type f | head -1)"
  venv_close >/dev/null
fi
echo "$venv"
