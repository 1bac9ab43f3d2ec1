#!/usr/bin/env bash
# The README's test command: everything CI checks, on a fresh machine or a developer's.
set -euo pipefail
cd "$(dirname "$0")/.."

export CARGO_TERM_COLOR=never
# Failing tests print a backtrace; the suites bound their own waits.
export RUST_BACKTRACE=1
# One-shot builds gain nothing from incremental state, which took a third of target/ (4.5 GB).
export CARGO_INCREMENTAL=0

# Each step header shows the free disk, so a full disk is seen where it happens.
step() {
  printf '\n==== %s ==== (free disk: %s, %d min %02d s in)\n' "$*" "$(df -h --output=avail . | tail -n1 | tr -d ' ')" \
    $((SECONDS / 60)) $((SECONDS % 60))
}

step "system packages"
ci/install-deps.sh

# Jobs in the background, each awaited by the step that needs it; their output goes to a log,
# printed when the step waits:
# - the Python caches (peers, real vLLM, real SGLang, aiperf) are downloads, not builds: on a fresh
#   machine they install while the builds below use the cores;
# - the wheel's and the fuzz targets' release builds run at the lowest priority from the end of the
#   test step, on the cycles the suites in between leave idle (the engine suites mostly wait).
background_logs=$(mktemp -d)
declare -A background_pids
start_background() {
  local name=$1
  shift
  # Its own process group, so that the trap below stops pip and cargo too. Its exit status goes to
  # a file: bash forgets a finished job's status once another child of this shell gets its pid
  # (pid_max is 32768 here and a CI run goes round it), and `wait` then fails with "not a child
  # of this shell" (status 127) although the job succeeded.
  setsid bash -c '"$@"; echo $? >"$0"' "$background_logs/$name.status" "$@" >"$background_logs/$name.log" 2>&1 &
  background_pids[$name]=$!
}
# Whether a job started above has ended (its status is written).
background_done() {
  [ -s "$background_logs/$1.status" ]
}
# Waits for a job started above, prints its log and sets `last_line` to the log's last line (an
# install's venv path, the wheel's directory).
await_background() {
  local name=$1 status
  while ! background_done "$name"; do
    # A job killed before it could write its status has no process group left.
    if ! kill -0 -- "-${background_pids[$name]}" 2>/dev/null && ! background_done "$name"; then
      echo "background job $name ended without a status" >&2
      return 1
    fi
    sleep 1
  done
  # No `wait`: the pid may belong to another job by now (bash reaps the job by itself).
  unset "background_pids[$name]"
  status=$(cat "$background_logs/$name.status")
  cat "$background_logs/$name.log" >&2
  if [ "$status" != 0 ]; then
    echo "background job $name failed (status $status)" >&2
    return "$status"
  fi
  last_line=$(tail -n1 "$background_logs/$name.log")
}
# A failing step must not leave jobs running behind it.
stop_background() {
  local pid
  for pid in "${background_pids[@]}"; do
    kill -- "-$pid" 2>/dev/null || true
  done
}
trap stop_background EXIT
start_background peers bench/peers/install.sh
start_background vllm ci/vllm/install.sh
# SGLang links torch from the vLLM venv when that is there: its install starts when vLLM's ends.
start_background sglang bash -c "while [ ! -s '$background_logs/vllm.status' ]; do sleep 1; done; exec ci/sglang/install.sh"
start_background aiperf ci/aiperf/install.sh

# First, as a new user runs it: the README's main command with no system package to lean on.
step "main command (README) with protoc, the protobuf headers and libzmq hidden"
ci/main-command-bare.sh

step "format, and the benchmark README's tables equal the committed reports in bench/results"
cargo fmt --all -- --check
bench/update-readme.sh 2>/dev/null
git diff --exit-code -- bench/README.md

