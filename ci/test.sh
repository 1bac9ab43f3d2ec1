#!/usr/bin/env bash
# The README's test command: everything CI checks, on a fresh machine or a developer's.
set -euo pipefail
cd "$(dirname "$0")/.."

export CARGO_TERM_COLOR=never
# Failing tests print a backtrace; the suites bound their own waits.
export RUST_BACKTRACE=1

step() { printf '\n==== %s ====\n' "$*"; }

step "system packages"
ci/install-deps.sh

step "format"
cargo fmt --all -- --check

step "lints"
cargo clippy --workspace --all-targets --locked -- -D warnings

step "tests (unit, in-process, two-process conformance)"
cargo test --workspace --locked

step "benchmark smoke run (consistency-checked, two processes)"
cargo run --quiet --locked -p xfer-bench --bin xferbench -- \
  --backend tcp --compare --op both --block-sizes 64K,1M --iters 20 --warmup 2 --check --no-progress

echo
echo "all checks passed"
