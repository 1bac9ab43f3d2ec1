# Supervision of one engine instance in its own session (process group), shared by
# ci/vllm/engine.sh and ci/sglang/engine.sh. Source it, then call
# `engine_dispatch USAGE_FN RUN_DIR "$@"` (or `engine_init NAME RUN_DIR` directly).
#
#   engine_dispatch USAGE_FN RUN_DIR CMD NAME ...
#                                     # the scripts' shared `CMD NAME` front: `stop` and `status`
#                                     # are done here (and exit); `start` and `run` return with
#                                     # engine_cmd set and the instance initialised; anything
#                                     # else calls USAGE_FN
#   engine_alive                      # the instance's group exists
#   engine_stop                       # SIGTERM to the group, SIGKILL after 15 s
#   engine_start URL TIMEOUT CMD...   # starts CMD in a new session, waits (bounded) for URL
#
# `engine_start` writes RUN_DIR/NAME.pid (the group id) and RUN_DIR/NAME.log; when the instance
# exits during start or URL does not answer within TIMEOUT seconds it stops the group, prints
# the log's tail and returns 1.

engine_init() {
  engine_name="$1" engine_run_dir="$2"
  [[ "$engine_name" =~ ^[A-Za-z0-9_.-]+$ ]] || { echo "bad instance name: $engine_name" >&2; exit 2; }
  pid_file="$engine_run_dir/$engine_name.pid"
  log_file="$engine_run_dir/$engine_name.log"
}

engine_dispatch() {
  local usage_fn="$1" run_dir="$2"
  shift 2
  (($# >= 2)) || "$usage_fn"
  engine_cmd="$1"
  engine_init "$2" "$run_dir"
  case "$engine_cmd" in
    stop) engine_stop; exit 0 ;;
    status)
      if engine_alive; then echo "$engine_name: running (pgid $(cat "$pid_file"))"; exit 0; fi
      echo "$engine_name: not running"
      exit 1 ;;
    start|run) ;;
    *) "$usage_fn" ;;
  esac
}

engine_alive() { [ -f "$pid_file" ] && kill -0 -- "-$(cat "$pid_file")" 2>/dev/null; }

engine_stop() {
  if ! [ -f "$pid_file" ]; then
    echo "$engine_name: not running" >&2
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
      echo "$engine_name: still running after 15 s, SIGKILL" >&2
      kill -KILL -- "-$pgid" 2>/dev/null || true
    fi
  fi
  rm -f "$pid_file"
  echo "$engine_name: stopped" >&2
}

engine_start() {
  local url="$1" timeout="$2"
  shift 2
  mkdir -p "$engine_run_dir"
  if engine_alive; then
    echo "$engine_name: already running (pgid $(cat "$pid_file")); stop it first" >&2
    return 1
  fi
  local start deadline
  start=$(date +%s)
  # The engine's new session writes its own group id: `$!` is not it when setsid has to fork (it
  # does when it starts as a process group leader), and a wrong id made `start` report a running
  # engine as exited and leave it behind, its worker busy on a core.
  rm -f "$pid_file"
  setsid bash -c 'echo $$ >"$0"; exec "$@"' "$pid_file" "$@" >"$log_file" 2>&1 </dev/null &
  for _ in $(seq 1 100); do
    [ -s "$pid_file" ] && break
    sleep 0.05
  done
  [ -s "$pid_file" ] || { echo "$engine_name: the engine's session did not start" >&2; return 1; }
  trap 'echo "$engine_name: start interrupted" >&2; engine_stop; exit 130' INT TERM
  deadline=$((start + timeout))
  until curl -fsS -m 2 "$url" >/dev/null 2>&1; do
    if ! engine_alive; then
      echo "$engine_name: exited during start; last log lines ($log_file):" >&2
      tail -n 40 "$log_file" >&2
      rm -f "$pid_file"
      return 1
    fi
    if (($(date +%s) >= deadline)); then
      echo "$engine_name: no answer from $url within ${timeout} s; last log lines ($log_file):" >&2
      tail -n 40 "$log_file" >&2
      engine_stop
      return 1
    fi
    sleep 1
  done
  echo "$engine_name: healthy at $url after $(($(date +%s) - start)) s (pgid $(cat "$pid_file"), log $log_file)" >&2
}