step "lints (every feature, UCX and libfabric included)"
cargo clippy --workspace --all-targets --all-features --locked -- -D warnings
# coordinator/dynamo-compare is a workspace of its own (Dynamo's dependencies stay out of this
# build), so a dependency added here must reach its lock file too, or dynamo-compare.sh's locked
# build fails. Resolving it checks that in seconds, without building Dynamo's crates.
cargo metadata --locked --format-version 1 --manifest-path coordinator/dynamo-compare/Cargo.toml > /dev/null

# Every cargo call below uses the same selection (--workspace --all-features), so nothing is built
# twice with another feature set: one build serves the tests, the UCX suite and the smoke runs.
step "peers (NIXL, Mooncake, iperf3, vllm-router) installed once into the cache"
await_background peers
peers_venv=$last_line
# pdbench's routing comparison runs vllm-router (cache_aware, round robin) beside ours.
export PDBENCH_VLLM_ROUTER="$peers_venv/bin/vllm-router"

step "tests (unit, in-process, two-process conformance over TCP, QUIC, UCX tcp/shared memory and libfabric tcp;ofi_rxm)"
# Every failing test binary is reported, not only the first.
cargo test --workspace --all-features --locked --no-fail-fast
start_background wheel nice -n 19 bindings/python/build.sh --features ucx
start_background fuzz-build nice -n 19 ci/fuzz.sh --build-only

# Needs root and network namespaces (fails loudly without them); about a minute. Without netem,
# scenario 6 degrades the link with nftables loss and a tbf rate instead (its NOTE line says so).
# pd-chaos has no integration test, so the test build above did not link its binary; under the
# test profile it reuses that build's libraries (seconds, where the dev profile rebuilt them).
step "chaos: a cluster in network namespaces under kill -9, partition, coordinator restart, disconnect storm, lossy link"
cargo build --workspace --all-features --locked --profile test --bin pd-chaos
if [ "$(id -u)" = 0 ]; then target/debug/pd-chaos run --log-dir target/pd-chaos
else sudo target/debug/pd-chaos run --log-dir target/pd-chaos; fi

# The test build above made pdbench, pd-sim and the daemons in target/debug.
step "aiperf (PyPI, installed once into the cache) against pdbench cluster --serve: streamed requests, some cancelled"
await_background aiperf
ci/aiperf/check.sh

# The test build above made the three daemons in target/debug.
step "example deployment: examples/local started from its config files, requests and the API checked"
BIN_DIR=target/debug examples/local/run.sh --smoke

step "observability: a real Prometheus scrapes examples/local with examples/observability's config; every dashboard expression returns data"
BIN_DIR=target/debug examples/observability/check.sh

step "real vLLM (CPU): installed once into the cache, then the end-to-end suite"
await_background vllm
vllm_venv=$last_line
# vLLM's own ZmqEventPublisher against the coordinator, bound and connecting (collector mode).
PD_VLLM_VENV="$vllm_venv" cargo test --workspace --all-features --locked --test kv_collector -- vllm_publisher
step "Python wheel pd-xfer: built from source with UCX, its tests inside the real-vLLM venv (torch, numpy, nixl)"
await_background wheel
xfer_site=$last_line
PYTHONPATH="$xfer_site" UCX_NET_DEVICES=lo "$vllm_venv/bin/python" -m pytest -q -rs -p no:cacheprovider \
  -W ignore::DeprecationWarning bindings/python/tests

# t4 (lease expiry with xfer's agents, then a late read refused under its revoked grant), t5 (a NIXL prefill with an xfer decode)
# and t6 (a decode without the cluster's certificate) are the XferConnector run's.
PD_VLLM_VENV="$vllm_venv" cargo test --workspace --all-features --locked --test vllm -- --test-threads 1 --nocapture \
  --skip t4_ --skip t5_ --skip t6_

