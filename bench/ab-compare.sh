#!/usr/bin/env bash
# A/B comparison of two xferbench configurations on the same machine, for the perf bars that are
# a ratio of two runs. MODE picks the pair and the bar:
#
#   tls     A = the TCP backend with tls=off, B = with tls=on, READ and WRITE at SIZES (16M);
#           bar: B ≥ 0.5 × A at 16 MiB.
#   tls-builds  both sides tls=on at SIZES, no bar: for two builds (XFERBENCH_A, XFERBENCH_B).
#   quic    A = the TCP backend (plain), B = the QUIC backend (TLS 1.3 over UDP), READ and WRITE
#           at SIZES; bar: B ≥ 0.5 × A at 16 MiB. Builds xferbench with --features quic.
#   quic-tls  A = the TCP backend with tls=on, B = the QUIC backend; no bar (which encrypted
#           path is faster). QUIC_PARAMS (k=v,...) go to the QUIC side of both.
#   grants  A = the KV-shaped pair (2048 scattered 16 KiB blocks, one contiguous 32 MiB request)
#           without --grants, B = with --grants; bar: grants cost ≤ 3 % (B ≥ 0.97 × A) scattered.
#
# Each of ROUNDS rounds runs A, B, B, A back to back (512 MiB per case and run at 16M), so each
# B run has an A run beside it and a drift within the round cancels out. A round's ratio is the
# geometric mean of its two adjacent B ÷ A pairs; the report gives the median of the rounds'
# ratios and their spread, which is what survives a busy machine. It is printed and written, with
# the machine line (bench/machine.sh), to $OUT/MODE.md, and the runs' rows to $OUT/MODE.json
# (OUT=bench/results by default; then bench/README.md's block is updated too,
# bench/update-readme.sh). XFERBENCH_A / XFERBENCH_B run two different builds against each other.
#
#   bench/ab-compare.sh tls                      # 8 rounds at 16M
#   ROUNDS=4 SIZES=1M,16M OUT=/tmp/ab bench/ab-compare.sh tls
#   bench/ab-compare.sh grants
#   SIZES=1M,16M bench/ab-compare.sh quic
#   XFERBENCH_A=/tmp/old/xferbench XFERBENCH_B=/tmp/new/xferbench OUT=/tmp/ab bench/ab-compare.sh tls-builds
set -euo pipefail
cd "$(dirname "$0")/.."

mode=${1:?usage: bench/ab-compare.sh tls|tls-builds|quic|quic-tls|grants}
load_start=$(bench/machine.sh --load)
ROUNDS=${ROUNDS:-8}
SIZES=${SIZES:-16M}
OUT=${OUT:-bench/results}
XFERBENCH=${XFERBENCH:-target/release/xferbench}
XFERBENCH_A=${XFERBENCH_A:-$XFERBENCH}
XFERBENCH_B=${XFERBENCH_B:-$XFERBENCH}

case "$mode" in
  tls)
    common=(--backend tcp --op both --block-sizes "$SIZES" --iters 32)
    a_args=(--params tls=off)
    b_args=(--params tls=on)
    ;;
  tls-builds)
    common=(--backend tcp --op both --block-sizes "$SIZES" --iters 32 --params tls=on)
    a_args=()
    b_args=()
    ;;
  quic)
    common=(--op both --block-sizes "$SIZES" --iters 32)
    a_args=(--backend tcp)
    b_args=(--backend quic ${QUIC_PARAMS:+--params "$QUIC_PARAMS"})
    ;;
  quic-tls)
    common=(--op both --block-sizes "$SIZES" --iters 32)
    a_args=(--backend tcp --params tls=on)
    b_args=(--backend quic ${QUIC_PARAMS:+--params "$QUIC_PARAMS"})
    ;;
  grants)
    common=(--backend tcp --kv-shape --op both --iters 16)
    a_args=()
    b_args=(--grants)
    ;;
  *)
    echo "ab-compare: unknown mode '$mode' (tls, tls-builds, quic, quic-tls or grants)" >&2
    exit 2
    ;;
esac

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
if [ "$XFERBENCH_A" = target/release/xferbench ] || [ "$XFERBENCH_B" = target/release/xferbench ]; then
  case "$mode" in quic*) features=(--features quic) ;; *) features=() ;; esac
  cargo build --quiet --release -p xfer-bench "${features[@]}"
fi
mkdir -p "$OUT"

# Every round runs A, B, B, A; each run is bounded by a timeout.
for round in $(seq 1 "$ROUNDS"); do
  for run in 1 2 3 4; do
    if [ "$run" = 1 ] || [ "$run" = 4 ]; then side=A bin=$XFERBENCH_A args=("${a_args[@]}")
    else side=B bin=$XFERBENCH_B args=("${b_args[@]}"); fi
    echo "== $mode round $round run $run ($side): $bin ${common[*]} ${args[*]}" >&2
    timeout 600 "$bin" "${common[@]}" "${args[@]}" --warmup 3 --no-progress \
      --json "$WORK/$round-$run.json" >&2
  done
