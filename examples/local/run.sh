#!/usr/bin/env bash
# A P/D cluster on this machine started from the config files next to this script, the way an
# operator starts the daemons: pd-coordinator, 2 prefill and 2 decode simulated engines (pd-sim,
# real KV bytes moved over xfer), a pd-sidecar in front of each engine. Clients talk to the
# decode sidecars (127.0.0.1:19200 and :19201).
#
#   examples/local/run.sh            # start, print the endpoints, run until Ctrl-C
#   examples/local/run.sh --smoke    # start, check requests through both decode sidecars and
#                                    # examples/api/coordinator.sh, stop
#   examples/local/run.sh [--smoke] --then CMD [ARGS...]
#                                    # start (and smoke), run CMD against the cluster, stop;
#                                    # exits with CMD's status
#
# Binaries: $BIN_DIR (default: target/release if it holds all three, else target/debug).
# Logs: $LOG_DIR (default: a fresh temporary folder, printed). Every process started here is
# stopped on exit, Ctrl-C included.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"

smoke=0
then_cmd=()
while [ $# -gt 0 ]; do
  case "$1" in
    --smoke) smoke=1; shift ;;
    --then) shift; then_cmd=("$@"); [ $# -gt 0 ] || { echo "usage: $0 [--smoke] [--then CMD [ARGS...]]" >&2; exit 2; }; break ;;
    *) echo "usage: $0 [--smoke] [--then CMD [ARGS...]]" >&2; exit 2 ;;
  esac
done

if [ -z "${BIN_DIR:-}" ]; then
  BIN_DIR="$root/target/release"
  for b in pd-coordinator pd-sidecar pd-sim; do
    [ -x "$BIN_DIR/$b" ] || BIN_DIR="$root/target/debug"
  done
fi
for b in pd-coordinator pd-sidecar pd-sim; do
  if [ ! -x "$BIN_DIR/$b" ]; then
    echo "error: $BIN_DIR/$b not found; build with: cargo build --release -p pd-coordinator -p pd-sidecar -p pd-sim" >&2
    exit 1
  fi
done
command -v curl >/dev/null || { echo "error: curl is needed" >&2; exit 1; }

LOG_DIR="${LOG_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/pd-local-XXXXXX")}"
mkdir -p "$LOG_DIR"

# Every port the configs use must be free, or a daemon would fail to bind (or talk to a stranger).
ports=(17700 17701 18100 18101 18200 18201 18150 18151 18250 18251 18170 18171 18270 18271
       18190 18191 18290 18291 19100 19101 19200 19201)
