#!/usr/bin/env bash
# The README's local P/D cluster with real vLLM engines instead of simulators:
#
#   ci/vllm/cluster.sh [pdbench cluster options...]
#
# Installs vLLM (cached), builds pdbench, starts one real prefill (core 0) and one real decode
# (core 1) — two are what a 2-core, 24 GiB machine holds —, then runs
# `pdbench cluster --vllm --prefill-url ... --decode-url ...` (sample workload, progress bar,
# report; pdbench does the P/D handoff). The engines are stopped on exit, on error and on Ctrl-C.
# Ports: PD_CLUSTER_PORT_BASE (default 8100): prefill +0, decode +100, NIXL side channels
# 5600/5601, KV events 5557/5567.
set -euo pipefail
cd "$(dirname "$0")/../.."

base="${PD_CLUSTER_PORT_BASE:-8100}"
prefill_port=$base decode_port=$((base + 100))
venv="$(ci/vllm/install.sh | tail -n1)"
export PD_VLLM_VENV="$venv"
cargo build --quiet -p pd-bench --bin pdbench

stop_all() {
  trap - EXIT INT TERM
  ci/vllm/engine.sh stop cluster-prefill || true
  ci/vllm/engine.sh stop cluster-decode || true
}
trap stop_all EXIT
trap 'stop_all; exit 130' INT TERM

echo "starting a real vLLM prefill (:$prefill_port) and decode (:$decode_port); about 1-3 minutes" >&2
ci/vllm/engine.sh start cluster-prefill --port "$prefill_port" --side-port 5600 --core 0 --events 'tcp://*:5557' &
p=$!
ci/vllm/engine.sh start cluster-decode --port "$decode_port" --side-port 5601 --core 1 --events 'tcp://*:5567' &
d=$!
wait "$p" && wait "$d" || { echo "an engine did not start" >&2; exit 1; }

target/debug/pdbench cluster --vllm \
  --prefill-url "http://127.0.0.1:$prefill_port" --decode-url "http://127.0.0.1:$decode_port" \
  --model tiny-llama "$@"
