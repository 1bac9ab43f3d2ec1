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
#   --eager              --enforce-eager: no torch.compile warm-up, so /health answers ~25 s
#                        sooner (for suites that check the protocol, not the engine's speed)
#
# `start` runs the engine in its own session (process group), writes RUN/NAME.pid (the group
# id) and RUN/NAME.log, and waits (bounded) for GET /health; on failure it stops the group and
# prints the log's tail. `stop` sends SIGTERM to the group, then SIGKILL after 15 s.
# RUN = ${PD_VLLM_RUN_DIR:-$PD_CACHE_DIR/run}. Facts followed: ../shared/VLLM_CPU.md.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
cache="${PD_CACHE_DIR:-$HOME/.cache/pd-suite}"
run_dir="${PD_VLLM_RUN_DIR:-$cache/run}"

usage() { sed -n '2,28p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
# shellcheck source=../engine-lib.sh
source "$here/../engine-lib.sh"
engine_dispatch usage "$run_dir" "$@"
cmd="$engine_cmd"
shift 2

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
    --eager) extra+=(--enforce-eager); shift ;;
    --) shift; extra+=("$@"); break ;;
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

engine_start "http://127.0.0.1:$port/health" "$timeout" "${engine_env[@]}" "$venv/bin/vllm" "${args[@]}"
