#!/usr/bin/env bash
# xferbench --backend ucx against ucx_perftest (the same UCX library) in one run, over UCX's
# TCP transport on loopback and over its shared-memory transports, plus single-thread memcpy.
# Prints ours / perftest (WRITE vs ucp_put_bw, READ vs ucp_get) and, for shared memory,
# ours / memcpy. Installs nothing: needs ucx_perftest (Debian: ucx-utils) and a release
# xferbench built with `--features ucx` (built here when missing).
#
#   bench/ucx-compare.sh                 # sizes 1M 16M, median of 3 runs each
#   SIZES="64K 1M" REPEAT=5 bench/ucx-compare.sh
set -euo pipefail
cd "$(dirname "$0")/.."

SIZES=${SIZES:-"1M 16M"}
REPEAT=${REPEAT:-3}
XFERBENCH=${XFERBENCH:-target/release/xferbench}
TRANSPORTS=("tcp|lo" "posix,cma,self|all")

command -v ucx_perftest >/dev/null || { echo "ucx_perftest not found (Debian: apt-get install ucx-utils)" >&2; exit 1; }
if [ ! -x "$XFERBENCH" ]; then
  cargo build --quiet --release -p xfer-bench --features ucx
fi

bytes() { case $1 in *K) echo $((${1%K} * 1024)) ;; *M) echo $((${1%M} * 1048576)) ;; *) echo "$1" ;; esac; }
# Enough iterations for about 1 GiB per run, 20..2000.
iters() { local n=$((1073741824 / $(bytes "$1"))); ((n < 20)) && n=20; ((n > 2000)) && n=2000; echo $n; }
median() { sort -g | awk '{ v[NR] = $1 } END { if (NR) print v[int((NR + 1) / 2)]; else print 0 }'; }

port=$((20000 + RANDOM % 20000))
# One ucx_perftest server + client; prints the Final line's overall bandwidth in decimal GB/s
# (ucx_perftest's MB/s are 2^20 bytes per second).
perftest_once() {
  local tls=$1 dev=$2 test=$3 size=$4 mbps server
  port=$((port + 1))
  UCX_TLS=$tls UCX_NET_DEVICES=$dev timeout 120 ucx_perftest -p "$port" >/dev/null 2>&1 &
  server=$!
  sleep 0.5
  mbps=$(UCX_TLS=$tls UCX_NET_DEVICES=$dev timeout 120 \
    ucx_perftest 127.0.0.1 -p "$port" -t "$test" -s "$(bytes "$size")" -n "$(iters "$size")" 2>/dev/null |
    awk '/^Final:/ { print $7 }')
  wait "$server" 2>/dev/null || true
  awk -v mb="${mbps:-0}" 'BEGIN { printf "%.3f\n", mb * 1048576 / 1e9 }'
}
perftest() { for _ in $(seq "$REPEAT"); do perftest_once "$@"; done | median; }

sizes_csv=$(echo "$SIZES" | tr ' ' ',')
rows=()
for entry in "${TRANSPORTS[@]}"; do
  tls=${entry%|*}
  dev=${entry#*|}
  params="tls=${tls//,/+}"
  [ "$dev" != all ] && params="$params,net_devices=$dev"
  name=$([ "$tls" = tcp ] && echo tcp || echo shm)
  echo "== $name: xferbench --backend ucx --params $params" >&2
  out=$("$XFERBENCH" --backend ucx --params "$params" --op both --block-sizes "$sizes_csv" \
    --repeat "$REPEAT" --warmup 3 --no-progress --memcpy 2>/dev/null)
  echo "$out" >&2
  for size in $SIZES; do
    memcpy=$(echo "$out" | awk -v s="$size" '$1 == "memcpy" && $2 == s { print $3 }')
    for op in write read; do
      test=$([ $op = write ] && echo ucp_put_bw || echo ucp_get)
      ours=$(echo "$out" | awk -v s="$size" -v op=$op '$1 == "ucx" && $2 == op && $3 == s { print $9 }')
      theirs=$(perftest "$tls" "$dev" "$test" "$size")
      rows+=("$name $op $size ${ours:-0} $test $theirs ${memcpy:-0}")
    done
  done
done

echo
printf '%-4s %-5s %-4s %10s  %-10s %10s %8s %12s %8s\n' transport op size "ours GB/s" perftest "GB/s" "ratio" "memcpy GB/s" "ratio"
for row in "${rows[@]}"; do
  read -r name op size ours test theirs memcpy <<<"$row"
  awk -v n="$name" -v op="$op" -v s="$size" -v o="$ours" -v t="$test" -v p="$theirs" -v m="$memcpy" 'BEGIN {
    r = p > 0 ? sprintf("%.2f", o / p) : "-"
    if (n == "shm") { mr = m > 0 ? sprintf("%.2f", o / m) : "-"; ms = sprintf("%.3f", m) } else { mr = "-"; ms = "-" }
    printf "%-9s %-5s %-4s %10.3f  %-10s %10.3f %8s %12s %8s\n", n, op, s, o, t, p, r, ms, mr
  }'
done
