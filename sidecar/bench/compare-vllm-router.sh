#!/usr/bin/env bash
# What pd-sidecar costs against vllm-router (PyPI) in vLLM P/D mode: both proxies drive the same
# two pd-sim engines (zero timing) under the same closed-loop load, streamed and not, in rounds
# that alternate which proxy goes first so drift hits both alike. Per mode and concurrency it
# reports requests/s, p50/p99, each proxy's CPU time per request (user + system, from /proc) and
# their ratios; at one stream it also drives the P/D calls directly (the load generator makes the
# prefill and decode calls itself) for the latency a proxy adds. The sidecar's resident set is
# read idle and at its peak under RSS_CONCURRENCY streams. Checks the bars of issue 23 part 4,
# writes the report with the machine line (bench/machine.sh) to $OUT/compare-vllm-router.md and
# the runs to $OUT/compare-vllm-router.json (OUT=sidecar/bench/results by default; then the block
# of sidecar/README.md between its results markers is replaced by the report).
#
#   sidecar/bench/compare-vllm-router.sh                  # 1 and 64 streams, both modes, 3 rounds
#   CONCURRENCY="64 512" SECONDS_PER_RUN=8 ROUNDS=5 STREAM_MODES=1 OUT=/tmp/cmp sidecar/bench/compare-vllm-router.sh
#   PERF=64 sidecar/bench/compare-vllm-router.sh          # also perf-record the sidecar at 64 streams
#
# vllm-router comes from $VENV (default: the peers venv CI installs, ~/.cache/pd-suite/peers-venv);
# it is installed there when missing.
set -euo pipefail
cd "$(dirname "$0")/../.."

load_start=$(bench/machine.sh --load)
VENV=${VENV:-$HOME/.cache/pd-suite/peers-venv}
CONCURRENCY=${CONCURRENCY:-"1 64"}
STREAM_MODES=${STREAM_MODES:-"0 1"}   # 0: non-streaming, 1: SSE
RSS_CONCURRENCY=${RSS_CONCURRENCY:-512}
SECONDS_PER_RUN=${SECONDS_PER_RUN:-6}
ROUNDS=${ROUNDS:-3}
PROMPT_WORDS=${PROMPT_WORDS:-64}
MAX_TOKENS=${MAX_TOKENS:-8}
PERF=${PERF:-}                        # a concurrency: perf-record the sidecar during one extra run
VLLM_ROUTER_VERSION=${VLLM_ROUTER_VERSION:-}   # e.g. "==0.1.17"; empty: latest
OUT=${OUT:-sidecar/bench/results}
BIN=${BIN:-target/release}
SIDECAR_BIN=${SIDECAR_BIN:-$BIN/pd-sidecar}
read -r -a SIDECAR_ARGS <<< "${SIDECAR_ARGS:-}"   # extra flags, e.g. "--workers 1"

if [ ! -x "$VENV/bin/vllm-router" ]; then
  echo "installing vllm-router$VLLM_ROUTER_VERSION into $VENV" >&2
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "vllm-router$VLLM_ROUTER_VERSION"
fi
ROUTER_VERSION=$("$VENV/bin/pip" show vllm-router 2>/dev/null | awk '/^Version/ {print $2}')
echo "vllm-router $ROUTER_VERSION" >&2

if [ "$BIN" = target/release ]; then
  cargo build --quiet --release -p pd-sim -p pd-sidecar --bins
  cargo build --quiet --release -p pd-sidecar --example sidecar-bench
fi
BENCH=$BIN/examples/sidecar-bench
mkdir -p "$OUT"
WORK=$(mktemp -d)

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$WORK"; }
trap cleanup EXIT

wait_up() {
  for _ in $(seq 200); do curl -sf -o /dev/null "$1" && return 0; sleep 0.05; done
  echo "$1 did not come up" >&2; exit 1
}
rss_kib() { awk '/^VmRSS/ {print $2}' "/proc/$1/status"; }

PP=$(free_port); DP=$(free_port); SP=$(free_port); RP=$(free_port)
SIM_ARGS=(--workers 1 --num-blocks 65536 --max-running 4096)
RUST_LOG=error $BIN/pd-sim --port "$PP" "${SIM_ARGS[@]}" >/dev/null 2>&1 & PIDS+=($!)
RUST_LOG=error $BIN/pd-sim --port "$DP" "${SIM_ARGS[@]}" >/dev/null 2>&1 & PIDS+=($!)
wait_up "http://127.0.0.1:$PP/health"; wait_up "http://127.0.0.1:$DP/health"

RUST_LOG=error $SIDECAR_BIN --listen "127.0.0.1:$SP" --engine "http://127.0.0.1:$DP" \
  --prefill "127.0.0.1:$PP" "${SIDECAR_ARGS[@]}" >/dev/null 2>&1 & SIDECAR=$!; PIDS+=($SIDECAR)
"$VENV/bin/vllm-router" --vllm-pd-disaggregation --prefill "http://127.0.0.1:$PP" --decode "http://127.0.0.1:$DP" \
  --host 127.0.0.1 --port "$RP" --policy round_robin --max-concurrent-requests 65536 --queue-size 65536 \
  --log-level error >/dev/null 2>&1 & ROUTER=$!; PIDS+=($ROUTER)