step "real vLLM with XferConnector (pd_xfer) on both engines: the same suite, KV over xfer's TCP backend with mutual TLS"
# PD_XFER_MUTUAL_TLS=1: the suite makes a cluster CA and gives every engine PD_XFER_TCP_PARAMS with its certificate.
PD_VLLM_VENV="$vllm_venv" PD_VLLM_CONNECTOR=xfer PD_XFER_SITE="$xfer_site" PD_XFER_BACKEND=TCP PD_XFER_MUTUAL_TLS=1 \
  cargo test --workspace --all-features --locked --test vllm -- --test-threads 1 --nocapture

step "real vLLM with XferConnector over xfer's UCX backend: P/D by hand and through the sidecar"
PD_VLLM_VENV="$vllm_venv" PD_VLLM_CONNECTOR=xfer PD_XFER_SITE="$xfer_site" PD_XFER_BACKEND=UCX \
  cargo test --workspace --all-features --locked --test vllm -- --test-threads 1 --nocapture t0_ t1_

step "real vLLM with XferConnector over xfer's TCP backend in plain text (the engines' default): P/D by hand"
PD_VLLM_VENV="$vllm_venv" PD_VLLM_CONNECTOR=xfer PD_XFER_SITE="$xfer_site" PD_XFER_BACKEND=TCP \
  cargo test --workspace --all-features --locked --test vllm -- --test-threads 1 --nocapture t0_

step "real SGLang (CPU): installed once into the cache, then the end-to-end suite (2 prefills, a decode and a plain server over Mooncake TCP)"
await_background sglang
sglang_venv=$last_line
PD_SGLANG_VENV="$sglang_venv" cargo test --workspace --all-features --locked --test sglang -- --test-threads 1 --nocapture

step "real SGLang with its KV over xfer: SGLang's own NIXL transfer backend with pd_xfer.nixl as NIXL (TCP backend), the same suite"
PD_SGLANG_VENV="$sglang_venv" PD_SGLANG_TRANSFER=xfer PD_XFER_SITE="$xfer_site" PD_XFER_BACKEND=TCP \
  cargo test --workspace --all-features --locked --test sglang -- --test-threads 1 --nocapture

step "SGLang's HiCache NIXL storage, its own code, storing and loading real host KV pools through pd_xfer (POSIX, files by path)"
PD_SGLANG_VENV="$sglang_venv" PYTHONPATH="$xfer_site" "$vllm_venv/bin/python" -m pytest -q -rs -p no:cacheprovider \
  -W ignore::DeprecationWarning bindings/python/tests/test_sglang_hicache.py

# The test build above made target/debug/xferbench (with UCX).
step "UCX benchmark smoke run (consistency-checked, shared memory)"
target/debug/xferbench --backend ucx --params tls=posix+cma+self --op both --block-sizes 64K,1M \
  --iters 20 --warmup 2 --check --no-progress

# The build above links Debian's UCX 1.13; Python environments on GPU machines install newer ones.
step "UCX conformance again with the newest UCX release (PyPI libucx-cu13, loaded in place of Debian's 1.13)"
LD_LIBRARY_PATH="$(ci/ucx-latest.sh)" cargo test --workspace --all-features --locked --test ucx

step "benchmark smoke run (consistency-checked, two processes)"
target/debug/xferbench --backend tcp --compare --op both --block-sizes 64K,1M --iters 20 --warmup 2 \
  --check --no-progress

step "transfer comparison against the peers (smoke: 64K, one run)"
peers_out=$(mktemp -d)
SIZES=64K REPEAT=1 OUT=$peers_out XFERBENCH=target/debug/xferbench bench/peers/compare.sh >/dev/null
grep -q '| READ | 64K |' "$peers_out/peers.md" && test -s "$peers_out/peers.png"
cat "$peers_out/peers.md"
rm -rf "$peers_out"

step "fuzzing: every fuzz target (each decoder of bytes from the network) for 10 s from its seeds, two at a time, stable toolchain"
await_background fuzz-build
ci/fuzz.sh 10

echo
echo "all checks passed"
