#!/usr/bin/env bash
# Runs every fuzz target in fuzz/ for a while: `ci/fuzz.sh [seconds per target]` (default 20).
#
# The targets are built the way cargo-fuzz builds them (libFuzzer, SanitizerCoverage), but on the
# stable toolchain and without cargo-fuzz itself: coverage instrumentation needs no unstable flag,
# and the address sanitizer (the one flag that would) adds little to safe Rust. A crash, a
# failed assertion or a timeout fails the script; its input is left in fuzz/artifacts/<target>/.
# Corpora grow in fuzz/corpus/<target>/ (ignored by git), so repeated runs go deeper.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"

seconds="${1:-20}"
export CARGO_TARGET_DIR="${FUZZ_TARGET_DIR:-$PWD/target}"
export RUSTFLAGS="--cfg fuzzing -Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares -Cdebug-assertions -Coverflow-checks"
# The workspace's lock file pins every crate the two share (fuzz/Cargo.lock is not committed);
# cargo adds only the fuzzing crates to it.
cp ../Cargo.lock Cargo.lock
# An explicit target keeps RUSTFLAGS off build scripts and proc macros (as cargo-fuzz does).
host=$(rustc -vV | sed -n 's/^host: //p')
cargo build --release --bins --target "$host"

targets=$(sed -n 's/^name = "\(.*\)"/\1/p' Cargo.toml | grep -v '^xfer-fuzz$')
printf '| target | runs | seconds | result |\n|---|---|---|---|\n' >"$CARGO_TARGET_DIR/fuzz-summary.md"
failed=0
for target in $targets; do
  mkdir -p "corpus/$target" "artifacts/$target"
  log="$CARGO_TARGET_DIR/fuzz-$target.log"
  if "$CARGO_TARGET_DIR/$host/release/$target" "corpus/$target" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
      -artifact_prefix="artifacts/$target/" -print_final_stats=1 >"$log" 2>&1; then
    result=ok
  else
    result=FAILED
    failed=1
    tail -n 40 "$log"
  fi
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n1)
  printf '| %s | %s | %s | %s |\n' "$target" "${runs:-?}" "$seconds" "$result" >>"$CARGO_TARGET_DIR/fuzz-summary.md"
done
cat "$CARGO_TARGET_DIR/fuzz-summary.md"
exit "$failed"
