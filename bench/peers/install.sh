#!/usr/bin/env bash
# Installs the transfer peers we compare against, from registries only, into a cache that later
# runs reuse: iperf3 and ucx-utils (Debian), NIXL 1.5.1's Python agent (nixl-cu12) and Mooncake's
# transfer_engine_bench (mooncake-transfer-engine-non-cuda) in a virtual environment, and
# vllm-router for the end-to-end comparisons. Idempotent; retries downloads.
#
#   bench/peers/install.sh            # prints the venv path on its last line
set -euo pipefail
# No wheel cache: the downloads are installed once into the venv, a cache would double the disk.
export PIP_NO_CACHE_DIR=1

CACHE=${PD_CACHE_DIR:-$HOME/.cache/pd-suite}
VENV=$CACHE/peers-venv
MARKER=$VENV/.installed-v1
PY_PEERS=(nixl-cu12==1.5.1 mooncake-transfer-engine-non-cuda==0.3.13.post1 numpy msgpack vllm-router)

retry() { local n; for n in 1 2 3; do "$@" && return 0; echo "retry $n/3: $*" >&2; sleep $((n * 5)); done; "$@"; }

missing=()
command -v iperf3 >/dev/null || missing+=(iperf3)
command -v ucx_perftest >/dev/null || missing+=(ucx-utils)
[ -f /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ] || missing+=(fonts-dejavu-core)
if [ ${#missing[@]} -gt 0 ]; then
  sudo=()
  [ "$(id -u)" = 0 ] || sudo=(sudo)
  retry "${sudo[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive retry "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if [ ! -f "$MARKER" ]; then
  mkdir -p "$CACHE"
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
  retry "$VENV/bin/pip" install -q --retries 5 --timeout 60 --upgrade pip >/dev/null
  # nixl-cu12 declares torch but its agent runs without it; --no-deps keeps 2.6 GB of CUDA out.
  retry "$VENV/bin/pip" install -q --retries 5 --timeout 60 --no-deps "${PY_PEERS[@]:0:2}"
  retry "$VENV/bin/pip" install -q --retries 5 --timeout 60 "${PY_PEERS[@]:2}"
  "$VENV/bin/python" -c 'import nixl_cu12._api' 
  test -x "$VENV/lib/python3.11/site-packages/mooncake/transfer_engine_bench" ||
    test -n "$(find "$VENV" -name transfer_engine_bench -type f | head -1)"
  touch "$MARKER"
fi
echo "$VENV"
