#!/usr/bin/env bash
# The transfer comparison in one command: our TCP backend, the raw-TCP baseline, NIXL's agent
# over UCX's TCP transport, Mooncake's transfer engine over TCP and iperf3 (a streaming ceiling),
# two processes on loopback, same sizes, same run. Prints ours ÷ each peer (the report, on
# stdout), writes it as markdown with the machine line (bench/machine.sh), the rows as JSON and a
# plot: $OUT/peers.{md,json,svg,png} (OUT=bench/results by default; then bench/README.md's block
# is updated too, bench/update-readme.sh).
#
#   bench/peers/compare.sh                       # 4K 16K 64K 1M 16M, READ and WRITE, median of 3
#   SIZES="4K 64K" REPEAT=5 OUT=/tmp/peers bench/peers/compare.sh
#   PARAMS=spin_us=0 ... passes backend parameters to ours (xferbench --params)
#   MODE=pipelined bench/peers/compare.sh        # many requests in flight, every tool at its best
#                                                # settings of a short sweep (bench/peers/pipelined.sh)
set -euo pipefail
cd "$(dirname "$0")/../.."

load_start=$(bench/machine.sh --load)
MODE=${MODE:-single}
if [ "$MODE" = pipelined ]; then SIZES=${SIZES:-"64K 1M 16M"}; fi
SIZES=${SIZES:-"4K 16K 64K 1M 16M"}
PARAMS=${PARAMS:-}
REPEAT=${REPEAT:-3}
OUT=${OUT:-bench/results}
XFERBENCH=${XFERBENCH:-target/release/xferbench}
VENV=$(bench/peers/install.sh | tail -1)
MOONCAKE=$(find "$VENV" -name transfer_engine_bench -type f | head -1)
WORK=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$WORK"' EXIT
mkdir -p "$OUT"
if [ "$XFERBENCH" = target/release/xferbench ]; then
  # Up to date with the checkout; with UCX when its library is there (the features
  # bench/ucx-compare.sh uses, so the scripts share one build).
  features=()
  pkg-config --exists ucx 2>/dev/null && features=(--features ucx)
  cargo build --quiet --release -p xfer-bench "${features[@]}"
fi

bytes() { case $1 in *K) echo $((${1%K} * 1024)) ;; *M) echo $((${1%M} * 1048576)) ;; *) echo "$1" ;; esac; }
median() { sort -g | awk '{ v[NR] = $1 } END { if (NR) print v[int((NR + 1) / 2)]; else print 0 }'; }
row() { printf '{"backend":"%s","op":"%s","block_size":%s,"gbps":%s,"repeat":%s%s}\n' "$1" "$2" "$3" "$4" "$REPEAT" "${5:-}"; }
sizes_csv=$(echo "$SIZES" | tr ' ' ',')
sizes_csv_bytes=$(for s in $SIZES; do bytes "$s"; done | paste -sd,)
port=$((20000 + RANDOM % 20000))
# Each initiator thread of Mooncake's bench moves batch x block bytes from its own part of this.
if [ "$MODE" = pipelined ]; then MOONCAKE_BUFFER=${MOONCAKE_BUFFER:-1073741824}; fi
MOONCAKE_BUFFER=${MOONCAKE_BUFFER:-268435456}

