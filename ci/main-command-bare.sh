#!/usr/bin/env bash
# The README's main command, run the way a new user runs it first: in a mount namespace where
# protoc, the protobuf headers and libzmq (headers, libraries, pkg-config file) are hidden, after
# the build scripts that could use them (etcd-client, zmq-sys, pd-coordinator) are made to run
# again. A default build that needs one of those system packages fails here.
#
#   ci/main-command-bare.sh [extra pdbench cluster flags...]
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${PD_BARE_INSIDE:-}" != 1 ]; then
  # An unprivileged user namespace when not root; as root the namespace keeps uid 0.
  PD_BARE_INSIDE=1 exec unshare --map-root-user --mount bash "$PWD/ci/main-command-bare.sh" "$@"
fi

hide() {
  local path
  for path in "$@"; do
    if [ -d "$path" ]; then
      mount -t tmpfs -o size=1m,ro tmpfs "$path"
    elif [ -e "$path" ]; then
      mount --bind /dev/null "$path"
    else
      continue
    fi
    echo "hidden: $path"
  done
}
shopt -s nullglob
hide $(type -ap protoc) /usr/include/google/protobuf /usr/include/zmq.h /usr/include/zmq_utils.h \
  /usr/lib/*/libzmq.* /usr/lib/*/pkgconfig/libzmq.pc /usr/lib/*/libprotobuf.* /usr/lib/*/libprotoc.*
if protoc --version >/dev/null 2>&1; then
  echo "protoc still runs inside the namespace" >&2
  exit 1
fi
if pkg-config --exists libzmq 2>/dev/null; then
  echo "pkg-config still finds libzmq inside the namespace" >&2
  exit 1
fi

# The README's main command, read from the README so the two cannot drift apart.
main_command=$(awk '/^Main job/ { found = 1 } found && /^```sh$/ { getline; print; exit }' README.md)
if [ -z "$main_command" ]; then
  echo "no main command found in README.md" >&2
  exit 1
fi
cargo clean --release -p etcd-client -p zmq-sys -p pd-coordinator >/dev/null 2>&1 || true
echo "running: $main_command $*"
report=$(mktemp)
trap 'rm -f "$report"' EXIT
bash -c "$main_command \"\$@\"" main "$@" | tee "$report"
grep -q "disaggregated" "$report"
