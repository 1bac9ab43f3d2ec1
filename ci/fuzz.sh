#!/usr/bin/env bash
# Runs every fuzz target in fuzz/ for a while: `ci/fuzz.sh [--build-only] [seconds per target]` (default 20);
# the test command runs 10 s each, `ci/fuzz.sh 600` is the longer run (fuzz/README.md).
#
# The targets are built the way cargo-fuzz builds them (libFuzzer, SanitizerCoverage), but on the
# stable toolchain and without cargo-fuzz itself: coverage instrumentation needs no unstable flag,
# and the address sanitizer (the one flag that would) adds little to safe Rust. A crash, a
# failed assertion or a timeout fails the script; its input is left in fuzz/artifacts/<target>/.
# Each target starts from its committed seeds (fuzz/seeds/<target>/, written by the encoders:
# fuzz/seed-gen) and from its corpus in fuzz/corpus/<target>/ (ignored by git), which grows, so
# repeated runs go deeper. FUZZ_JOBS targets run at once (default: one per core, at most 4).
set -euo pipefail
cd "$(dirname "$0")/../fuzz"

# `ci/fuzz.sh --build-only` builds the targets and stops (the test command builds them in the
# background while the engine suites run, then runs them at its end).
build_only=0
if [ "${1:-}" = --build-only ]; then
  build_only=1
  shift
fi
seconds="${1:-20}"
jobs="${FUZZ_JOBS:-$(nproc)}"
jobs=$((jobs > 4 ? 4 : jobs < 1 ? 1 : jobs))
export CARGO_TARGET_DIR="${FUZZ_TARGET_DIR:-$PWD/target}"
export RUSTFLAGS="--cfg fuzzing -Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares -Cdebug-assertions -Coverflow-checks"
# The workspace's lock file pins every crate the two share (fuzz/Cargo.lock is not committed);
# cargo adds only the fuzzing crates to it.
cp ../Cargo.lock Cargo.lock
# An explicit target keeps RUSTFLAGS off build scripts and proc macros (as cargo-fuzz does).
host=$(rustc -vV | sed -n 's/^host: //p')
build_start=$SECONDS
cargo build --release --bins --target "$host"
echo "fuzz build: $((SECONDS - build_start)) s"
[ "$build_only" = 0 ] || exit 0

targets=$(sed -n 's/^name = "\(.*\)"/\1/p' Cargo.toml | grep -v '^xfer-fuzz$')
for target in $targets; do
  if [ -z "$(ls -A "seeds/$target" 2>/dev/null)" ]; then
    echo "fuzz/seeds/$target is missing or empty: every target starts from seeds (fuzz/seed-gen writes them)" >&2
    exit 1
  fi
done

results=$(mktemp -d)
trap 'rm -rf "$results"' EXIT
# Inputs libFuzzer kept of a target's crashes, timeouts and out-of-memory runs so far.
crashes() {
  find "artifacts/$1" -maxdepth 1 -type f \( -name 'crash-*' -o -name 'timeout-*' -o -name 'oom-*' -o -name 'leak-*' \) |
    wc -l
}
# One target's run; its summary row goes to $results/<target>.
fuzz_one() {
  local target=$1 log="$CARGO_TARGET_DIR/fuzz-$target.log" result=ok before after
  mkdir -p "corpus/$target" "artifacts/$target"
  before=$(crashes "$target")
  if ! "$CARGO_TARGET_DIR/$host/release/$target" "corpus/$target" "seeds/$target" -max_total_time="$seconds" \
      -timeout=10 -rss_limit_mb=2048 -artifact_prefix="artifacts/$target/" -print_final_stats=1 >"$log" 2>&1; then
    result=FAILED
  fi
  after=$(crashes "$target")
  local runs per_second corpus
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n1)
  per_second=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -n1)
  corpus=$(ls "corpus/$target" | wc -l)
  printf '| %s | %s | %s | %s | %s | %s | %s |\n' "$target" "${runs:-?}" "${per_second:-?}" "$corpus" "$seconds" \
    "$((after - before))" "$result" >"$results/$target"
}

running=0
for target in $targets; do
  if [ "$running" -ge "$jobs" ]; then
    wait -n || true
    running=$((running - 1))
  fi
  fuzz_one "$target" &
  running=$((running + 1))
done
wait

summary="$CARGO_TARGET_DIR/fuzz-summary.md"
{
  printf '| target | runs | runs/s | corpus | seconds | crashes | result |\n|---|---|---|---|---|---|---|\n'
  for target in $targets; do cat "$results/$target"; done
} >"$summary"
failed=0
for target in $targets; do
  if grep -q '| FAILED |$' "$results/$target"; then
    failed=1
    echo "==== $target failed; the end of its log ($CARGO_TARGET_DIR/fuzz-$target.log):"
    tail -n 40 "$CARGO_TARGET_DIR/fuzz-$target.log"
  fi
done
echo
cat "$summary"
exit "$failed"
