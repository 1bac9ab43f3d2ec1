#!/usr/bin/env bash
# The GPU check: one machine with an NVIDIA GPU and a CUDA 12 driver, at most 5 minutes.
#
#   ci/gpu-check.sh            # builds (release) what it runs, then checks
#   BIN_DIR=DIR ci/gpu-check.sh  # uses prebuilt xferbench, cuda_bandwidth and test binaries in DIR,
#                                # and the pd-xfer wheel unpacked in DIR/pd-xfer-site if it is there
#
# 1. The GPU tests with XFER_REQUIRE_GPU=1 (a skip is a failure here): xfer-cuda's driver test
#    and real VRAM over TCP through CUDA lanes, and VRAM → FILE through posix
#    (xfer/tests/staged.rs); GDS VRAM↔FILE through cuFile (plugins/gds/tests), which skips
#    loudly where libcufile is not installed (compat mode needs no nvidia-fs: the script points
#    CUFILE_ENV_PATH_JSON at a cufile.json allowing it unless one is set). Where cuFile is
#    only PyPI's nvidia-cufile (libcufile.so.0 under site-packages, off the loader's path), the
#    script puts its folder on LD_LIBRARY_PATH for the Rust tests; the wheel finds it itself.
#    Without udev (a microVM, a container) cuFile cannot register files; as root the script
#    then writes the udev record cuFile reads (see below). Then the Python wheel: a GPU KV cache
#    READ and WRITTEN between two processes through pd_xfer.nixl, and GPU blocks to a file and
#    back through GDS and POSIX (bindings/python/tests/test_cuda_kv.py).
# 2. The baselines, in this run: cuMemcpy device→host, host→device, device→device, and the
#    staging pipeline alone (examples/cuda_bandwidth.rs).
# 3. xferbench over TCP, consistency-checked: DRAM→DRAM (the baseline), VRAM→remote DRAM and
#    VRAM→remote VRAM (staging), FILE↔VRAM through the staging path.
# 4. The bars: TCP VRAM→remote DRAM ≥ 0.8 × DRAM→DRAM; the staging pipeline ≥ 0.7 × cuMemcpy
#    device→host. Printed as ratios; the script fails when a bar is missed.
#
# 5. With binaries built with `--features ucx` (XFER_UCX=1): UCX with native CUDA memory
#    (VRAM↔VRAM, no staging) when the UCX xfer links has CUDA (`ucx_info -d` lists
#    cuda_copy/cuda_ipc; the PyPI package libucx-cu12 ships such a UCX), else UCX's staging of
#    VRAM→remote DRAM through CUDA lanes, as TCP's.
#
set -euo pipefail
cd "$(dirname "$0")/.."

command -v nvidia-smi >/dev/null && nvidia-smi -L || echo "nvidia-smi not found; relying on the driver library"
export XFER_REQUIRE_GPU=1
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
if [[ -z "${CUFILE_ENV_PATH_JSON:-}" ]]; then
  printf '{"properties": {"allow_compat_mode": true}}\n' >"$out/cufile.json"
  export CUFILE_ENV_PATH_JSON="$out/cufile.json"
fi
# cuFile's compat mode looks a file's block device up in udev's database and refuses the file
# (cuFileHandleRegister: CU_FILE_HANDLE_NOT_REGISTERED, "unable to get volume attributes")
# where there is none, as in a microVM or container without udev. There, as root, the script
# writes the record cuFile reads for the root filesystem's device.
root_dev=$(mountpoint -d / 2>/dev/null || true)
if [[ ! -d /run/udev && -n "$root_dev" && $(id -u) == 0 ]]; then
  mkdir -p /run/udev/data
  printf 'E:ID_FS_USAGE=filesystem\nE:ID_FS_TYPE=%s\n' "$(findmnt -n -o FSTYPE /)" >"/run/udev/data/b$root_dev"
  echo "cuFile: no udev database here; wrote /run/udev/data/b$root_dev for the root filesystem"
fi
if ! ldconfig -p | grep -q 'libcufile\.so'; then
  sites=$(python3 -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null || true)
  # shellcheck disable=SC2086 # the site directories are words
  pip_cufile=$(find $sites -name 'libcufile.so.[0-9]*' 2>/dev/null | head -1)
  if [[ -n "$pip_cufile" ]]; then
    export LD_LIBRARY_PATH="$(dirname "$pip_cufile")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    echo "cuFile: $pip_cufile (PyPI), its folder on LD_LIBRARY_PATH for the Rust tests"
  fi
fi

