#!/usr/bin/env bash
# Throughput of pd-sidecar versus vllm-router (PyPI) in vLLM P/D mode, driving the same two
# pd-sim engines (zero timing) with the same closed-loop load; rounds alternate between the two
# proxies so drift hits both alike. Prints requests/s, latency and the proxies' CPU time per
# request, and the ratio of medians.
#
#   sidecar/bench/compare-vllm-router.sh                  # 64 and 512 concurrent, non-streaming
#   CONCURRENCY="64 512" SECONDS_PER_RUN=8 ROUNDS=3 STREAM=1 sidecar/bench/compare-vllm-router.sh
#
# vllm-router is installed once into a cached venv ($VENV, default ~/.cache/pd-sidecar-bench/venv).
set -euo pipefail
cd "$(dirname "$0")/../.."

VENV=${VENV:-$HOME/.cache/pd-sidecar-bench/venv}
CONCURRENCY=${CONCURRENCY:-"64 512"}
SECONDS_PER_RUN=${SECONDS_PER_RUN:-6}
ROUNDS=${ROUNDS:-3}
STREAM=${STREAM:-0}
PROMPT_WORDS=${PROMPT_WORDS:-64}
MAX_TOKENS=${MAX_TOKENS:-8}
VLLM_ROUTER_VERSION=${VLLM_ROUTER_VERSION:-}   # e.g. "==0.1.17"; empty: latest
OUT=${OUT:-target/compare-vllm-router.json}

if [ ! -x "$VENV/bin/vllm-router" ]; then
  echo "installing vllm-router$VLLM_ROUTER_VERSION into $VENV" >&2
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "vllm-router$VLLM_ROUTER_VERSION"
fi
echo "vllm-router $("$VENV/bin/pip" show vllm-router 2>/dev/null | awk '/^Version/ {print $2}')" >&2

cargo build --quiet --release -p pd-sim -p pd-sidecar --bins
cargo build --quiet --release -p pd-sidecar --example sidecar-bench
BIN=target/release
BENCH=$BIN/examples/sidecar-bench

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

wait_up() {
  for _ in $(seq 200); do curl -sf -o /dev/null "$1" && return 0; sleep 0.05; done
  echo "$1 did not come up" >&2; exit 1
}

PP=$(free_port); DP=$(free_port); SP=$(free_port); RP=$(free_port)
SIM_ARGS=(--workers 1 --num-blocks 65536 --max-running 4096)
RUST_LOG=error $BIN/pd-sim --port "$PP" "${SIM_ARGS[@]}" >/dev/null 2>&1 & PIDS+=($!)
RUST_LOG=error $BIN/pd-sim --port "$DP" "${SIM_ARGS[@]}" >/dev/null 2>&1 & PIDS+=($!)
wait_up "http://127.0.0.1:$PP/health"; wait_up "http://127.0.0.1:$DP/health"

RUST_LOG=error $BIN/pd-sidecar --listen "127.0.0.1:$SP" --engine "http://127.0.0.1:$DP" \
  --prefill "127.0.0.1:$PP" >/dev/null 2>&1 & SIDECAR=$!; PIDS+=($SIDECAR)
"$VENV/bin/vllm-router" --vllm-pd-disaggregation --prefill "http://127.0.0.1:$PP" --decode "http://127.0.0.1:$DP" \
  --host 127.0.0.1 --port "$RP" --policy round_robin --max-concurrent-requests 65536 --queue-size 65536 \
  --log-level error >/dev/null 2>&1 & ROUTER=$!; PIDS+=($ROUTER)
wait_up "http://127.0.0.1:$SP/health"; wait_up "http://127.0.0.1:$RP/health"

STREAM_ARG=(--no-stream); [ "$STREAM" = 1 ] && STREAM_ARG=()
drive() { # url pid concurrency
  $BENCH drive --url "$1" --pid "$2" --concurrency "$3" --seconds "$SECONDS_PER_RUN" \
    --prompt-words "$PROMPT_WORDS" --max-tokens "$MAX_TOKENS" "${STREAM_ARG[@]}"
}

RESULTS=$(mktemp)
for c in $CONCURRENCY; do
  drive "http://127.0.0.1:$SP" "$SIDECAR" "$c" >/dev/null   # warm-up
  drive "http://127.0.0.1:$RP" "$ROUTER" "$c" >/dev/null
  for r in $(seq "$ROUNDS"); do
    echo "{\"proxy\": \"pd-sidecar\", \"concurrency\": $c, \"round\": $r, \"run\": $(drive "http://127.0.0.1:$SP" "$SIDECAR" "$c")}" >> "$RESULTS"
    echo "{\"proxy\": \"vllm-router\", \"concurrency\": $c, \"round\": $r, \"run\": $(drive "http://127.0.0.1:$RP" "$ROUTER" "$c")}" >> "$RESULTS"
  done
done

python3 - "$RESULTS" "$OUT" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
out = {"runs": rows, "summary": []}
print(f"{'conc':>5} {'proxy':<12} {'req/s (median)':>15} {'p50 ms':>8} {'p99 ms':>8} {'CPU us/req':>11} {'errors':>7}")
for c in sorted({r["concurrency"] for r in rows}):
    med = {}
    for proxy in ("pd-sidecar", "vllm-router"):
        rs = [r["run"] for r in rows if r["concurrency"] == c and r["proxy"] == proxy]
        m = {k: statistics.median(x[k] for x in rs) for k in ("rps", "p50_ms", "p99_ms", "proxy_cpu_us_per_request")}
        m["errors"] = sum(x["errors"] for x in rs)
        med[proxy] = m
        print(f"{c:>5} {proxy:<12} {m['rps']:>15.0f} {m['p50_ms']:>8.2f} {m['p99_ms']:>8.2f} {m['proxy_cpu_us_per_request']:>11.0f} {m['errors']:>7}")
    ratio = med["pd-sidecar"]["rps"] / med["vllm-router"]["rps"]
    cpu = med["vllm-router"]["proxy_cpu_us_per_request"] / med["pd-sidecar"]["proxy_cpu_us_per_request"]
    print(f"{c:>5} throughput ratio pd-sidecar / vllm-router = {ratio:.2f}x; vllm-router uses {cpu:.2f}x the CPU per request")
    out["summary"].append({"concurrency": c, "median": med, "throughput_ratio": ratio, "cpu_ratio": cpu})
json.dump(out, open(sys.argv[2], "w"), indent=1)
print(f"details: {sys.argv[2]}")
EOF
