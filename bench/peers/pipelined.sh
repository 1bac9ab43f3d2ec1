# The pipelined comparison, sourced by `MODE=pipelined bench/peers/compare.sh` (its helpers and
# variables): many requests in flight, each tool swept over a few settings. Each setting's figure
# is the median of $REPEAT runs; the report gives each tool's best setting and ours ÷ it.
#
#   MODE=pipelined bench/peers/compare.sh                    # 64K 1M 16M, READ and WRITE
#   MODE=pipelined WINDOWS="16" THREADS="1 2" REPEAT=1 OUT=/tmp/p bench/peers/compare.sh
WINDOWS=${WINDOWS:-"16 64"}     # ours and NIXL: requests in flight per initiator thread
THREADS=${THREADS:-"1 2 4"}     # ours and Mooncake: initiator threads
OURS_STREAMS=${OURS_STREAMS:-"2 4"} # ours: connections per peer (the TCP backend's `streams`)
BATCHES=${BATCHES:-"16 64"}     # Mooncake: requests per submitted batch
STREAMS=${STREAMS:-"1 2 4"}     # iperf3: parallel streams
DURATION=${DURATION:-1}         # seconds per Mooncake and iperf3 run
CASE_BYTES=${CASE_BYTES:-1073741824} # bytes ours and NIXL move per measured case (all threads)

echo "== ours: xferbench --backend tcp, streams {$OURS_STREAMS} x --window {$WINDOWS} x --threads {$THREADS}" >&2
for streams in $OURS_STREAMS; do
  for window in $WINDOWS; do
    for threads in $THREADS; do
      for size in $SIZES; do
        iters=$((CASE_BYTES / ($(bytes "$size") * threads)))
        ((iters < 8)) && iters=8
        json=$WORK/ours.s$streams.w$window.t$threads.$size.json
        "$XFERBENCH" --backend tcp --params "streams=$streams${PARAMS:+,$PARAMS}" --op both --block-sizes "$size" \
          --threads "$threads" --window "$window" --iters "$iters" --repeat "$REPEAT" --warmup 2 --no-progress \
          --json "$json" >&2
        # The rows name the streams they ran with, so the report can spell out the best setting.
        python3 -c 'import json, sys; rows = json.load(open(sys.argv[1])); [r.update(streams=int(sys.argv[2])) for r in rows]; json.dump(rows, open(sys.argv[1], "w"))' "$json" "$streams"
      done
    done
  done
done

echo "== NIXL 1.5.1 Python agent (one thread), UCX_TLS=tcp, --window {$WINDOWS}" >&2
for window in $WINDOWS; do
  for i in $(seq "$REPEAT"); do nixl_once "w$window.$i" --window "$window" --max-total $((CASE_BYTES >> 20)); done
  for size in $SIZES; do
    for op in read write; do
      gbps=$(cat "$WORK"/nixl.w"$window".*/rows.jsonl | grep "\"op\": \"$op\", \"bytes\": $(bytes "$size")," |
        sed 's/.*"gbps": \([0-9.e+-]*\).*/\1/' | median)
      row nixl-ucx-tcp "$op" "$(bytes "$size")" "$gbps" ",\"settings\":\"window $window\""
    done
  done
done >"$WORK/nixl.jsonl"
cat "$WORK/nixl.jsonl" >&2

echo "== Mooncake transfer_engine_bench, protocol tcp, --batch_size {$BATCHES} x --threads {$THREADS}" >&2
for size in $SIZES; do
  for batch in $BATCHES; do
    for threads in $THREADS; do
      # Each thread moves batch x block bytes of its own part of the buffer.
      (($(bytes "$size") * batch * threads > MOONCAKE_BUFFER)) && continue
      for op in read write; do
        gbps=$(for _ in $(seq "$REPEAT"); do mooncake_once "$op" "$size" "$batch" "$threads" "$DURATION"; done | median)
        row mooncake-tcp "$op" "$(bytes "$size")" "$gbps" ",\"settings\":\"batch $batch, $threads threads\""
      done
    done
  done
done >"$WORK/mooncake.jsonl"
cat "$WORK/mooncake.jsonl" >&2

echo "== iperf3 -P {$STREAMS}: WRITE streams client to server, READ server to client (-R)" >&2
for size in $SIZES; do
  for streams in $STREAMS; do
    for op in read write; do
      reverse=(); [ "$op" = read ] && reverse=(-R)
      gbps=$(for _ in $(seq "$REPEAT"); do iperf3_once "$size" "$streams" "$DURATION" "${reverse[@]}"; done | median)
      row iperf3-stream "$op" "$(bytes "$size")" "$gbps" ",\"settings\":\"$streams streams\""
    done
  done
done >"$WORK/iperf3.jsonl"
cat "$WORK/iperf3.jsonl" >&2

python3 bench/peers/report.py --pipelined "$WORK"/ours.*.json "$WORK"/nixl.jsonl "$WORK"/mooncake.jsonl \
  "$WORK"/iperf3.jsonl --json "$OUT/peers-pipelined.json" --markdown "$OUT/peers-pipelined.md" \
  --machine "$(bench/machine.sh bench/peers/compare.sh "$load_start")"
"$XFERBENCH" --rows "$OUT/peers-pipelined.json" --plot "$OUT/peers-pipelined" >/dev/null
echo "wrote $OUT/peers-pipelined.md $OUT/peers-pipelined.json $OUT/peers-pipelined.svg $OUT/peers-pipelined.png" >&2
if [ "$OUT" = bench/results ]; then bench/update-readme.sh; fi