if [[ -z "${BIN_DIR:-}" ]]; then
  cargo build --release --locked -p xfer-bench --bin xferbench ${XFER_UCX:+--features ucx}
  cargo build --release --locked -p xfer-cuda --example cuda_bandwidth
  BIN_DIR=target/release
  echo "== GPU tests"
  cargo test --release --locked -p xfer-cuda -- --test-threads 1
  cargo test --release --locked -p xfer --test staged -- --test-threads 1
  echo "== GDS (cuFile) tests"
  cargo test --release --locked -p xfer-gds -- --test-threads 1 --nocapture
  site=$(bindings/python/build.sh | tail -1)
else
  echo "== GPU tests (prebuilt)"
  for test_bin in "$BIN_DIR"/staged-* "$BIN_DIR"/xfer_cuda-* "$BIN_DIR"/xfer_gds-* "$BIN_DIR"/agent-*; do
    if [[ -x "$test_bin" ]]; then
      echo "-- $(basename "$test_bin")"
      "$test_bin" --test-threads 1 --nocapture
    fi
  done
  site="$BIN_DIR/pd-xfer-site"
fi

if [[ -d "$site" ]]; then
  echo "== the Python wheel: a GPU KV cache between two processes (pd_xfer.nixl)"
  # The site carries its own pytest: plugins installed beside another pytest are not loaded.
  PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 PYTHONPATH="$(realpath "$site")" python3 -m pytest -q -s -p no:cacheprovider bindings/python/tests/test_cuda_kv.py
else
  echo "the Python wheel: not checked ($site is missing)"
fi

echo "== baselines (cuMemcpy, staging pipeline)"
baseline=$("$BIN_DIR/examples/cuda_bandwidth" 512 1024 2>/dev/null || "$BIN_DIR/cuda_bandwidth" 512 1024)
echo "$baseline"

bench() {
  local name=$1 backend=$2
  shift 2
  "$BIN_DIR/xferbench" --backend "$backend" --op write --block-sizes 16M --iters 40 --warmup 4 --check --no-progress \
    --json "$out/$name.json" "$@" >"$out/$name.log" 2>&1 || { cat "$out/$name.log"; return 1; }
  python3 -c 'import json,sys; print("%.2f" % max(r["gbps"] for r in json.load(open(sys.argv[1]))))' "$out/$name.json"
}

echo "== xferbench over TCP (16 MiB blocks, write, checked)"
dram=$(bench dram tcp --local-mem dram --remote-mem dram)
vram_dram=$(bench vram-dram tcp --local-mem vram --remote-mem dram)
vram_vram=$(bench vram-vram tcp --local-mem vram --remote-mem vram)
file_vram=$(bench file-vram tcp --local-mem file --remote-mem vram)
vram_file=$(bench vram-file tcp --local-mem vram --remote-mem file)
printf '| path | GB/s |\n|---|---|\n| DRAM→DRAM | %s |\n| VRAM→DRAM | %s |\n| VRAM→VRAM | %s |\n| FILE→VRAM | %s |\n| VRAM→FILE | %s |\n' \
  "$dram" "$vram_dram" "$vram_vram" "$file_vram" "$vram_file"
if command -v ucx_info >/dev/null && ucx_info -d | grep -q cuda_copy && [[ -n "${XFER_UCX:-}" ]]; then
  echo "UCX VRAM→VRAM (native CUDA): $(bench ucx-vram ucx --local-mem vram --remote-mem vram) GB/s"
elif [[ -n "${XFER_UCX:-}" ]]; then
  ucx_dram=$(bench ucx-dram ucx --local-mem dram --remote-mem dram)
  ucx_vram=$(bench ucx-vram-dram ucx --local-mem vram --remote-mem dram)
  echo "UCX without CUDA: DRAM→DRAM $ucx_dram GB/s, VRAM→DRAM (staged) $ucx_vram GB/s"
else
  echo "UCX: not covered here (XFER_UCX=1 builds xferbench with --features ucx)"
fi

python3 - "$baseline" "$dram" "$vram_dram" <<'EOF'
import json, sys
base = json.loads(sys.argv[1])
dram, vram_dram = float(sys.argv[2]), float(sys.argv[3])
bars = [
    ("TCP VRAM→remote DRAM vs DRAM→DRAM", vram_dram / dram, 0.8),
    ("staging pipeline D→H vs cuMemcpy D→H", base["staged_d2h_gbps"] / base["memcpy_d2h_gbps"], 0.7),
    ("staging pipeline H→D vs cuMemcpy H→D", base["staged_h2d_gbps"] / base["memcpy_h2d_gbps"], 0.7),
]
missed = 0
for name, ratio, bar in bars:
    met = ratio >= bar
    missed += not met
    print(f"{name}: {ratio:.2f} (bar {bar}) {'met' if met else 'MISSED'}")
sys.exit(1 if missed else 0)
EOF
