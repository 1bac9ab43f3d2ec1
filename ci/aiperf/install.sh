#!/usr/bin/env bash
# Installs aiperf (PyPI; NVIDIA's benchmark for OpenAI-compatible endpoints) into a cache, once.
#
#   ci/aiperf/install.sh            # prints the venv path on its last line
#
# The venv is ${PD_CACHE_DIR:-$HOME/.cache/pd-suite}/aiperf-venv. A marker written only after the
# install and a `aiperf profile --help` succeeded makes later runs return at once; a partial venv
# (no marker) is rebuilt. Downloads are retried (pip --retries, and the whole step up to 3 times).
set -euo pipefail
# No wheel cache: the downloads are installed once into the venv, a cache would double the disk.
export PIP_NO_CACHE_DIR=1

AIPERF_VERSION=0.13.0
STAMP="aiperf==$AIPERF_VERSION"
cache="${PD_CACHE_DIR:-$HOME/.cache/pd-suite}"
venv="$cache/aiperf-venv"
marker="$venv/.pd-suite-installed"

if [ -f "$marker" ] && [ "$(cat "$marker")" = "$STAMP" ] && [ -x "$venv/bin/aiperf" ]; then
  echo "aiperf venv present (reused): $venv" >&2
  echo "$venv"
  exit 0
fi

start=$(date +%s)
echo "installing aiperf $AIPERF_VERSION into $venv" >&2
mkdir -p "$cache"
rm -rf "$venv"
"${PD_PYTHON:-python3}" -m venv "$venv"
for attempt in 1 2 3; do
  if "$venv/bin/python" -m pip install --disable-pip-version-check --no-input --retries 10 --timeout 60 \
    --progress-bar off -q "$STAMP"; then
    break
  fi
  [ "$attempt" = 3 ] && { echo "pip install $STAMP failed 3 times" >&2; exit 1; }
  echo "pip install failed (attempt $attempt of 3), retrying" >&2
  sleep $((attempt * 10))
done
"$venv/bin/aiperf" profile --help >/dev/null
echo "$STAMP" >"$marker"
echo "aiperf installed in $(($(date +%s) - start)) s" >&2
echo "$venv"
