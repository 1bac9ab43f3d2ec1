#!/usr/bin/env bash
# Installs aiperf (PyPI; NVIDIA's benchmark for OpenAI-compatible endpoints) into a cache, once.
#
#   ci/aiperf/install.sh            # prints the venv path on its last line
#
# The venv is ${PD_CACHE_DIR:-$HOME/.cache/pd-suite}/aiperf-venv, reused while its stamp matches
# (ci/lib/pip-venv.sh); the install counts only after `aiperf profile --help` succeeded.
set -euo pipefail
source "$(dirname "$0")/../lib/pip-venv.sh"

AIPERF_VERSION=0.13.0
if venv_open aiperf "aiperf==$AIPERF_VERSION" bin/aiperf; then
  echo "$venv"
  exit 0
fi
venv_create
pip_install "aiperf==$AIPERF_VERSION"
"$venv/bin/aiperf" profile --help >/dev/null
venv_close
