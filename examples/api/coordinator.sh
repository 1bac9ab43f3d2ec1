#!/usr/bin/env bash
# The coordinator's HTTP/JSON API as another orchestrator uses it (coordinator/API.md), against a
# running coordinator — by default the one of examples/local/run.sh:
#
#   examples/local/run.sh &            # or any cluster
#   examples/api/coordinator.sh [http://127.0.0.1:17700]
#
# Registers an extra engine (it points at the local example's decode-0 engine, so its /health
# answers), heartbeats with load, asks for a pairing, reports the request's progress, reads the
# index statistics, and leaves. Exits non-zero on any unexpected answer.
set -euo pipefail
base="${1:-http://127.0.0.1:17700}"
engine_url="${ENGINE_URL:-http://127.0.0.1:18200}"

call() { # method path [json] -> prints the body; fails on a non-2xx status
  local out status
  out=$(mktemp)
  status=$(curl -sS --max-time 5 -o "$out" -w '%{http_code}' -X "$1" -H 'content-type: application/json' \
    ${3:+-d "$3"} "$base$2")
  cat "$out"; rm -f "$out"
  case "$status" in 2??) ;; *) echo >&2; echo "error: $1 $2 answered $status" >&2; return 1 ;; esac
}
field() { python3 -c 'import json,sys; v=json.load(sys.stdin)
for k in sys.argv[1].split("."): v=v[int(k)] if k.isdigit() else v[k]
print(json.dumps(v) if isinstance(v,(dict,list)) else v)' "$1"; }

echo "== register an engine (an orchestrator without a sidecar would do the same)"
call POST /v1/engines "$(cat <<JSON
{"id": "api-demo", "role": "decode", "node": "api-node", "model": "sim-model",
 "engine_url": "$engine_url", "block_size": 16, "capacity_blocks": 4096}
JSON
)"; echo

echo "== heartbeat with load (renews the lease; the answer names engines that died since)"
call POST /v1/engines/api-demo/heartbeat '{"load": {"running": 2, "waiting": 0, "kv_usage": 0.1}}'; echo

echo "== engines the coordinator knows"
call GET /v1/engines | python3 -c 'import json,sys
for e in json.load(sys.stdin): print("  %-12s %-8s alive=%s blocks=%s" % (e["id"], e["role"], e["alive"], e["indexed_blocks"]))'

echo "== pair a request (token ids give exact vLLM block hashes; a prompt string works too)"
decision=$(call POST /v1/pair '{"request_id": "api-demo-1", "model": "sim-model", "prompt": "Explain prefill/decode disaggregation in two sentences."}')
echo "$decision"
decode=$(echo "$decision" | field decode.id)
reason=$(echo "$decision" | field reason)
echo "  -> decode on $decode ($reason)"

echo "== report the request's progress (the coordinator tracks in-flight load and held blocks)"
if [ "$reason" = disaggregated ]; then
  prefill=$(echo "$decision" | field prefill.id)
  call POST /v1/report "{\"request_id\": \"api-demo-1\", \"event\": \"prefill_done\", \"engine\": \"$prefill\", \"kv_transfer_params\": {\"do_remote_prefill\": true}}"
fi
call POST /v1/report '{"request_id": "api-demo-1", "event": "decode_started"}'
call POST /v1/report '{"request_id": "api-demo-1", "event": "finished"}'
echo "  reported"

echo "== index statistics"
call GET /v1/index/stats; echo

echo "== bad input gets a clear error (unknown field -> 400)"
if call POST /v1/pair '{"request_id": "x", "model": "sim-model", "promt": "typo"}' 2>/dev/null; then
  echo "error: a request with an unknown field was accepted" >&2; exit 1
fi
echo

echo "== leave"
call DELETE /v1/engines/api-demo
echo "  api-demo deregistered; done"