# One NIXL run of every size and op into $WORK/nixl.NAME/rows.jsonl; further arguments go to the
# initiator (--window).
nixl_once() {
  local dir=$WORK/nixl.$1 pid
  shift
  mkdir -p "$dir"
  UCX_TLS=tcp UCX_NET_DEVICES=lo timeout 300 "$VENV/bin/python" -X faulthandler bench/peers/nixl_bench.py target \
    --dir "$dir" --max-bytes "$(bytes "${SIZES##* }")" --timeout 280 >"$dir/target.log" 2>&1 &
  pid=$!
  if ! UCX_TLS=tcp UCX_NET_DEVICES=lo timeout 300 "$VENV/bin/python" -X faulthandler bench/peers/nixl_bench.py \
    initiator --dir "$dir" --sizes "$sizes_csv_bytes" --op read,write "$@" >"$dir/rows.jsonl" 2>"$dir/init.log"; then
    echo "NIXL initiator failed:" >&2; grep -v INFO "$dir/init.log" | tail -20 >&2; grep -v INFO "$dir/target.log" | tail -20 >&2
    return 1
  fi
  wait "$pid"
}
# One Mooncake run: GB/s of OP at SIZE with BATCH requests per batch and THREADS submitting
# threads (default 1 and 1) for DURATION seconds (default 3).
mooncake_once() {
  local op=$1 size=$2 batch=${3:-1} threads=${4:-1} duration=${5:-3} log=$WORK/mc.target.log seg pid
  port=$((port + 1))
  timeout 120 "$MOONCAKE" --mode=target --metadata_server=P2PHANDSHAKE --protocol=tcp \
    --local_server_name=127.0.0.1:$port --buffer_size="$MOONCAKE_BUFFER" >"$log" 2>&1 &
  pid=$!
  for _ in $(seq 100); do seg=$(grep -o 'listening on [0-9.:]*' "$log" | awk '{ print $3 }') && [ -n "$seg" ] && break; sleep 0.1; done
  port=$((port + 1))
  timeout 60 "$MOONCAKE" --mode=initiator --metadata_server=P2PHANDSHAKE --protocol=tcp --segment_id="$seg" \
    --local_server_name=127.0.0.1:$port --operation="$op" --block_size="$(bytes "$size")" --batch_size="$batch" \
    --threads="$threads" --duration="$duration" --buffer_size="$MOONCAKE_BUFFER" --report_unit=GB --report_precision=4 2>&1 |
    sed -n 's/.*throughput \([0-9.]*\) GB\/s.*/\1/p'
  kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null || true
}
# GB/s received by one iperf3 run: SIZE per write (at most 1 MiB: iperf3 streams larger blocks in
# 1 MiB writes), STREAMS parallel streams, DURATION seconds; more arguments go to the client (-R).
iperf3_once() {
  local size=$1 streams=$2 duration=$3 len
  shift 3
  port=$((port + 1))
  iperf3 -s -1 -p "$port" >/dev/null 2>&1 &
  sleep 0.3
  len=$(bytes "$size"); ((len > 1048576)) && len=1048576
  timeout 30 iperf3 -c 127.0.0.1 -p "$port" -t "$duration" -P "$streams" -l "$len" -J "$@" |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["end"]["sum_received"]["bits_per_second"] / 8e9)'
  wait || true
}
if [ "$MODE" = pipelined ]; then
  . bench/peers/pipelined.sh
  exit 0
fi

echo "== ours: xferbench --backend tcp --compare (raw-tcp baseline in the same processes)" >&2
"$XFERBENCH" --backend tcp ${PARAMS:+--params "$PARAMS"} --compare --op both --block-sizes "$sizes_csv" --repeat "$REPEAT" \
  --warmup 3 --no-progress --json "$WORK/ours.json" >&2

echo "== NIXL 1.5.1 Python agent, UCX backend, UCX_TLS=tcp" >&2
for i in $(seq "$REPEAT"); do nixl_once "$i"; done
for size in $SIZES; do
  for op in read write; do
    runs=$(cat "$WORK"/nixl.*/rows.jsonl | grep "\"op\": \"$op\", \"bytes\": $(bytes "$size"),")
    field() { echo "$runs" | sed "s/.*\"$1\": \([0-9.e+-]*\).*/\1/" | median; }
    # Each figure is its own median over the runs.
    row nixl-ucx-tcp "$op" "$(bytes "$size")" "$(field gbps)" ",\"p50_us\":$(field p50_us),\"p99_us\":$(field p99_us)"
  done
done >"$WORK/nixl.jsonl"
cat "$WORK/nixl.jsonl" >&2

echo "== Mooncake transfer_engine_bench, protocol tcp, 1 thread, batch 1" >&2
for size in $SIZES; do
  for op in read write; do
    gbps=$(for _ in $(seq "$REPEAT"); do mooncake_once "$op" "$size"; done | median)
    row mooncake-tcp "$op" "$(bytes "$size")" "$gbps"
  done
done >"$WORK/mooncake.jsonl"
cat "$WORK/mooncake.jsonl" >&2

echo "== iperf3, one TCP stream, writes of each block size (at most 1 MiB per write)" >&2
for size in $SIZES; do
  row iperf3-stream write "$(bytes "$size")" "$(iperf3_once "$size" 1 3)"
done >"$WORK/iperf3.jsonl"
cat "$WORK/iperf3.jsonl" >&2

python3 bench/peers/report.py "$WORK/ours.json" "$WORK"/nixl.jsonl "$WORK"/mooncake.jsonl "$WORK"/iperf3.jsonl \
  --ours-params "$PARAMS" --json "$OUT/peers.json" --markdown "$OUT/peers.md" --machine "$(bench/machine.sh bench/peers/compare.sh "$load_start")"
"$XFERBENCH" --rows "$OUT/peers.json" --plot "$OUT/peers" >/dev/null
echo "wrote $OUT/peers.md $OUT/peers.json $OUT/peers.svg $OUT/peers.png" >&2
if [ "$OUT" = bench/results ]; then bench/update-readme.sh; fi
