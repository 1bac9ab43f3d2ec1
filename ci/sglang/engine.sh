#!/usr/bin/env bash
# Starts and stops real SGLang servers (CPU engine): a P/D prefill or decode over Mooncake's TCP
# transport or over xfer, or a plain (non-disaggregated) server; KV events over ZMQ.
#
#   ci/sglang/engine.sh start NAME --role prefill|decode|plain --port P [options] [-- extra args]
#   ci/sglang/engine.sh run   NAME ...same...   # foreground (exec): for callers that supervise it
#   ci/sglang/engine.sh stop  NAME
#   ci/sglang/engine.sh status NAME
#
# Options:
#   --bootstrap-port N   the prefill's bootstrap port (default 8998)
#   --events ENDPOINT    publish KV events, binding ENDPOINT (e.g. tcp://127.0.0.1:5557)
#   --max-total-tokens N the KV cache's size in tokens (default 16384; always capped: uncapped,
#                        SGLang sizes it from host RAM)
#   --transfer T         how a P/D pair moves its KV: mooncake (default; Mooncake's TCP
#                        transport) or xfer (SGLang's NIXL transfer backend over pd_xfer.nixl,
#                        the xfer backend --xfer-backend; needs --xfer-site)
#   --xfer-site DIR      the unpacked pd-xfer wheel (bindings/python/build.sh prints it)
#   --xfer-backend B     xfer's backend for --transfer xfer: TCP (default) or UCX
#   --model DIR          model directory (default: ci/vllm/make-model.py's, in the cache)
#   --venv DIR           SGLang venv (default: $PD_SGLANG_VENV, else the cache's sglang-venv)
#   --timeout SECS       how long `start` waits for /health (default 300)
#
# Every server: served model name tiny-llama, `--load-format dummy` (seeded: the same prompt
# gives the same text on every server), page size 1, metrics on. Started through launch.py (the
# Mooncake sender adjustment; with --transfer xfer, pd_xfer.nixl as NIXL, the KV as host memory)
# with our sgl_kernel stand-in on the path.
# `start` runs the server in its own session (process group), writes RUN/NAME.pid and
# RUN/NAME.log, and waits (bounded) for GET /health; `stop` sends SIGTERM to the group, then
# SIGKILL after 15 s. RUN = ${PD_SGLANG_RUN_DIR:-$PD_CACHE_DIR/run}. Facts: ../shared/SGLANG_CPU.md.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
cache="${PD_CACHE_DIR:-$HOME/.cache/pd-suite}"
run_dir="${PD_SGLANG_RUN_DIR:-$cache/run}"

usage() { sed -n '2,28p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
# shellcheck source=../engine-lib.sh
source "$here/../engine-lib.sh"
engine_dispatch usage "$run_dir" "$@"
cmd="$engine_cmd"
shift 2

role="" port="" bootstrap_port=8998 events="" max_total_tokens=16384 model="" timeout=300
transfer=mooncake xfer_site="" xfer_backend=TCP
venv="${PD_SGLANG_VENV:-$cache/sglang-venv}"
extra=()
while (($#)); do
  case "$1" in
    --role) role="$2"; shift 2 ;;
    --port) port="$2"; shift 2 ;;
    --bootstrap-port) bootstrap_port="$2"; shift 2 ;;
    --events) events="$2"; shift 2 ;;
    --max-total-tokens) max_total_tokens="$2"; shift 2 ;;
    --model) model="$2"; shift 2 ;;
    --transfer) transfer="$2"; shift 2 ;;
    --xfer-site) xfer_site="$2"; shift 2 ;;
    --xfer-backend) xfer_backend="$2"; shift 2 ;;
    --venv) venv="$2"; shift 2 ;;
    --timeout) timeout="$2"; shift 2 ;;
    --) shift; extra=("$@"); break ;;
    *) echo "unknown option: $1" >&2; usage ;;
  esac
done
[ -n "$port" ] || { echo "--port is required" >&2; exit 2; }
[ -x "$venv/bin/python" ] || { echo "no SGLang venv at $venv (run ci/sglang/install.sh)" >&2; exit 1; }
if [ -z "$model" ]; then
  model="$("$venv/bin/python" "$here/../vllm/make-model.py" | tail -n1)"
fi

# pd_xfer.nixl stands in for NIXL in every SGLang process (launch.py installs it).
transfer_env=()
case "$transfer" in
  mooncake) backend=mooncake ;;
  xfer)
    [ -d "$xfer_site/pd_xfer" ] || { echo "--transfer xfer needs --xfer-site DIR holding pd_xfer" >&2; exit 2; }
    backend=nixl
    transfer_env=(PD_SGLANG_NIXL=pd_xfer SGLANG_DISAGGREGATION_NIXL_BACKEND="$xfer_backend"
      UCX_NET_DEVICES="${UCX_NET_DEVICES:-lo}")
    PYTHONPATH="$xfer_site${PYTHONPATH:+:$PYTHONPATH}" ;;
  *) echo "unknown transfer: $transfer (mooncake or xfer)" >&2; exit 2 ;;
esac

args=(--model-path "$model" --served-model-name tiny-llama --device cpu --load-format dummy
  --page-size 1 --max-total-tokens "$max_total_tokens" --host 127.0.0.1 --port "$port"
  --enable-metrics)
case "$role" in
  prefill) args+=(--disaggregation-mode prefill --disaggregation-bootstrap-port "$bootstrap_port"
    --disaggregation-transfer-backend "$backend") ;;
  # The default retraction backup registers CUDA host memory.
  decode) args+=(--disaggregation-mode decode --disaggregation-transfer-backend "$backend"
    --disaggregation-decode-retraction-backup cpu_tensor) ;;
  plain) ;;
  *) echo "--role must be prefill, decode or plain" >&2; exit 2 ;;
esac
if [ -n "$events" ]; then
  args+=(--kv-events-config "{\"publisher\": \"zmq\", \"endpoint\": \"$events\", \"topic\": \"kv-events\", \"bind\": true}")
fi
args+=("${extra[@]}")

# SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX=0: a cached prefix would otherwise record a CUDA
# event in the prefill's scheduler.
engine_env=(env SGLANG_USE_CPU_ENGINE=1 MOONCAKE_PROTOCOL=tcp SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX=0
  PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 DO_NOT_TRACK=1
  PATH="$venv/bin:$PATH" PYTHONUNBUFFERED=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" "${transfer_env[@]}")
launch=("$venv/bin/python" "$here/launch.py" "${args[@]}")

if [ "$cmd" = run ]; then
  exec "${engine_env[@]}" "${launch[@]}"
fi
engine_start "http://127.0.0.1:$port/health" "$timeout" "${engine_env[@]}" "${launch[@]}"
