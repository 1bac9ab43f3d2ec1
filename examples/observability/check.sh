#!/usr/bin/env bash
# The shipped scrape config and dashboard against real components: a real Prometheus (Debian's
# `prometheus` package) scrapes the cluster of examples/local, requests move the counters, and
# every expression of grafana-dashboard.json must return data (check_dashboard.py).
#
#   examples/observability/check.sh     # binaries from $BIN_DIR as examples/local/run.sh
#
# The config is used as shipped except the scrape interval (1s instead of 5s, to keep the test
# short). Prometheus listens on a free loopback port; its data and log go to a temporary folder.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"

command -v prometheus >/dev/null || {
  echo "error: prometheus not found (Debian: apt-get install prometheus; ci/install-deps.sh installs it)" >&2
  exit 1
}
command -v python3 >/dev/null || { echo "error: python3 is needed" >&2; exit 1; }

work="$(mktemp -d "${TMPDIR:-/tmp}/pd-observability-XXXXXX")"
sed 's/^\(  [a-z_]*_interval:\) 5s$/\1 1s/' "$here/prometheus.yml" >"$work/prometheus.yml"
[ "$(grep -c '_interval: 1s$' "$work/prometheus.yml")" = 2 ] || {
  echo "error: expected scrape_interval and evaluation_interval of 5s in $here/prometheus.yml" >&2
  exit 1
}
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
targets=$(grep -o '"127\.0\.0\.1:[0-9]*"' "$here/prometheus.yml" | wc -l)

prometheus --config.file="$work/prometheus.yml" --storage.tsdb.path="$work/data" \
  --web.listen-address="127.0.0.1:$port" >"$work/prometheus.log" 2>&1 &
prometheus_pid=$!
stop() {
  local code=$?
  kill -TERM "$prometheus_pid" 2>/dev/null || true
  wait "$prometheus_pid" 2>/dev/null || true
  if [ $code = 0 ]; then rm -rf "$work"; else echo "prometheus log: $work/prometheus.log" >&2; fi
  exit $code
}
trap stop EXIT
trap 'exit 130' INT TERM
for _ in $(seq 100); do
  curl -fsS -o /dev/null --max-time 1 "http://127.0.0.1:$port/-/ready" 2>/dev/null && break
  kill -0 "$prometheus_pid" 2>/dev/null || { cat "$work/prometheus.log" >&2; echo "error: prometheus exited" >&2; exit 1; }
  sleep 0.1
done
curl -fsS -o /dev/null --max-time 1 "http://127.0.0.1:$port/-/ready" || { echo "error: prometheus not ready on :$port" >&2; exit 1; }
echo "prometheus $(prometheus --version 2>&1 | head -n1 | awk '{print $3}') on 127.0.0.1:$port, $targets targets"

"$here/../local/run.sh" --then python3 "$here/check_dashboard.py" --prometheus "http://127.0.0.1:$port" \
  --dashboard "$here/grafana-dashboard.json" --targets "$targets" \
  --sidecar http://127.0.0.1:19200 --sidecar http://127.0.0.1:19201
