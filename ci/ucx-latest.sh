#!/usr/bin/env bash
# Installs the newest UCX release as PyPI ships it (libucx-cu13: UCX with its CUDA transports,
# which load only where a CUDA driver is) into a cache, once, and prints the directory of its
# libraries. Loaded in place of Debian's UCX 1.13 through LD_LIBRARY_PATH, it checks that xfer's
# UCX backend works with the UCX that Python environments on GPU machines install, not only the
# one it builds on.
#
#   LD_LIBRARY_PATH=$(ci/ucx-latest.sh) cargo test ... --test ucx
set -euo pipefail
source "$(dirname "$0")/lib/pip-venv.sh"

UCX_WHEEL_VERSION=1.22.0
if ! venv_open ucx-latest "libucx-cu13==$UCX_WHEEL_VERSION" lib/libucx/lib/libucp.so.0; then
  rm -rf "$venv"
  mkdir -p "$venv"
  py=${PD_PYTHON:-python3}
  retried "$py" -m pip install --disable-pip-version-check --no-input --retries 10 --timeout 60 \
    --progress-bar off -q --no-deps --target "$venv/lib" "libucx-cu13==$UCX_WHEEL_VERSION"
  venv_close >/dev/null
fi
echo "$venv/lib/libucx/lib"
