#!/usr/bin/env bash
# xferbench's TCP backend against the raw-TCP baseline between the same two processes (see
# bench/README.md, "What is measured"), READ and WRITE at SIZES, and the KV-shaped request
# (2048 scattered 16 KiB blocks) against one contiguous 32 MiB request. Checks the perf bars.
# Prints the report and writes it, with the machine line (bench/machine.sh), to $OUT/tcp.md, the
# rows to $OUT/tcp.json and the plot to $OUT/tcp.svg and $OUT/tcp.png (OUT=bench/results by
# default; then bench/README.md's block is updated too, bench/update-readme.sh).
#
#   bench/tcp-compare.sh                       # 64K 1M 16M, median of 3 runs each
#   SIZES="64K 1M" REPEAT=5 OUT=/tmp/tcp bench/tcp-compare.sh
set -euo pipefail
cd "$(dirname "$0")/.."

load_start=$(bench/machine.sh --load)
SIZES=${SIZES:-"64K 1M 16M"}
REPEAT=${REPEAT:-3}
OUT=${OUT:-bench/results}
XFERBENCH=${XFERBENCH:-target/release/xferbench}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
if [ "$XFERBENCH" = target/release/xferbench ]; then
  # Up to date with the checkout; with UCX when its library is there (the features ucx-compare uses,
  # so the two scripts share one build).
  features=()
  pkg-config --exists ucx 2>/dev/null && features=(--features ucx)
  cargo build --quiet --release -p xfer-bench "${features[@]}"
fi
mkdir -p "$OUT"
sizes_csv=$(echo "$SIZES" | tr ' ' ',')

# Every run is bounded: about 1 GiB per case and engine, REPEAT times, for SIZES and kv-shape.
echo "== xferbench --backend tcp --compare --op both --block-sizes $sizes_csv --repeat $REPEAT" >&2
timeout 900 "$XFERBENCH" --backend tcp --compare --op both --block-sizes "$sizes_csv" --repeat "$REPEAT" \
  --warmup 3 --no-progress --json "$WORK/compare.json" >&2
echo "== xferbench --backend tcp --kv-shape --op both --repeat $REPEAT" >&2
timeout 900 "$XFERBENCH" --backend tcp --kv-shape --op both --repeat "$REPEAT" --warmup 3 --no-progress \
  --json "$WORK/kv.json" >&2

machine=$(bench/machine.sh bench/tcp-compare.sh "$load_start")
python3 - "$WORK/compare.json" "$WORK/kv.json" "$OUT" "$machine" <<'EOF'
import json
import sys

compare_path, kv_path, out, machine = sys.argv[1:]
compare, kv = (json.load(open(p)) for p in (compare_path, kv_path))


def size(n):
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def bar(ok):
    return "met" if ok else "**missed**"


by = {(r["backend"], r["op"], r["block_size"]): r for r in compare}
repeat = max(r["repeat"] for r in compare + kv)
lines = [
    machine,
    "",
    f"Two processes on loopback, placement left to the scheduler; one request of one block in flight;",
    f"about 1 GiB per case and engine; {repeat} run(s) per case, engines alternating, the median run kept. GB/s = 10^9 bytes/s,",
    "latency per request (post to completion). Bars: ours ÷ raw TCP ≥ 0.9 at 1M and 16M, ≥ 0.6 at 64K.",
    "",
    "| op | block | ours GB/s | raw TCP GB/s | ours ÷ raw | bar | ours p50 µs | ours p99 µs | raw p50 µs | raw p99 µs |",
    "|---|---|---|---|---|---|---|---|---|---|",
]
for op in ("read", "write"):
    for block in sorted({r["block_size"] for r in compare}):
        ours, raw = by.get(("tcp", op, block)), by.get(("raw-tcp", op, block))
        if not ours or not raw:
            continue
        ratio = ours["gbps"] / raw["gbps"] if raw["gbps"] > 0 else 0.0
        need = 0.6 if block < 1 << 20 else 0.9
        lines.append(
            f"| {op.upper()} | {size(block)} | {ours['gbps']:.3f} | {raw['gbps']:.3f} | {ratio:.2f} | {bar(ratio >= need)} "
            f"| {ours['p50_us']:.1f} | {ours['p99_us']:.1f} | {raw['p50_us']:.1f} | {raw['p99_us']:.1f} |"
        )
lines += [
    "",
    "KV-shaped request: 2048 blocks of 16 KiB at scattered slots against one contiguous 32 MiB request"
    " (the same bytes). Bar: scattered ÷ contiguous ≥ 0.8.",
    "",
    "| op | scattered 16K × 2048 GB/s | contiguous 32M GB/s | scattered ÷ contiguous | bar | scattered p50 µs | contiguous p50 µs |",
    "|---|---|---|---|---|---|---|",
]
for op in ("read", "write"):
    rows = [r for r in kv if r["op"] == op and r["backend"] == "tcp"]
    scattered = next((r for r in rows if r["scatter"]), None)
    contiguous = next((r for r in rows if not r["scatter"]), None)
    if not scattered or not contiguous:
        continue
    ratio = scattered["gbps"] / contiguous["gbps"] if contiguous["gbps"] > 0 else 0.0
    lines.append(
        f"| {op.upper()} | {scattered['gbps']:.3f} | {contiguous['gbps']:.3f} | {ratio:.2f} | {bar(ratio >= 0.8)} "
        f"| {scattered['p50_us']:.1f} | {contiguous['p50_us']:.1f} |"
    )
lines += ["", "![GB/s by block size, ours and raw TCP](tcp.svg)", ""]
report = "\n".join(lines)
with open(f"{out}/tcp.md", "w") as f:
    f.write(report)
with open(f"{out}/tcp.json", "w") as f:
    json.dump(compare + kv, f, indent=1)
print(report)
EOF
"$XFERBENCH" --rows "$WORK/compare.json" --plot "$OUT/tcp" >/dev/null
echo "wrote $OUT/tcp.md $OUT/tcp.json $OUT/tcp.svg $OUT/tcp.png" >&2
if [ "$OUT" = bench/results ]; then bench/update-readme.sh; fi
