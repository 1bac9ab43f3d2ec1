#!/usr/bin/env bash
# What revocable grants cost the TCP backend on the KV-shaped request (2048 scattered 16 KiB
# blocks, and one contiguous 32 MiB request beside it), READ and WRITE: ROUNDS rounds, each
# running xferbench without and with --grants (the order alternating between rounds), so both
# see the same machine. Checks the bar (grants cost ≤ 3 % of GB/s on the scattered case).
# Prints the report and writes it, with the machine line (bench/machine.sh), to $OUT/grants.md and
# the rows to $OUT/grants.json (OUT=bench/results by default; then bench/README.md's block is
# updated too, bench/update-readme.sh).
#
#   bench/grants-compare.sh                    # 5 rounds
#   ROUNDS=9 OUT=/tmp/grants bench/grants-compare.sh
set -euo pipefail
cd "$(dirname "$0")/.."

load_start=$(bench/machine.sh --load)
ROUNDS=${ROUNDS:-5}
OUT=${OUT:-bench/results}
XFERBENCH=${XFERBENCH:-target/release/xferbench}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
if [ "$XFERBENCH" = target/release/xferbench ]; then
  cargo build --quiet --release -p xfer-bench
fi
mkdir -p "$OUT"

# Each run is bounded: about 1 GiB per case, 4 cases.
for round in $(seq 1 "$ROUNDS"); do
  if [ $((round % 2)) = 1 ]; then order="plain grants"; else order="grants plain"; fi
  for kind in $order; do
    flag=()
    [ "$kind" = grants ] && flag=(--grants)
    echo "== round $round: xferbench --backend tcp --kv-shape --op both ${flag[*]}" >&2
    timeout 600 "$XFERBENCH" --backend tcp --kv-shape --op both --warmup 3 --no-progress "${flag[@]}" \
      --json "$WORK/$kind-$round.json" >&2
  done
done

machine=$(bench/machine.sh bench/grants-compare.sh "$load_start")
python3 - "$WORK" "$ROUNDS" "$OUT" "$machine" <<'EOF'
import json
import statistics
import sys

work, rounds, out, machine = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
rows = []
# gbps[(kind, op, scatter)] = one figure per round
gbps = {}
for r in range(1, rounds + 1):
    for kind in ("plain", "grants"):
        for row in json.load(open(f"{work}/{kind}-{r}.json")):
            row["round"] = r
            rows.append(row)
            gbps.setdefault((kind, row["op"], row["scatter"]), []).append(row["gbps"])

lines = [
    machine,
    "",
    f"Two processes on loopback, one request in flight, about 1 GiB per case; {rounds} rounds, each running",
    "xferbench without and with `--grants` (order alternating between rounds). With grants every descriptor",
    "names a grant the target checks (granted peer, inside a granted range, live, not expired) and holds",
    "against revocation while it touches the memory. GB/s = 10^9 bytes/s, medians over the rounds;",
    "\"cost\" = 1 − the median of the rounds' with ÷ without ratios. Bar: cost ≤ 3 % on the scattered case.",
    "",
    "| op | request | without GB/s | with grants GB/s | cost | bar | per-round with ÷ without |",
    "|---|---|---|---|---|---|---|",
]
for op in ("read", "write"):
    for scatter, label in ((True, "16K × 2048 scattered"), (False, "32M × 1 contiguous")):
        plain, granted = gbps.get(("plain", op, scatter)), gbps.get(("grants", op, scatter))
        if not plain or not granted:
            continue
        ratios = [g / p for p, g in zip(plain, granted) if p > 0]
        cost = 1 - statistics.median(ratios)
        bar = ("met" if cost <= 0.03 else "**missed**") if scatter else "—"
        lines.append(
            f"| {op.upper()} | {label} | {statistics.median(plain):.3f} | {statistics.median(granted):.3f} "
            f"| {cost * 100:.1f} % | {bar} | {' '.join(f'{x:.3f}' for x in ratios)} |"
        )
report = "\n".join(lines) + "\n"
with open(f"{out}/grants.md", "w") as f:
    f.write(report)
with open(f"{out}/grants.json", "w") as f:
    json.dump(rows, f, indent=1)
print(report)
EOF
echo "wrote $OUT/grants.md $OUT/grants.json" >&2
if [ "$OUT" = bench/results ]; then bench/update-readme.sh; fi
