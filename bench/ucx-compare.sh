#!/usr/bin/env bash
# xferbench --backend ucx against ucx_perftest (the same UCX library) in one run, over UCX's
# TCP transport on loopback and over its shared-memory transports, plus single-thread memcpy.
# Prints ours / perftest (WRITE vs ucp_put_bw, READ vs ucp_get) and, for shared memory,
# ours / memcpy. Installs nothing: needs ucx_perftest (Debian: ucx-utils) and a release
# xferbench built with `--features ucx` (built here when missing).
#
# Over shared memory ucx_perftest runs twice (see bench/README.md, "UCX against ucx_perftest"):
#   perftest      its default buffers, which UCX allocates itself in POSIX shared memory that the
#                 peer maps, so put/get are a memcpy through the mapping;
#   perftest-reg  UCX_ALLOC_PRIO=heap: ordinary memory that is registered, as xferbench's (and
#                 any application's) is; UCX 1.13 then emulates put/get with active messages.
#
# xferbench runs twice per transport, with each side's memory from (the "memory" column):
#   host          a HostBuffer from the global allocator, registered (--alloc host, the default);
#   backend       memory UCX allocates (--alloc backend, Agent::allocate), as perftest's default
#                 buffers are: over shared memory the peer maps it and put/get are a memcpy.
#
# Over TCP ucx_perftest also runs twice: with UCX's defaults (8 KiB TCP segments; the bar is
# set against this), and as "perftest-seg" with the TCP segment size the UCX backend sets by
# default (TCP_SEG, its tcp_seg_size: UCX_TCP_TX_SEG_SIZE = UCX_TCP_RX_SEG_SIZE), so the table
# shows what comes from that setting and what from the backend itself.
#
# Both tools run their two processes pinned apart (initiator/client on CPU 0, target/server on
# CPU 1; PIN=0 leaves placement to the scheduler): over these transports UCX needs the
# target's progress on the data path, and two processes sharing one CPU run several times
# slower.
#
# Prints the table and writes it, with the machine line (bench/machine.sh), to $OUT/ucx.md and
# the rows to $OUT/ucx.json (OUT=bench/results by default; then bench/README.md's block is
# updated too, bench/update-readme.sh).
#
#   bench/ucx-compare.sh                 # sizes 1M 16M, median of 3 runs each
#   SIZES="64K 1M" REPEAT=5 OUT=/tmp/ucx bench/ucx-compare.sh
set -euo pipefail
cd "$(dirname "$0")/.."

load_start=$(bench/machine.sh --load)
SIZES=${SIZES:-"1M 16M"}
REPEAT=${REPEAT:-3}
OUT=${OUT:-bench/results}
XFERBENCH=${XFERBENCH:-target/release/xferbench}
TRANSPORTS=("tcp|lo" "posix,cma,self|all")
PIN=${PIN:-$([ "$(nproc)" -ge 2 ] && echo 1 || echo 0)}
# The UCX backend's default tcp_seg_size (DEFAULT_TCP_SEG_SIZE in plugins/ucx/src/config.rs).
TCP_SEG=${TCP_SEG:-256K}
if [ "$PIN" = 1 ]; then
  near=(taskset -c 0)
  far=(taskset -c 1)
else
  near=()
  far=()
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

command -v ucx_perftest >/dev/null || { echo "ucx_perftest not found (Debian: apt-get install ucx-utils)" >&2; exit 1; }
if [ "$XFERBENCH" = target/release/xferbench ]; then
  # Up to date with the checkout (a no-op when it is); the same features as the other scripts.
  cargo build --quiet --release -p xfer-bench --features ucx
fi
mkdir -p "$OUT"

