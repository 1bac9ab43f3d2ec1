#!/usr/bin/env bash
# Builds the pd-xfer wheel from source and unpacks it, with pytest, into a directory that any
# Python >= 3.10 can use through PYTHONPATH (the tests run it inside the real-vLLM venv, whose
# torch, numpy and nixl they need; the vLLM engines of the end-to-end suite load it from there).
#
#   bindings/python/build.sh [--features ucx]   # prints the directory on its last line
#
# maturin (PyPI) lives in ${PD_CACHE_DIR:-$HOME/.cache/pd-suite}/maturin-venv, installed once.
# The wheel lands in target/wheels; the directory is target/pd-xfer-site (rebuilt every run).
set -euo pipefail
cd "$(dirname "$0")/../.."
source ci/lib/pip-venv.sh

MATURIN_VERSION=1.16.0
PYTEST_VERSION=8.3.5
if ! venv_open maturin "maturin==$MATURIN_VERSION pytest==$PYTEST_VERSION" bin/maturin; then
  venv_create
  pip_install "maturin==$MATURIN_VERSION"
  mkdir -p "$venv/pytest-site"
  pip_install --target "$venv/pytest-site" "pytest==$PYTEST_VERSION"
  venv_close >/dev/null
fi
tools=$venv

wheels=target/wheels
rm -f "$wheels"/pd_xfer-*.whl
extra=()
case " $* " in
  # The UCX build links the system libucx, which loads its transports as modules from the system:
  # bundling it into the wheel (maturin's repair) would break that, so the wheel stays local.
  *ucx*) extra=(--auditwheel skip) ;;
esac
"$tools/bin/maturin" build --release --locked --manifest-path bindings/python/Cargo.toml -o "$wheels" \
  "${extra[@]}" "$@" >&2
wheel="$(ls "$wheels"/pd_xfer-*.whl)"
site="$PWD/target/pd-xfer-site"
rm -rf "$site"
"$tools/bin/python" -m pip install --disable-pip-version-check -q --no-deps --no-index --target "$site" "$wheel" >&2
cp -r "$tools/pytest-site/." "$site/"
echo "pd-xfer wheel $(basename "$wheel") unpacked with pytest into $site" >&2
echo "$site"
