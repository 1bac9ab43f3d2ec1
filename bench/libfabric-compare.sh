#!/usr/bin/env bash
# The libfabric backend over `tcp;ofi_rxm` on loopback against the raw-TCP baseline, READ and
# WRITE at SIZES, for each lane count in LANES (the backend's `lanes` parameter: endpoints per
# domain), and for each rxm mode in PROGRESS, set in both processes' environment (`manual`:
# FI_OFI_RXM_ENABLE_PASSTHRU=0, rxm's own protocol over tcp's connected endpoints (the default), driven by
# the backend's engine threads; `auto`: the same with FI_OFI_RXM_DATA_AUTO_PROGRESS=1, rxm's
# own progress thread drives it; `passthru`: FI_OFI_RXM_ENABLE_PASSTHRU=1, rxm hands RDM calls
# to the tcp provider's own RDM endpoint): ROUNDS rounds, each
# running `xferbench --backend libfabric --compare` once per lane count and mode (the order
# reversed every other round), so that every libfabric
# figure has a raw-TCP figure from the same xferbench run beside it (xferbench alternates the
# two per case). Reports the median over the rounds and the spread (lowest and highest) of
# ours ÷ raw TCP, and checks the bar (≥ 0.7 at 1M and 16M). Also runs libfabric's own
# `fi_pingpong -e rdm` (Debian: libfabric-bin) at SIZES each round, when it is installed.
#
# Prints the report and writes it, with the machine line (bench/machine.sh), to
# $OUT/libfabric.md and the rows to $OUT/libfabric.json (OUT=bench/results by default; then
# bench/README.md's block is updated too, bench/update-readme.sh). LOCK=FILE holds flock(1) on
# FILE around each xferbench and fi_pingpong run, so benchmarks of others sharing the machine
# and taking the same lock do not overlap with these.
#
#   bench/libfabric-compare.sh                # 1M 16M, lanes 1 2, modes manual passthru, 5 rounds
#   ROUNDS=3 LANES="1 4" PROGRESS="manual auto" SIZES="1M" OUT=/tmp/lf bench/libfabric-compare.sh
#   LOCK=/work/bench.lock LANES=1 bench/libfabric-compare.sh
set -euo pipefail
cd "$(dirname "$0")/.."

load_start=$(bench/machine.sh --load)
ROUNDS=${ROUNDS:-5}
SIZES=${SIZES:-"1M 16M"}
LANES=${LANES:-"1 2"}
PROGRESS=${PROGRESS:-"manual passthru"}
LOCK=${LOCK:-}
OUT=${OUT:-bench/results}
XFERBENCH=${XFERBENCH:-target/release/xferbench}
PARAMS=${PARAMS:-"provider=tcp;ofi_rxm,domain=lo"}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
pkg-config --exists libfabric 2>/dev/null || { echo "libfabric development files not found (Debian: apt-get install libfabric-dev)" >&2; exit 1; }
if [ "$XFERBENCH" = target/release/xferbench ]; then
  cargo build --quiet --release -p xfer-bench --features libfabric
fi
mkdir -p "$OUT"
sizes_csv=$(echo "$SIZES" | tr ' ' ',')
configs=$(for progress in $PROGRESS; do for lanes in $LANES; do echo "$progress:$lanes"; done; done)
reversed=$(echo "$configs" | tac)

# Runs its arguments holding the LOCK file, when one is given.
locked() {
  if [ -n "$LOCK" ]; then flock "$LOCK" "$@"; else "$@"; fi
}

for progress in $PROGRESS; do
  case $progress in manual | auto | passthru) ;; *) echo "unknown PROGRESS mode $progress (manual, auto, passthru)" >&2; exit 2 ;; esac
done

bytes() {
  local n=${1%[KMG]}
  case $1 in *K) echo $((n << 10)) ;; *M) echo $((n << 20)) ;; *G) echo $((n << 30)) ;; *) echo "$1" ;; esac
}

# fi_pingpong's RDM ping-pong (send/receive, not RMA) between two processes on lo; prints
# "SIZE MB/sec" from its result line. Bounded: a few seconds per size.
pingpong() {
  local size=$1 port=$2 iters
  iters=$(($(bytes "$size") >= 16 << 20 ? 10 : 50))
  timeout 60 fi_pingpong -p "tcp;ofi_rxm" -e rdm -d lo -S "$(bytes "$size")" -I "$iters" -B "$port" >/dev/null 2>&1 &
  local server=$!
  sleep 0.5
  timeout 60 fi_pingpong -p "tcp;ofi_rxm" -e rdm -d lo -S "$(bytes "$size")" -I "$iters" -P "$port" 127.0.0.1 \
    | awk -v size="$(bytes "$size")" 'NR > 1 && NF >= 6 { print size, $6 }'
  wait "$server" || true
}
export -f pingpong bytes