for p in "${ports[@]}"; do
  if (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then
    echo "error: port $p is in use; the example's configs need ports 17700-19201 listed in $0" >&2
    exit 1
  fi
done

pids=()
stop() {
  local code=$?
  trap - EXIT INT TERM
  if [ ${#pids[@]} -gt 0 ]; then
    kill -TERM "${pids[@]}" 2>/dev/null || true
    # Sidecars drain for up to their --drain-timeout; give everything 10 s, then force.
    for _ in $(seq 100); do
      alive=0
      for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
      [ $alive = 0 ] && break
      sleep 0.1
    done
    kill -KILL "${pids[@]}" 2>/dev/null || true
    wait 2>/dev/null || true
  fi
  echo "stopped; logs in $LOG_DIR"
  exit $code
}
trap stop EXIT
trap 'exit 130' INT TERM

start() { # name binary config
  RUST_LOG="${RUST_LOG:-info}" "$BIN_DIR/$2" --config "$3" >"$LOG_DIR/$1.log" 2>&1 &
  pids+=($!)
}

# Waits (bounded) until a URL answers 2xx.
wait_up() { # url what
  for _ in $(seq 300); do
    curl -fsS -o /dev/null --max-time 1 "$1" 2>/dev/null && return 0
    sleep 0.1
  done
  echo "error: $2 did not come up at $1 (logs: $LOG_DIR)" >&2
  exit 1
}

start coordinator pd-coordinator "$here/coordinator.toml"
wait_up http://127.0.0.1:17700/health coordinator
for e in prefill-0 prefill-1 decode-0 decode-1; do
  start "$e" pd-sim "$here/engines/$e.toml"
done
for port in 18100 18101 18200 18201; do wait_up "http://127.0.0.1:$port/health" "engine :$port"; done
for e in prefill-0 prefill-1 decode-0 decode-1; do
  start "sidecar-$e" pd-sidecar "$here/sidecars/$e.toml"
done
for port in 19100 19101 19200 19201; do wait_up "http://127.0.0.1:$port/health" "sidecar :$port"; done

# The coordinator knows the engines once their sidecars registered.
alive=0
for _ in $(seq 100); do
  alive=$(curl -fsS --max-time 1 http://127.0.0.1:17700/v1/engines 2>/dev/null | grep -o '"alive":true' | wc -l || true)
  [ "$alive" -ge 4 ] && break
  sleep 0.1
done
[ "$alive" -ge 4 ] || { echo "error: the coordinator lists $alive live engines, want 4 (logs: $LOG_DIR)" >&2; exit 1; }

echo "cluster up (logs: $LOG_DIR)"
echo "  clients:     http://127.0.0.1:19200  http://127.0.0.1:19201  (decode sidecars, OpenAI API)"
echo "  coordinator: http://127.0.0.1:17700/v1/engines  /metrics"

# --then: a command run against the cluster (after --smoke's checks when both are given).
run_then() {
  [ ${#then_cmd[@]} -gt 0 ] || return 0
  LOG_DIR="$LOG_DIR" "${then_cmd[@]}"
  exit 0
}

if [ $smoke = 0 ]; then
  run_then
  echo "Ctrl-C stops every process"
  wait
  exit 0
fi

# --smoke: requests through both decode sidecars. Each prompt is new from its first word and
# longer than the coordinator's local-prefill-max-tokens, so each must be disaggregated: a
# prefill engine computes it and a decode engine pulls its KV blocks.
metric() { # url name -> sum of the series
  curl -fsS --max-time 2 "$1/metrics" | awk -v n="$2" '$1 == n || index($1, n "{") == 1 { s += $NF } END { printf "%d\n", s }'
}
words="$(for i in $(seq 400); do printf 'word%d ' $((i % 97)); done)"
for sidecar in 19200 19201; do
  engine=$((sidecar - 1000))
  before=$(metric "http://127.0.0.1:$engine" vllm:nixl_xfer_time_seconds_count)
  body=$(printf '{"model":"sim-model","prompt":"%s","max_tokens":8}' "completion $sidecar $words")
  out=$(curl -fsS --max-time 30 -H 'content-type: application/json' -d "$body" "http://127.0.0.1:$sidecar/v1/completions")
  echo "$out" | grep -q '"text"' || { echo "error: no completion text from :$sidecar: $out" >&2; exit 1; }
  chat=$(printf '{"model":"sim-model","messages":[{"role":"user","content":"%s"}],"max_tokens":8,"stream":true}' "chat $sidecar $words")
  out=$(curl -fsS -N --max-time 30 -H 'content-type: application/json' -d "$chat" "http://127.0.0.1:$sidecar/v1/chat/completions")
  echo "$out" | grep -q '^data: \[DONE\]' || { echo "error: chat stream from :$sidecar did not end with [DONE]: $out" >&2; exit 1; }
  after=$(metric "http://127.0.0.1:$engine" vllm:nixl_xfer_time_seconds_count)
  echo "  sidecar :$sidecar: completion + streamed chat ok; engine :$engine KV pulls $before -> $after"
done
pulls=0
for engine in 18200 18201; do
  pulls=$((pulls + $(metric "http://127.0.0.1:$engine" vllm:nixl_xfer_time_seconds_count)))
done
disaggregated=$(( $(metric http://127.0.0.1:19200 pd_sidecar_disaggregated_total) + $(metric http://127.0.0.1:19201 pd_sidecar_disaggregated_total) ))
echo "smoke: 4 requests ok, $disaggregated disaggregated by the sidecars, $pulls KV pulls by the decode engines"
if [ "$disaggregated" -lt 4 ] || [ "$pulls" -lt 4 ]; then
  echo "error: every request should have been disaggregated with a KV pull" >&2
  exit 1
fi
# The coordinator's API as another orchestrator would use it, against this cluster.
"$here/../api/coordinator.sh" http://127.0.0.1:17700 >"$LOG_DIR/api.log" 2>&1 || {
  cat "$LOG_DIR/api.log" >&2
  echo "error: examples/api/coordinator.sh failed" >&2
  exit 1
}
echo "smoke: examples/api/coordinator.sh ok (register, heartbeat, pair, report, stats, leave)"
run_then