bytes() { case $1 in *K) echo $((${1%K} * 1024)) ;; *M) echo $((${1%M} * 1048576)) ;; *) echo "$1" ;; esac; }
# Enough iterations for about $2 bytes (default 1 GiB) per run, 20..2000.
iters() {
  local n=$((${2:-1073741824} / $(bytes "$1")))
  ((n < 20)) && n=20
  ((n > 2000)) && n=2000
  echo $n
}
median() { sort -g | awk '{ v[NR] = $1 } END { if (NR) print v[int((NR + 1) / 2)]; else print 0 }'; }

port=$((20000 + RANDOM % 20000))
# One ucx_perftest server + client; prints the Final line's overall bandwidth in decimal GB/s
# (ucx_perftest's MB/s are 2^20 bytes per second). One operation in flight (-O 1), as xferbench
# has one request in flight per thread (perftest's default window makes ucp_put_bw over TCP
# collapse at 16 MiB: 0.05 GB/s). $5: extra environment (e.g. UCX_ALLOC_PRIO=heap), $6: bytes
# per run.
perftest_once() {
  local tls=$1 dev=$2 test=$3 size=$4 extra=${5:-} total=${6:-1073741824} mbps server
  port=$((port + 1))
  # shellcheck disable=SC2086 # $extra is a list of VAR=value words
  env $extra UCX_TLS="$tls" UCX_NET_DEVICES="$dev" timeout 120 "${far[@]}" ucx_perftest -p "$port" >/dev/null 2>&1 &
  server=$!
  sleep 0.5
  # shellcheck disable=SC2086
  mbps=$(env $extra UCX_TLS="$tls" UCX_NET_DEVICES="$dev" timeout 120 "${near[@]}" \
    ucx_perftest 127.0.0.1 -p "$port" -t "$test" -s "$(bytes "$size")" -n "$(iters "$size" "$total")" -O 1 2>/dev/null |
    awk '/^Final:/ { print $7 }') || true
  wait "$server" 2>/dev/null || true
  awk -v mb="${mbps:-0}" 'BEGIN { printf "%.3f\n", mb * 1048576 / 1e9 }'
}
perftest() { for _ in $(seq "$REPEAT"); do perftest_once "$@"; done | median; }

# xferbench --backend ucx with its target started here (pinned), all sizes, READ and WRITE,
# REPEAT runs (the median run is printed), and single-thread memcpy. $3: --alloc (both sides).
xferbench() {
  local params=$1 sizes=$2 alloc=${3:-host} tpid line addr
  port=$((port + 2))
  rm -f "$tmp/stdin"
  mkfifo "$tmp/stdin"
  "${far[@]}" "$XFERBENCH" --target --listen "127.0.0.1:$port" --backend ucx --params "$params" \
    --block-sizes "$sizes" --alloc "$alloc" <"$tmp/stdin" >"$tmp/target.out" 2>"$tmp/target.err" &
  tpid=$!
  exec 3>"$tmp/stdin" # the target serves until its stdin closes
  for _ in $(seq 100); do
    line=$(grep -m1 '^READY' "$tmp/target.out" || true)
    [ -n "$line" ] && break
    sleep 0.1
  done
  addr=$(echo "$line" | awk '{ print $2 }')
  "${near[@]}" "$XFERBENCH" --connect "${addr:-127.0.0.1:$port}" --backend ucx --params "$params" --op both \
    --block-sizes "$sizes" --alloc "$alloc" --repeat "$REPEAT" --warmup 3 --no-progress --memcpy 2>/dev/null || true
  exec 3>&-
  wait "$tpid" 2>/dev/null || true
}

