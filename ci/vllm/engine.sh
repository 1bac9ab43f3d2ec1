#!/usr/bin/env bash
# Starts and stops real vLLM instances (prefill/decode over NixlConnector, KV events over ZMQ).
#
#   ci/vllm/engine.sh start NAME --port P --side-port S --core C [options] [-- extra vllm args]
#   ci/vllm/engine.sh run   NAME ...same...   # foreground (exec): for callers that supervise it
#   ci/vllm/engine.sh stop  NAME
#   ci/vllm/engine.sh status NAME
#
# Options:
#   --events ENDPOINT    publish KV events (e.g. tcp://*:5557); replay on the next port
#   --replay ENDPOINT    replay endpoint (default: the events port + 1)
#   --topic TOPIC        KV-event topic (default: kv-events); with an --events endpoint that
#                        names a host, vLLM connects to it (a collector) instead of binding
#   --block-size N       KV block size, a multiple of 32 on CPU (default 32)
#   --model DIR          model directory (default: built by make-model.py into the cache)
#   --venv DIR           vLLM venv (default: $PD_VLLM_VENV, else the cache's vllm-venv)
#   --timeout SECS       how long `start` waits for /health (default 300)
#   --connector NAME     nixl (vLLM's NixlConnector, default) or xfer (pd_xfer.vllm.XferConnector:
#                        the same protocol over xfer; needs --xfer-site)
#   --xfer-site DIR      the unpacked pd-xfer wheel (bindings/python/build.sh prints it)
#   --xfer-backend NAME  xfer backend of XferConnector: TCP (default) or UCX
#
# `start` runs the engine in its own session (process group), writes RUN/NAME.pid (the group
# id) and RUN/NAME.log, and waits (bounded) for GET /health; on failure it stops the group and
# prints the log's tail. `stop` sends SIGTERM to the group, then SIGKILL after 15 s.
# RUN = ${PD_VLLM_RUN_DIR:-$PD_CACHE_DIR/run}. Facts followed: ../shared/VLLM_CPU.md.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
cache="${PD_CACHE_DIR:-$HOME/.cache/pd-suite}"
run_dir="${PD_VLLM_RUN_DIR:-$cache/run}"

usage() { sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
(($# >= 2)) || usage
cmd="$1" name="$2"
shift 2
[[ "$name" =~ ^[A-Za-z0-9_.-]+$ ]] || { echo "bad instance name: $name" >&2; exit 2; }
pid_file="$run_dir/$name.pid"
log_file="$run_dir/$name.log"

alive() { [ -f "$pid_file" ] && kill -0 -- "-$(cat "$pid_file")" 2>/dev/null; }

stop() {
  if ! [ -f "$pid_file" ]; then
    echo "$name: not running" >&2
    return 0
  fi
  local pgid
  pgid="$(cat "$pid_file")"
  if kill -TERM -- "-$pgid" 2>/dev/null; then
    for _ in $(seq 1 150); do
      kill -0 -- "-$pgid" 2>/dev/null || break
      sleep 0.1
    done
    if kill -0 -- "-$pgid" 2>/dev/null; then
      echo "$name: still running after 15 s, SIGKILL" >&2
      kill -KILL -- "-$pgid" 2>/dev/null || true
    fi
  fi
  rm -f "$pid_file"
  echo "$name: stopped" >&2
}

case "$cmd" in
  stop) stop; exit 0 ;;
  status)
    if alive; then echo "$name: running (pgid $(cat "$pid_file"))"; else echo "$name: not running"; exit 1; fi
    exit 0 ;;
  start|run) ;;
  *) usage ;;
esac

port="" side_port="" core="" events="" replay="" topic=kv-events block_size=32 model="" timeout=300
connector=nixl xfer_site="" xfer_backend=TCP
venv="${PD_VLLM_VENV:-$cache/vllm-venv}"
extra=()
while (($#)); do
  case "$1" in
    --port) port="$2"; shift 2 ;;
    --side-port) side_port="$2"; shift 2 ;;
    --core) core="$2"; shift 2 ;;
    --events) events="$2"; shift 2 ;;
    --replay) replay="$2"; shift 2 ;;
    --topic) topic="$2"; shift 2 ;;
    --block-size) block_size="$2"; shift 2 ;;
    --model) model="$2"; shift 2 ;;
    --venv) venv="$2"; shift 2 ;;
    --timeout) timeout="$2"; shift 2 ;;
    --connector) connector="$2"; shift 2 ;;
    --xfer-site) xfer_site="$2"; shift 2 ;;
    --xfer-backend) xfer_backend="$2"; shift 2 ;;
    --) shift; extra=("$@"); break ;;
    *) echo "unknown option: $1" >&2; usage ;;
  esac
