# Shared by the installers of cached Python environments (ci/vllm, ci/aiperf, ci/sglang,
# bench/peers): where the cache lives, reuse by a stamp, a fresh venv, and downloads retried.
# Source it from a `set -euo pipefail` script, then:
#
#   venv_open NAME STAMP PROBE   # $venv = cache/NAME-venv; succeeds when it can be reused: its
#                                # marker holds STAMP and PROBE (a path under it) is executable
#   venv_create                  # (re)creates $venv, sets $py
#   pip_install ARGS...          # pip install into $venv, retried
#   retried COMMAND...           # any command, up to 3 attempts, 10 s then 20 s apart
#   venv_close                   # writes the marker (only after every step succeeded), prints $venv
#
# A venv without the marker (an install that died half way) is rebuilt from scratch.

# No wheel cache: each download is installed once into its venv; a cache would double the disk.
export PIP_NO_CACHE_DIR=1
pd_cache="${PD_CACHE_DIR:-$HOME/.cache/pd-suite}"

venv_open() {
  venv_name=$1 venv_stamp=$2
  venv="$pd_cache/$1-venv"
  venv_marker="$venv/.pd-suite-installed"
  if [ -f "$venv_marker" ] && [ "$(cat "$venv_marker")" = "$venv_stamp" ] && [ -x "$venv/$3" ]; then
    echo "$venv_name venv present (reused): $venv" >&2
    py="$venv/bin/python"
    return 0
  fi
  venv_start=$(date +%s)
  echo "installing $venv_stamp into $venv" >&2
  return 1
}

venv_create() {
  mkdir -p "$pd_cache"
  rm -rf "$venv"
  "${PD_PYTHON:-python3}" -m venv "$venv"
  py="$venv/bin/python"
}

retried() {
  local attempt
  for attempt in 1 2 3; do
    "$@" && return 0
    echo "failed (attempt $attempt of 3): $*" >&2
    [ "$attempt" = 3 ] || sleep $((attempt * 10))
  done
  return 1
}

pip_install() {
  retried "$py" -m pip install --disable-pip-version-check --no-input --retries 10 --timeout 60 \
    --progress-bar off -q "$@"
}

venv_close() {
  echo "$venv_stamp" >"$venv_marker"
  echo "$venv_name installed in $(($(date +%s) - venv_start)) s: $venv ($(du -sh "$venv" | cut -f1))" >&2
  echo "$venv"
}