sizes_csv=$(echo "$SIZES" | tr ' ' ',')
rows=()
for entry in "${TRANSPORTS[@]}"; do
  tls=${entry%|*}
  dev=${entry#*|}
  params="tls=${tls//,/+}"
  [ "$dev" != all ] && params="$params,net_devices=$dev"
  name=$([ "$tls" = tcp ] && echo tcp || echo shm)
  echo "== $name: xferbench --backend ucx --params $params" >&2
  out=$(xferbench "$params" "$sizes_csv")
  echo "$out" >&2
  echo "== $name: xferbench --backend ucx --params $params --alloc backend" >&2
  out_alloc=$(xferbench "$params" "$sizes_csv" backend)
  echo "$out_alloc" >&2
  for size in $SIZES; do
    memcpy=$(echo "$out" | awk -v s="$size" '$1 == "memcpy" && $2 == s { print $3 }')
    memcpy_alloc=$(echo "$out_alloc" | awk -v s="$size" '$1 == "memcpy" && $2 == s { print $3 }')
    for op in write read; do
      test=$([ $op = write ] && echo ucp_put_bw || echo ucp_get)
      ours=$(echo "$out" | awk -v s="$size" -v op=$op '$1 == "ucx" && $2 == op && $3 == s { print $9 }')
      ours_alloc=$(echo "$out_alloc" | awk -v s="$size" -v op=$op '$1 == "ucx" && $2 == op && $3 == s { print $9 }')
      theirs=$(perftest "$tls" "$dev" "$test" "$size")
      if [ "$name" = shm ]; then
        # Registered ordinary memory is slow in perftest: a quarter of the bytes per run.
        registered=$(perftest "$tls" "$dev" "$test" "$size" UCX_ALLOC_PRIO=heap 268435456)
        seg=-
      else
        registered=-
        seg=$(perftest "$tls" "$dev" "$test" "$size" "UCX_TCP_TX_SEG_SIZE=$TCP_SEG UCX_TCP_RX_SEG_SIZE=$TCP_SEG")
      fi
      echo "   $name $op $size: ours ${ours:-0} (allocated by UCX: ${ours_alloc:-0}), $test $theirs," \
        "$test on registered memory $registered, $test with $TCP_SEG TCP segments $seg" >&2
      rows+=("$name host $op $size ${ours:-0} $test $theirs $registered ${memcpy:-0} $seg")
      # perftest on registered memory is the host rows' counterpart, not this one's.
      rows+=("$name backend $op $size ${ours_alloc:-0} $test $theirs - ${memcpy_alloc:-0} $seg")
    done
  done
done

placement=$([ "$PIN" = 1 ] && echo "initiator/client on CPU 0, target/server on CPU 1" || echo "left to the scheduler")
echo
echo "placement: $placement"
printf '%-9s %-7s %-5s %-4s %10s  %-10s %14s %6s %15s %6s %16s %6s %12s %6s\n' transport memory op size "ours GB/s" \
  perftest "default GB/s" ratio "registered GB/s" ratio "tcp seg GB/s" ratio "memcpy GB/s" ratio
for row in "${rows[@]}"; do
  read -r name mem op size ours test theirs registered memcpy seg <<<"$row"
  awk -v n="$name" -v mem="$mem" -v op="$op" -v s="$size" -v o="$ours" -v t="$test" -v p="$theirs" -v g="$registered" \
    -v m="$memcpy" -v q="$seg" '
  function ratio(a, b) { return (b != "-" && b > 0) ? sprintf("%.2f", a / b) : "-" }
  BEGIN {
    ms = n == "shm" ? sprintf("%.3f", m) : "-"
    printf "%-9s %-7s %-5s %-4s %10.3f  %-10s %14.3f %6s %15s %6s %16s %6s %12s %6s\n", n, mem, op, s, o, t, p, ratio(o, p),
      g, ratio(o, g), q, ratio(o, q), ms, n == "shm" ? ratio(o, m) : "-"
  }'
done

# The same rows as a markdown report and as JSON (GB/s = 10^9 bytes/s).
ucx_version=$(ucx_info -v 2>/dev/null | awk '/Version/ { print $NF; exit }')
{
  bench/machine.sh bench/ucx-compare.sh "$load_start"
  echo
  echo "UCX ${ucx_version:-?} (the library both tools use). Median of $REPEAT run(s) per cell, GB/s = 10^9 bytes/s;"
  echo "about 1 GiB per run (a quarter of that for perftest on registered memory), one operation in flight."
  echo "Placement: $placement. tcp: \`UCX_TLS=tcp\` on \`lo\`; shm: \`UCX_TLS=posix,cma,self\`."
  echo "WRITE is compared with \`ucp_put_bw\`, READ with \`ucp_get\`. Memory: host = xferbench \`--alloc host\`"
  echo "(registered ordinary memory), backend = \`--alloc backend\` (allocated by UCX on both sides); memcpy is"
  echo "measured in the same xferbench run as the row. xfer-ucx runs with its default parameters (over tcp:"
  echo "$TCP_SEG TCP segments, \`tcp_seg_size\`); perftest (tcp seg) is perftest with the same segments"
  echo "(\`UCX_TCP_TX_SEG_SIZE=UCX_TCP_RX_SEG_SIZE=$TCP_SEG\`), perftest (default) with UCX's (8 KiB)."
  echo
  echo "| transport | memory | op | size | xfer-ucx GB/s | perftest test | perftest (default) GB/s | ours ÷ default | perftest (registered) GB/s | ours ÷ registered | perftest (tcp seg) GB/s | ours ÷ tcp seg | memcpy GB/s | ours ÷ memcpy |"
  echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
  for row in "${rows[@]}"; do
    read -r name mem op size ours test theirs registered memcpy seg <<<"$row"
    awk -v n="$name" -v mem="$mem" -v op="$op" -v s="$size" -v o="$ours" -v t="$test" -v p="$theirs" -v g="$registered" \
      -v m="$memcpy" -v q="$seg" '
    function ratio(a, b) { return (b != "-" && b > 0) ? sprintf("%.2f", a / b) : "-" }
    BEGIN {
      shm = n == "shm"
      reg = shm && g != "-"
      sg = !shm && q != "-"
      printf "| %s | %s | %s | %s | %.3f | `%s` | %.3f | %s | %s | %s | %s | %s | %s | %s |\n", n, mem, toupper(op), s, o,
        t, p, ratio(o, p), reg ? sprintf("%.3f", g) : "-", reg ? ratio(o, g) : "-", sg ? sprintf("%.3f", q) : "-",
        sg ? ratio(o, q) : "-", shm ? sprintf("%.3f", m) : "-", shm ? ratio(o, m) : "-"
    }'
  done
} >"$OUT/ucx.md"
for row in "${rows[@]}"; do
  read -r name mem op size ours test theirs registered memcpy seg <<<"$row"
  awk -v n="$name" -v mem="$mem" -v op="$op" -v b="$(bytes "$size")" -v o="$ours" -v t="$test" -v p="$theirs" \
    -v g="$registered" -v m="$memcpy" -v q="$seg" -v r="$REPEAT" -v ts="$(bytes "$TCP_SEG")" '
  BEGIN {
    printf "{\"transport\":\"%s\",\"memory\":\"%s\",\"op\":\"%s\",\"block_size\":%d,\"repeat\":%d,", n, mem, op, b, r
    printf "\"xfer_ucx_gbps\":%s,", o
    printf "\"perftest_test\":\"%s\",\"perftest_gbps\":%s,\"perftest_registered_gbps\":%s,", t, p, g == "-" ? "null" : g
    printf "\"perftest_tcp_seg_gbps\":%s,\"tcp_seg_size\":%s,\"memcpy_gbps\":%s}\n", q == "-" ? "null" : q,
      n == "tcp" ? ts : "null", n == "shm" ? m : "null"
  }'
done | python3 -c 'import json, sys; print(json.dumps([json.loads(l) for l in sys.stdin], indent=1))' >"$OUT/ucx.json"
echo "wrote $OUT/ucx.md $OUT/ucx.json" >&2
if [ "$OUT" = bench/results ]; then bench/update-readme.sh; fi
