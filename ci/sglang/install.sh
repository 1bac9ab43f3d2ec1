#!/usr/bin/env bash
# Installs a real SGLang (0.5.23, its CPU engine) with Mooncake's TCP transport into a cache, once.
#
#   ci/sglang/install.sh          # prints the venv path on its last line
#
# The venv is ${PD_CACHE_DIR:-$HOME/.cache/pd-suite}/sglang-venv. A marker file written only after
# every step succeeded makes later runs return at once; a partial venv (no marker) is rebuilt.
# Downloads are retried (pip --retries, and each pip step up to 3 times).
# torch/torchvision: when the vLLM venv (ci/vllm/install.sh) holds the same versions, their
# installed files (and those of their requirements) are hard-linked from it — no second
# download, no second copy on disk; otherwise pip installs them from PyPI.
# Not installed: `sgl-kernel`/`sglang-kernel` (CUDA-only); ci/sglang/sgl_kernel is our stand-in.
# Facts followed: ../shared/SGLANG_CPU.md.
set -euo pipefail
source "$(dirname "$0")/../lib/pip-venv.sh"

SGLANG_VERSION=0.5.23
TORCH_VERSION=2.13.0
TORCHVISION_VERSION=0.28.0
MOONCAKE_VERSION=0.3.13.post1
# SGLang's pure-Python requirements that its CPU server imports (pins as in its METADATA where
# it pins); the CUDA kernels, flash-attn, DeepEP and friends are left out.
REQUIREMENTS=(
  aiohttp anthropic blobfile==3.0.0 "compressed-tensors==0.18.0" datasets dill distro easydict
  einops fastapi gguf interegular IPython jsonschema "llguidance>=1.7.6,<2.0.0" msgspec ninja numpy
  "openai==2.8.0" "openai-harmony==0.0.4" orjson packaging partial_json_parser pillow
  "prometheus-client>=0.20.0" psutil pybase64 pydantic python-dateutil python-multipart
  "pyzmq>=25.1.2" regex requests scipy "sentencepiece==0.2.1" setproctitle "soundfile==0.13.1"
  tiktoken "tokenizers==0.23.2" tqdm "transformers==5.19.0" "uvicorn>=0.51" uvloop watchfiles
  "xgrammar==0.2.7" xxhash zstandard nvidia-ml-py
)
STAMP="sglang==$SGLANG_VERSION torch==$TORCH_VERSION torchvision==$TORCHVISION_VERSION mooncake==$MOONCAKE_VERSION reqs=$(printf '%s ' "${REQUIREMENTS[@]}" | md5sum | cut -c1-8)"
vllm_venv="${PD_VLLM_VENV:-$pd_cache/vllm-venv}"
if venv_open sglang "$STAMP" bin/python; then
  echo "$venv"
  exit 0
fi
venv_create
pip_install --upgrade pip
site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"

# torch from the vLLM venv: every distribution in the requirement closure of torch and
# torchvision, linked file by file from its RECORD (scripts outside site-packages skipped).
linked=0
if [ -f "$vllm_venv/.pd-suite-installed" ] && [ -x "$vllm_venv/bin/python" ] &&
  "$vllm_venv/bin/python" - "$site" "$TORCH_VERSION" "$TORCHVISION_VERSION" <<'PY'
import importlib.metadata as md, os, sys
from pip._vendor.packaging.requirements import Requirement

target, torch_version, vision_version = sys.argv[1:4]
if md.version("torch") != torch_version or md.version("torchvision") != vision_version:
    sys.exit(1)
seen, todo = {}, ["torch", "torchvision"]
while todo:
    name = todo.pop()
    key = name.lower().replace("_", "-")
    if key in seen:
        continue
    try:
        dist = md.distribution(name)
    except md.PackageNotFoundError:
        continue
    seen[key] = dist
    for line in dist.requires or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            todo.append(req.name)
files = 0
for dist in seen.values():
    base = dist.locate_file("")
    for entry in dist.files or []:
        if str(entry).startswith(".."):
            continue
        src = os.path.join(base, entry)
        dst = os.path.join(target, entry)
        if not os.path.isfile(src) or os.path.exists(dst):
            continue
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        os.link(src, dst)
        files += 1
print(f"linked {len(seen)} distributions ({files} files) from the vLLM venv", file=sys.stderr)
PY
then
  linked=1
else
  echo "no vLLM venv with torch $TORCH_VERSION to share; installing torch from PyPI" >&2
  pip_install "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION"
fi

pip_install "${REQUIREMENTS[@]}" "mooncake-transfer-engine-non-cuda==$MOONCAKE_VERSION"
pip_install --no-deps "sglang==$SGLANG_VERSION"

# Smoke: the server module imports with our sgl_kernel stand-in, and Mooncake loads.
here="$(cd "$(dirname "$0")" && pwd)"
SGLANG_USE_CPU_ENGINE=1 PYTHONPATH="$here" "$py" -c '
import importlib.metadata as m, torch, sgl_kernel, mooncake.engine, sglang.launch_server
import sglang.srt.entrypoints.http_server, sglang.srt.managers.scheduler, sglang.srt.entrypoints.openai.serving_chat
import sglang.srt.disaggregation.prefill, sglang.srt.disaggregation.decode
import sglang.srt.disaggregation.mooncake.conn
print("sglang", m.version("sglang"), "torch", torch.__version__)' >&2

echo "torch linked from the vLLM venv: $linked" >&2
venv_close