wait_up "http://127.0.0.1:$SP/health"; wait_up "http://127.0.0.1:$RP/health"
sleep 0.5
SIDECAR_RSS_IDLE=$(rss_kib "$SIDECAR")

drive() { # stream target concurrency [seconds]
  local stream_arg=(--no-stream) target
  [ "$1" = 1 ] && stream_arg=()
  case $2 in
    pd-sidecar) target=(--url "http://127.0.0.1:$SP" --pid "$SIDECAR") ;;
    vllm-router) target=(--url "http://127.0.0.1:$RP" --pid "$ROUTER") ;;
    direct) target=(--prefill "http://127.0.0.1:$PP" --decode "http://127.0.0.1:$DP") ;;
  esac
  $BENCH drive "${target[@]}" --concurrency "$3" --seconds "${4:-$SECONDS_PER_RUN}" \
    --prompt-words "$PROMPT_WORDS" --max-tokens "$MAX_TOKENS" "${stream_arg[@]}"
}

RESULTS=$WORK/runs.jsonl
for stream in $STREAM_MODES; do
  for c in $CONCURRENCY; do
    subjects="pd-sidecar vllm-router"
    [ "$c" = 1 ] && subjects="$subjects direct"
    for s in $subjects; do drive "$stream" "$s" "$c" 2 >/dev/null; done   # warm-up
    for r in $(seq "$ROUNDS"); do
      order=$subjects
      [ $((r % 2)) = 0 ] && order=$(echo "$subjects" | tr ' ' '\n' | tac | tr '\n' ' ')
      for s in $order; do
        echo "== stream=$stream concurrency=$c round $r: $s (load $(bench/machine.sh --load))" >&2
        run=$(drive "$stream" "$s" "$c")
        echo "{\"subject\": \"$s\", \"stream\": $stream, \"concurrency\": $c, \"round\": $r, \"load\": $(bench/machine.sh --load), \"run\": $run}" >> "$RESULTS"
      done
    done
  done
done

echo "== stream=1 concurrency=$RSS_CONCURRENCY: pd-sidecar's resident set" >&2
RSS_RUN=$(drive 1 pd-sidecar "$RSS_CONCURRENCY")

if [ -n "$PERF" ]; then
  echo "== perf record of pd-sidecar, non-streaming, $PERF streams" >&2
  perf record -F 2000 -g -o "$WORK/perf.data" -p "$SIDECAR" -- sleep "$SECONDS_PER_RUN" >/dev/null 2>&1 &
  PERF_PID=$!
  drive 0 pd-sidecar "$PERF" >/dev/null
  wait "$PERF_PID"
  { perf report -i "$WORK/perf.data" --no-children --stdio -g none --sort dso 2>/dev/null | grep -E '^ +[0-9]' | head -8
    echo
    perf report -i "$WORK/perf.data" --no-children --stdio -g none --sort dso,sym --percent-limit 0.7 2>/dev/null \
      | grep -E '^ +[0-9]' | cut -c1-160 | head -40; } > "$OUT/compare-vllm-router.perf.txt"
  echo "profile: $OUT/compare-vllm-router.perf.txt" >&2
fi

machine=$(bench/machine.sh sidecar/bench/compare-vllm-router.sh "$load_start")
python3 - "$RESULTS" "$OUT" "$machine" "$ROUTER_VERSION" "$SIDECAR_RSS_IDLE" "$RSS_CONCURRENCY" "$RSS_RUN" \
  "$ROUNDS" "$SECONDS_PER_RUN" "$PROMPT_WORDS" "$MAX_TOKENS" <<'EOF'
import json, os, re, statistics, sys
(results, out_dir, machine, router_version, rss_idle, rss_conc, rss_run,
 rounds, seconds, prompt_words, max_tokens) = sys.argv[1:]
rows = [json.loads(l) for l in open(results)]
rss_run = json.loads(rss_run)
rss_idle_mib, rss_peak_mib = int(rss_idle) / 1024, rss_run["proxy_rss_peak_kib"] / 1024
med = statistics.median

def runs(subject, stream, c):
    return [r for r in rows if (r["subject"], r["stream"], r["concurrency"]) == (subject, stream, c)]

def per_round(stream, c, f):
    """The median over rounds of f(sidecar run, router run, direct run or None)."""
    by = {s: {r["round"]: r["run"] for r in runs(s, stream, c)} for s in ("pd-sidecar", "vllm-router", "direct")}
    return med(f(by["pd-sidecar"][k], by["vllm-router"][k], by["direct"].get(k)) for k in by["pd-sidecar"])

