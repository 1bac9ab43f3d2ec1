#!/usr/bin/env bash
# Our prefix index against dynamo-kv-router's indexers (issue 23, part 3). Builds
# coordinator/dynamo-compare in release (its own workspace and Cargo.lock, so Dynamo's
# dependencies stay out of the main build and CI), runs it on coordbench's workload and on the
# Mooncake trace, writes coordinator/results/dynamo.{json,md} and copies the tables into
# coordinator/BENCH.md. The program exits non-zero if any two indexes answer a lookup differently.
#
#   coordinator/dynamo-compare.sh [PROGRAM ARGS...]     e.g. --blocks 200000 --lookups 20000
#   TRACE=path/to/conversation_trace.jsonl              (default: ../shared/traces/ beside the repo)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
trace=${TRACE:-$here/../../shared/traces/conversation_trace.jsonl}
if [ ! -f "$trace" ]; then
    echo "dynamo-compare: no Mooncake trace at $trace (set TRACE=...)" >&2
    exit 1
fi
start=$(date +%s)
CARGO_INCREMENTAL=0 cargo build --release --locked --manifest-path "$here/dynamo-compare/Cargo.toml"
echo "dynamo-compare: release build took $(($(date +%s) - start)) s" >&2
"$here/dynamo-compare/target/release/dynamo-compare" --trace "$trace" --out "$here/results" "$@"
cd "$here"
../bench/update-readme.sh BENCH.md results