done
[ -n "$port" ] && [ -n "$side_port" ] && [ -n "$core" ] || { echo "--port, --side-port and --core are required" >&2; exit 2; }
[ -x "$venv/bin/vllm" ] || { echo "no vLLM venv at $venv (run ci/vllm/install.sh)" >&2; exit 1; }
if [ -z "$model" ]; then
  model="$("$venv/bin/python" "$here/make-model.py" | tail -n1)"
fi

python_path=()
case "$connector" in
  nixl) kv_config='{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_buffer_device":"cpu"}' ;;
  xfer)
    [ -d "$xfer_site/pd_xfer" ] || { echo "--connector xfer needs --xfer-site DIR holding pd_xfer" >&2; exit 2; }
    kv_config="{\"kv_connector\":\"XferConnector\",\"kv_connector_module_path\":\"pd_xfer.vllm\",\"kv_role\":\"kv_both\",\"kv_buffer_device\":\"cpu\",\"kv_connector_extra_config\":{\"backends\":[\"$xfer_backend\"]}}"
    python_path=(PYTHONPATH="$xfer_site${PYTHONPATH:+:$PYTHONPATH}") ;;
  *) echo "unknown connector: $connector (nixl or xfer)" >&2; exit 2 ;;
esac
args=(serve "$model" --served-model-name tiny-llama --host 127.0.0.1 --port "$port"
  --load-format dummy --dtype bfloat16 --max-model-len 1024 --block-size "$block_size"
  --enable-prefix-caching --prefix-caching-hash-algo sha256_cbor
  --kv-transfer-config "$kv_config")
if [ -n "$events" ]; then
  if [ -z "$replay" ]; then
    replay="${events%:*}:$(( ${events##*:} + 1 ))"
  fi
  args+=(--kv-events-config "{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": \"$events\", \"replay_endpoint\": \"$replay\", \"topic\": \"$topic\"}")
fi
args+=("${extra[@]}")

# The engine's environment (VLLM_CPU.md): loopback for NIXL/UCX, its own side-channel port and core.
# PYTHONHASHSEED stays unset: it would change NONE_HASH and so every block hash.
engine_env=(env -u PYTHONHASHSEED
  VLLM_HOST_IP=127.0.0.1 VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1 VLLM_NIXL_SIDE_CHANNEL_PORT="$side_port"
  UCX_NET_DEVICES=lo VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}" VLLM_CPU_OMP_THREADS_BIND="$core"
  VLLM_SERVER_DEV_MODE=1 VLLM_LOGGING_LEVEL="${VLLM_LOGGING_LEVEL:-INFO}" VLLM_NO_USAGE_STATS=1
  DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 "${python_path[@]}")

if [ "$cmd" = run ]; then
  exec "${engine_env[@]}" "$venv/bin/vllm" "${args[@]}"
fi

mkdir -p "$run_dir"
if alive; then
  echo "$name: already running (pgid $(cat "$pid_file")); stop it first" >&2
  exit 1
fi
start=$(date +%s)
# The engine's new session writes its own group id: `$!` is not it when setsid has to fork (it
# does when it starts as a process group leader), and a wrong id made `start` report a running
# engine as exited and leave it behind, its worker busy on a core.
rm -f "$pid_file"
setsid bash -c 'echo $$ >"$0"; exec "$@"' "$pid_file" "${engine_env[@]}" "$venv/bin/vllm" "${args[@]}" \
  >"$log_file" 2>&1 < /dev/null &
for _ in $(seq 1 100); do
  [ -s "$pid_file" ] && break
  sleep 0.05
done
[ -s "$pid_file" ] || { echo "$name: the engine's session did not start" >&2; exit 1; }
trap 'echo "$name: start interrupted" >&2; stop; exit 130' INT TERM
deadline=$((start + timeout))
until curl -fsS -m 2 "http://127.0.0.1:$port/health" >/dev/null 2>&1; do
  if ! alive; then
    echo "$name: exited during start; last log lines ($log_file):" >&2
    tail -n 40 "$log_file" >&2
    rm -f "$pid_file"
    exit 1
  fi
  if (($(date +%s) >= deadline)); then
    echo "$name: no /health within ${timeout} s; last log lines ($log_file):" >&2
    tail -n 40 "$log_file" >&2
    stop
    exit 1
  fi
  sleep 1
done
echo "$name: healthy on :$port after $(( $(date +%s) - start )) s (pgid $(cat "$pid_file"), log $log_file)" >&2