CPU = "proxy_cpu_us_per_request"
lines = [machine, ""]
lines.append(
    f"pd-sidecar against vllm-router {router_version} (`--vllm-pd-disaggregation --policy round_robin`), both in "
    f"front of the same two pd-sim engines (zero timing), closed-loop load from `sidecar-bench drive`: "
    f"{prompt_words}-word prompts, {max_tokens} output tokens, distinct prompts. {rounds} rounds of {seconds} s per "
    f"row, the proxies' order alternating; figures are medians over the rounds, ratios the median of the rounds' "
    f"ratios. CPU = the proxy process's user + system time over its requests. \"direct\" = the load generator "
    f"makes the prefill and decode calls itself (one stream only); added p50 = the proxy's p50 minus direct's in "
    f"the same round. The load generator, both engines and the proxy share the machine's cores.")
lines.append("")
lines.append("| mode | streams | req/s sidecar / router | p50 ms sidecar / router / direct | added p50 ms sidecar / router "
             "| CPU µs/req sidecar / router | CPU ratio | errors |")
lines.append("|---|---|---|---|---|---|---|---|")
summary, bars = [], []
for stream in sorted({r["stream"] for r in rows}):
    mode = "SSE" if stream else "non-streaming"
    for c in sorted({r["concurrency"] for r in rows if r["stream"] == stream}):
        s = {k: med(r["run"][k] for r in runs("pd-sidecar", stream, c)) for k in ("rps", "p50_ms", CPU)}
        v = {k: med(r["run"][k] for r in runs("vllm-router", stream, c)) for k in ("rps", "p50_ms", CPU)}
        ratio = per_round(stream, c, lambda a, b, d: a[CPU] / b[CPU])
        errors = sum(r["run"]["errors"] for r in rows if (r["stream"], r["concurrency"]) == (stream, c))
        direct = runs("direct", stream, c)
        row = {"stream": stream, "concurrency": c, "sidecar": s, "router": v, "cpu_ratio": ratio, "errors": errors}
        if direct:
            row["direct_p50_ms"] = med(r["run"]["p50_ms"] for r in direct)
            row["added_p50_ms"] = per_round(stream, c, lambda a, b, d: a["p50_ms"] - d["p50_ms"])
            row["router_added_p50_ms"] = per_round(stream, c, lambda a, b, d: b["p50_ms"] - d["p50_ms"])
            p50 = f"{s['p50_ms']:.2f} / {v['p50_ms']:.2f} / {row['direct_p50_ms']:.2f}"
            added = f"{row['added_p50_ms']:.2f} / {row['router_added_p50_ms']:.2f}"
        else:
            p50, added = f"{s['p50_ms']:.2f} / {v['p50_ms']:.2f} / –", "–"
        lines.append(f"| {mode} | {c} | {s['rps']:.0f} / {v['rps']:.0f} | {p50} | {added} | "
                     f"{s[CPU]:.0f} / {v[CPU]:.0f} | {ratio:.2f} | {errors} |")
        summary.append(row)
        limit = {1: 120, 64: 60}.get(c)
        if limit is not None:
            bars.append((f"{mode}, {c} stream(s): CPU/request ≤ {limit} µs", f"{s[CPU]:.0f} µs", s[CPU] <= limit))
            bars.append((f"{mode}, {c} stream(s): CPU ≤ 0.4 × vllm-router's", f"{ratio:.2f}", ratio <= 0.4))
        if "added_p50_ms" in row:
            bars.append((f"{mode}, 1 stream: added p50 ≤ 0.3 ms", f"{row['added_p50_ms']:.2f} ms",
                         row["added_p50_ms"] <= 0.3))
bars.append(("resident set idle ≤ 30 MB", f"{rss_idle_mib:.1f} MiB", rss_idle_mib * 1.048576 <= 30))
bars.append((f"resident set at {rss_conc} streams ≤ 150 MB", f"{rss_peak_mib:.1f} MiB", rss_peak_mib * 1.048576 <= 150))
loads = [r["load"] for r in rows]
lines.append("")
lines.append(f"pd-sidecar's resident set: {rss_idle_mib:.1f} MiB idle, {rss_peak_mib:.1f} MiB at its peak during "
             f"{seconds} s of {rss_conc} SSE streams ({rss_run['rps']:.0f} req/s, {rss_run['errors']} errors). "
             f"Load average (1 min) during the rounds: {min(loads):.2f}–{max(loads):.2f}.")
lines.append("")
lines.append("| bar (issue 23 part 4) | measured | |")
lines.append("|---|---|---|")
for name, value, ok in bars:
    lines.append(f"| {name} | {value} | {'met' if ok else '**missed**'} |")
report = "\n".join(lines) + "\n"
print(report)
json.dump({"runs": rows, "summary": summary, "rss_idle_kib": int(rss_idle), "rss_run": rss_run,
           "rss_concurrency": int(rss_conc), "vllm_router": router_version,
           "bars": [{"bar": n, "measured": v, "met": ok} for n, v, ok in bars]},
          open(os.path.join(out_dir, "compare-vllm-router.json"), "w"), indent=1)
with open(os.path.join(out_dir, "compare-vllm-router.md"), "w") as f:
    f.write(report)
print(f"report: {out_dir}/compare-vllm-router.md", file=sys.stderr)
EOF

if [ "$OUT" = sidecar/bench/results ]; then
  (cd sidecar && ../bench/update-readme.sh README.md bench/results)
fi