done

machine=$(bench/machine.sh "bench/ab-compare.sh $mode" "$load_start")
a_desc="${a_args[*]:-no flags}" b_desc="${b_args[*]:-no flags}"
if [ "$XFERBENCH_A" != "$XFERBENCH_B" ]; then a_desc+=", $XFERBENCH_A" b_desc+=", $XFERBENCH_B"; fi
python3 - "$mode" "$WORK" "$ROUNDS" "$OUT" "$machine" "$a_desc" "$b_desc" "${common[*]}" <<'PY'
import json
import math
import statistics
import sys

mode, work, rounds, out, machine, a_flags, b_flags, common = sys.argv[1:9]
rounds = int(rounds)
SIDES = {1: "A", 2: "B", 3: "B", 4: "A"}
# mode: (what A and B are, the bar's minimum B ÷ A, which rows it applies to, the bar in words)
MODES = {
    "tls": ("`tls=off`", "`tls=on`", 0.5, lambda row: row["block_size"] == 16 << 20,
            "tls=on ≥ 0.5 × tls=off at 16 MiB"),
    "tls-builds": ("build A", "build B", 0.0, lambda row: False, "none (two builds, both `tls=on`)"),
    "quic": ("the TCP backend, plain", "the QUIC backend", 0.5, lambda row: row["block_size"] == 16 << 20,
             "QUIC ≥ 0.5 × plain TCP at 16 MiB"),
    "quic-tls": ("the TCP backend, `tls=on`", "the QUIC backend", 0.0, lambda row: False,
                 "none (the two encrypted paths)"),
    "grants": ("without `--grants`", "with `--grants`", 0.97, lambda row: row["scatter"],
               "grants cost ≤ 3 % (B ÷ A ≥ 0.97) on the scattered request"),
}
a_name, b_name, bar_min, bar_applies, bar_words = MODES[mode]


def size(block):
    return f"{block >> 20} MiB" if block >= 1 << 20 else f"{block >> 10} KiB"


def request(row):
    text = size(row["block_size"])
    if row["batch"] > 1:
        text += f" × {row['batch']}"
    return text + (" scattered" if row["scatter"] else "")


rows = []
# gbps[(op, request)][round][run] = GB/s
gbps = {}
bar_rows = set()
for r in range(1, rounds + 1):
    for run, side in SIDES.items():
        for row in json.load(open(f"{work}/{r}-{run}.json")):
            row.update(round=r, run=run, side=side)
            rows.append(row)
            key = (row["op"], request(row))
            gbps.setdefault(key, {}).setdefault(r, {})[run] = row["gbps"]
            if bar_applies(row):
                bar_rows.add(key)

mib = max(row["bytes"] for row in rows) >> 20
lines = [
    machine,
    "",
    f"Two processes on loopback, one request in flight: `xferbench {common}` with",
    f"A = {a_name} (`{a_flags}`), B = {b_name} (`{b_flags}`).",
    f"{rounds} rounds, each running A, B, B, A back to back ({mib} MiB per case and run). A round's ratio is",
    "the geometric mean of its two adjacent B ÷ A pairs; \"B ÷ A\" is the median of the rounds' ratios,",
    "\"spread\" their lowest and highest. GB/s = 10^9 bytes/s, medians over all runs of a side.",
    f"Bar: {bar_words}.",
    "",
    "| op | request | A GB/s | B GB/s | B ÷ A | spread | bar | per-round B ÷ A |",
    "|---|---|---|---|---|---|---|---|",
]
for key in sorted(gbps, key=lambda k: (k[0], k[1])):
    per_round = gbps[key]
    a = [g for runs in per_round.values() for run, g in runs.items() if SIDES[run] == "A"]
    b = [g for runs in per_round.values() for run, g in runs.items() if SIDES[run] == "B"]
    ratios = [
        math.sqrt(runs[2] / runs[1] * runs[3] / runs[4])
        for runs in per_round.values()
        if len(runs) == 4 and runs[1] > 0 and runs[4] > 0
    ]
    if not ratios:
        continue
    ratio = statistics.median(ratios)
    bar = ("met" if ratio >= bar_min else "**missed**") if key in bar_rows else "—"
    lines.append(
        f"| {key[0].upper()} | {key[1]} | {statistics.median(a):.3f} | {statistics.median(b):.3f} "
        f"| {ratio:.3f} | {min(ratios):.3f}–{max(ratios):.3f} | {bar} | {' '.join(f'{x:.2f}' for x in ratios)} |"
    )
report = "\n".join(lines) + "\n"
with open(f"{out}/{mode}.md", "w") as f:
    f.write(report)
with open(f"{out}/{mode}.json", "w") as f:
    json.dump(rows, f, indent=1)
print(report)
PY
echo "wrote $OUT/$mode.md $OUT/$mode.json" >&2
if [ "$OUT" = bench/results ]; then
  bench/update-readme.sh
  case "$mode" in quic*) bench/update-readme.sh plugins/quic/README.md bench/results ;; esac
fi