port=47600
for round in $(seq 1 "$ROUNDS"); do
  if [ $((round % 2)) = 1 ]; then order=$configs; else order=$reversed; fi
  for config in $order; do
    progress=${config%:*} lanes=${config#*:}
    auto=0 passthru=0
    [ "$progress" = auto ] && auto=1
    [ "$progress" = passthru ] && passthru=1
    env="FI_OFI_RXM_DATA_AUTO_PROGRESS=$auto FI_OFI_RXM_ENABLE_PASSTHRU=$passthru"
    echo "== round $round: $env xferbench --backend libfabric --params '$PARAMS,lanes=$lanes' --compare --op both --block-sizes $sizes_csv" >&2
    locked env $env timeout 600 "$XFERBENCH" --backend libfabric --params "$PARAMS,lanes=$lanes" \
      --compare --op both --block-sizes "$sizes_csv" --warmup 3 --no-progress --json "$WORK/$progress-$lanes-$round.json" >&2
  done
  if command -v fi_pingpong >/dev/null; then
    for size in $SIZES; do
      port=$((port + 1))
      echo "== round $round: fi_pingpong -p 'tcp;ofi_rxm' -e rdm -S $size" >&2
      locked bash -c 'pingpong "$@"' pingpong "$size" "$port" >>"$WORK/pingpong-$round.txt" || echo "fi_pingpong at $size failed" >&2
    done
  fi
done
command -v fi_pingpong >/dev/null || echo "fi_pingpong not found (Debian: apt-get install libfabric-bin): its column is left empty" >&2

machine=$(bench/machine.sh bench/libfabric-compare.sh "$load_start")
python3 - "$WORK" "$ROUNDS" "$LANES" "$PROGRESS" "$OUT" "$machine" "$PARAMS" <<'PY'
import glob
import json
import os
import statistics
import sys

work, rounds, lanes_list, progress_list, out, machine, params = sys.argv[1:]
progress_list = progress_list.split()
rounds = int(rounds)
lanes_list = [int(n) for n in lanes_list.split()]
BAR = 0.7


def size(n):
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


runs = []  # every row of every xferbench run, with its round, progress mode and lane count
for progress in progress_list:
    for lanes in lanes_list:
        for r in range(1, rounds + 1):
            for row in json.load(open(f"{work}/{progress}-{lanes}-{r}.json")):
                runs.append(dict(row, round=r, progress=progress, lanes=lanes))
pingpong = {}  # block size -> MB/s per round
for path in sorted(glob.glob(f"{work}/pingpong-*.txt")):
    for line in open(path):
        block, mbps = line.split()
        pingpong.setdefault(int(block), []).append(float(mbps) / 1000)

summary = []
blocks = sorted({r["block_size"] for r in runs})
for op in ("read", "write"):
    for block in blocks:
        for progress, lanes in [(p, n) for p in progress_list for n in lanes_list]:
            ratios, ours, raw, p50 = [], [], [], []
            for r in range(1, rounds + 1):
                case = (op, block, progress, lanes, r)
                pair = {x["backend"]: x for x in runs if (x["op"], x["block_size"], x["progress"], x["lanes"], x["round"]) == case}
                if "libfabric" in pair and "raw-tcp" in pair and pair["raw-tcp"]["gbps"] > 0:
                    ours.append(pair["libfabric"]["gbps"])
                    raw.append(pair["raw-tcp"]["gbps"])
                    p50.append(pair["libfabric"]["p50_us"])
                    ratios.append(ours[-1] / raw[-1])
            if not ratios:
                continue
            pp = pingpong.get(block, [])
            summary.append({
                "op": op, "block_size": block, "progress": progress, "lanes": lanes, "rounds": len(ratios),
                "gbps": statistics.median(ours), "raw_gbps": statistics.median(raw),
                "p50_us": statistics.median(p50),
                "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
                "pingpong_gbps": statistics.median(pp) if pp else None,
            })

lines = [
    machine,
    "",
    f"Two processes on loopback, `{params}` with `lanes=N` (endpoints per domain); rxm mode `manual` (rxm's protocol,",
    "`FI_OFI_RXM_ENABLE_PASSTHRU=0`, the backend's default), `auto` (the same with `FI_OFI_RXM_DATA_AUTO_PROGRESS=1`) or `passthru`",
    "(`FI_OFI_RXM_ENABLE_PASSTHRU=1`); one request of one block in flight, about 1 GiB per",
    "case and engine. Each round runs xferbench once per lane count and progress mode, the",
    "raw-TCP baseline in the same run; GB/s is the median over the rounds (10^9 bytes/s), ours ÷ raw the",
    "median of the rounds' ratios with the lowest and highest. fi_pingpong: `fi_pingpong -p 'tcp;ofi_rxm' -e rdm`",
    f"(send/receive ping-pong, same sizes), median MB/s ÷ 1000. Bar: ours ÷ raw TCP ≥ {BAR} at 1M and 16M.",
    "",
    "| op | block | rxm mode | lanes | ours GB/s | raw TCP GB/s | ours ÷ raw (median) | lowest – highest | bar | ours p50 µs | fi_pingpong GB/s | ours ÷ fi_pingpong | rounds |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
]
for s in summary:
    met = "met" if s["ratio_median"] >= BAR else "**missed**"
    pp = s["pingpong_gbps"]
    pp_cells = f"{pp:.3f} | {s['gbps'] / pp:.1f}" if pp else "– | –"
    lines.append(
        f"| {s['op'].upper()} | {size(s['block_size'])} | {s['progress']} | {s['lanes']} | {s['gbps']:.3f} | {s['raw_gbps']:.3f} "
        f"| {s['ratio_median']:.2f} | {s['ratio_min']:.2f} – {s['ratio_max']:.2f} | {met} | {s['p50_us']:.0f} | {pp_cells} | {s['rounds']} |"
    )
lines.append("")
report = "\n".join(lines)
with open(os.path.join(out, "libfabric.md"), "w") as f:
    f.write(report)
with open(os.path.join(out, "libfabric.json"), "w") as f:
    json.dump({"summary": summary, "runs": runs, "pingpong_gbps": {str(k): v for k, v in pingpong.items()}}, f, indent=1)
print(report)
PY
echo "wrote $OUT/libfabric.md $OUT/libfabric.json" >&2
if [ "$OUT" = bench/results ]; then bench/update-readme.sh; fi
