#!/usr/bin/env bash
# The encrypted data path against the plain one: the TCP backend with tls=on against tls=off,
# READ and WRITE, at SIZES (16M by default): ROUNDS rounds, each running xferbench both ways (the
# order alternating between rounds), so both see the same machine. Checks the bar (tls=on at least
# 0.5 x tls=off at 16 MiB). Prints the report and writes it, with the machine line
# (bench/machine.sh), to $OUT/tls.md and the rows to $OUT/tls.json (OUT=bench/results by default;
# then bench/README.md's block is updated too, bench/update-readme.sh).
#
#   bench/tls-compare.sh                      # 5 rounds at 16M
#   ROUNDS=3 SIZES=1M,16M OUT=/tmp/tls bench/tls-compare.sh
set -euo pipefail
cd "$(dirname "$0")/.."

load_start=$(bench/machine.sh --load)
ROUNDS=${ROUNDS:-5}
SIZES=${SIZES:-16M}
OUT=${OUT:-bench/results}
XFERBENCH=${XFERBENCH:-target/release/xferbench}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
if [ "$XFERBENCH" = target/release/xferbench ]; then
  cargo build --quiet --release -p xfer-bench
fi
mkdir -p "$OUT"

# Each run is bounded: about 1 GiB per case.
for round in $(seq 1 "$ROUNDS"); do
  if [ $((round % 2)) = 1 ]; then order="off on"; else order="on off"; fi
  for tls in $order; do
    echo "== round $round: xferbench --backend tcp --params tls=$tls --op both --block-sizes $SIZES" >&2
    timeout 600 "$XFERBENCH" --backend tcp --params "tls=$tls" --op both --block-sizes "$SIZES" --warmup 3 \
      --no-progress --json "$WORK/$tls-$round.json" >&2
  done
done

machine=$(bench/machine.sh bench/tls-compare.sh "$load_start")
python3 - "$WORK" "$ROUNDS" "$OUT" "$machine" <<'PY'
import json
import statistics
import sys

work, rounds, out, machine = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
rows = []
# gbps[(tls, op, block)] = one figure per round
gbps = {}
for r in range(1, rounds + 1):
    for tls in ("off", "on"):
        for row in json.load(open(f"{work}/{tls}-{r}.json")):
            row["round"] = r
            row["tls"] = tls
            rows.append(row)
            gbps.setdefault((tls, row["op"], row["block_size"]), []).append(row["gbps"])

lines = [
    machine,
    "",
    f"Two processes on loopback, one request in flight, about 1 GiB per case; {rounds} rounds, each running",
    "xferbench with `tls=off` and `tls=on` (order alternating between rounds). GB/s = 10^9 bytes/s, medians",
    "over the rounds; \"ratio\" = the median of the rounds' on ÷ off ratios. Bar: ratio ≥ 0.5 at 16 MiB.",
    "",
    "| op | block | tls=off GB/s | tls=on GB/s | ratio | bar | per-round on ÷ off |",
    "|---|---|---|---|---|---|---|",
]
blocks = sorted({key[2] for key in gbps})
for op in ("read", "write"):
    for block in blocks:
        plain, sealed = gbps.get(("off", op, block)), gbps.get(("on", op, block))
        if not plain or not sealed:
            continue
        ratios = [s / p for p, s in zip(plain, sealed) if p > 0]
        ratio = statistics.median(ratios)
        bar = ("met" if ratio >= 0.5 else "**missed**") if block == 16 << 20 else "—"
        size = f"{block >> 20} MiB" if block >= 1 << 20 else f"{block >> 10} KiB"
        lines.append(
            f"| {op.upper()} | {size} | {statistics.median(plain):.3f} | {statistics.median(sealed):.3f} "
            f"| {ratio:.2f} | {bar} | {' '.join(f'{x:.2f}' for x in ratios)} |"
        )
report = "\n".join(lines) + "\n"
with open(f"{out}/tls.md", "w") as f:
    f.write(report)
with open(f"{out}/tls.json", "w") as f:
    json.dump(rows, f, indent=1)
print(report)
PY
echo "wrote $OUT/tls.md $OUT/tls.json" >&2
if [ "$OUT" = bench/results ]; then bench/update-readme.sh; fi
