#!/usr/bin/env bash
# The POSIX backend (xfer-posix, example posix_bandwidth) against fio on the same file, buffered
# and O_DIRECT, DRAM→FILE (WRITE) and FILE→DRAM (READ) with 16 MiB blocks. The bar (issue 17):
# xfer ≥ 0.8 × fio sequential write/read on the same file system.
#
# How both sides count (bench/README.md, "POSIX backend against fio"):
#   - one file in DIR, laid out once untimed; every run writes over it in place or reads it;
#   - WRITE includes the closing fsync (fio --end_fsync=1; xfer fsyncs when the request is done);
#   - READ starts with the file's pages dropped from the page cache (fio --invalidate=1; xfer
#     posix_fadvise(DONTNEED)), so buffered reads come from the device too (no root needed);
#   - fio runs twice: psync (its default: one 16 MiB pwrite/pread at a time) and io_uring at
#     --iodepth=$FIO_IODEPTH; the bar is against the better of the two. xfer runs one request of
#     SIZE/16 MiB descriptors with engine=threads and engine=uring (when the kernel allows it);
#   - REPEAT rounds, the tools in a rotating order each round; medians, with min–max beside.
#
# Installs fio when missing (Debian: apt-get install fio, as root or through sudo). Writes
# $OUT/posix-fio.md and $OUT/posix-fio.json (OUT=bench/results by default; then bench/README.md's
# block is updated too, bench/update-readme.sh).
#
#   bench/posix-vs-fio.sh [DIR]                     # DIR: target/posix-vs-fio; 1 GiB, 7 rounds
#   SIZE=512M REPEAT=3 OUT=/tmp/fio bench/posix-vs-fio.sh /mnt/nvme
#   XFER_PARAMS=threads=8,chunk_bytes=16777216 bench/posix-vs-fio.sh   # tuning: added to both engines
set -euo pipefail
cd "$(dirname "$0")/.."

load_start=$(bench/machine.sh --load)
DIR=${1:-target/posix-vs-fio}
SIZE=${SIZE:-1G}
REPEAT=${REPEAT:-7}
FIO_IODEPTH=${FIO_IODEPTH:-8}
XFER_PARAMS=${XFER_PARAMS:-}
OUT=${OUT:-bench/results}
BLOCK=16M
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

if ! command -v fio >/dev/null; then
  echo "fio not found: installing the Debian package" >&2
  as_root=()
  if [ "$(id -u)" != 0 ]; then
    command -v sudo >/dev/null || { echo "fio missing, and neither root nor sudo to install it (apt-get install fio)" >&2; exit 1; }
    as_root=(sudo)
  fi
  "${as_root[@]}" apt-get install -y fio >&2 || { "${as_root[@]}" apt-get update >&2 && "${as_root[@]}" apt-get install -y fio >&2; }
fi

cargo build --quiet --release -p xfer-posix --example posix_bandwidth
BW=${CARGO_TARGET_DIR:-target}/release/examples/posix_bandwidth
mkdir -p "$DIR" "$OUT"
file=$DIR/posix-vs-fio.dat

tools=(fio-psync fio-io_uring xfer-threads)
if "$BW" --dir "$DIR" --size $BLOCK --mode buffered --op write --params engine=uring >/dev/null 2>"$tmp/uring.err"; then
  tools+=(xfer-uring)
  uring_note=""
else
  uring_note=$(tail -n1 "$tmp/uring.err")
  echo "io_uring is not available here, xfer runs with engine=threads only: $uring_note" >&2
fi

# One measurement: prints a JSON object with the tool's MB/s (10^6 bytes/s).
sample() {
  local tool=$1 mode=$2 op=$3 direct
  direct=$([ "$mode" = direct ] && echo 1 || echo 0)
  case $tool in
    fio-*)
      local fsync=()
      [ "$op" = write ] && fsync=(--end_fsync=1)
      fio --name=seq --filename="$file" --rw="$op" --bs=$BLOCK --size="$SIZE" --direct="$direct" \
        --ioengine="${tool#fio-}" --iodepth="$([ "$tool" = fio-psync ] && echo 1 || echo "$FIO_IODEPTH")" \
        --invalidate=1 "${fsync[@]}" --output-format=json |
        python3 -c 'import json, sys; print(json.load(sys.stdin)["jobs"][0][sys.argv[1]]["bw_bytes"] / 1e6)' "$op"
      ;;
    xfer-*)
      "$BW" --file "$file" --size "$SIZE" --block $BLOCK --mode "$mode" --op "$op" --json \
        --params "engine=${tool#xfer-}${XFER_PARAMS:+,$XFER_PARAMS}" |
        python3 -c 'import json, sys; print(json.load(sys.stdin)["mbps"])'
      ;;
  esac
}

echo "== laying out $file ($SIZE)" >&2
fio --name=layout --filename="$file" --rw=write --bs=$BLOCK --size="$SIZE" --end_fsync=1 --output-format=json >/dev/null
: >"$tmp/samples"
for round in $(seq "$REPEAT"); do
  for mode in buffered direct; do
    for op in write read; do
      for i in "${!tools[@]}"; do
        tool=${tools[$(((i + round) % ${#tools[@]}))]}
        mbps=$(sample "$tool" "$mode" "$op")
        echo "   round $round $mode $op $tool: $mbps MB/s" >&2
        echo "$mode $op $tool $mbps" >>"$tmp/samples"
      done
    done
  done
done
rm -f "$file"

fs=$(findmnt -n -o FSTYPE,SOURCE -T "$DIR" | awk '{ printf "%s on %s", $1, $2 }')
machine=$(bench/machine.sh bench/posix-vs-fio.sh "$load_start")
python3 - "$tmp/samples" "$OUT" "$machine" "$fs" "$SIZE" "$REPEAT" "$FIO_IODEPTH" "$XFER_PARAMS" "$(fio --version)" \
  "$uring_note" "${tools[*]}" <<'EOF'
import json
import statistics
import sys

samples, out, machine, fs, size, repeat, depth, params, fio_version, uring_note, tools = sys.argv[1:]
tools = tools.split()
runs = {}
for line in open(samples):
    mode, op, tool, mbps = line.split()
    runs.setdefault((mode, op, tool), []).append(float(mbps))

BAR = 0.8
engines = [t for t in tools if t.startswith("xfer-")]
rows = []
for mode in ("buffered", "direct"):
    for op in ("write", "read"):
        cell = {t: runs.get((mode, op, t), []) for t in tools}
        median = {t: statistics.median(v) for t, v in cell.items() if v}
        fio_best = max(("fio-psync", "fio-io_uring"), key=lambda t: median.get(t, 0))
        row = {"mode": mode, "op": op, "samples_mbps": cell, "median_mbps": median, "fio_best": fio_best}
        row["ratio"] = {t: median[t] / median[fio_best] for t in engines if median.get(fio_best)}
        row["bar_met"] = {t: r >= BAR for t, r in row["ratio"].items()}
        rows.append(row)

meta = {"file_system": fs, "size": size, "block": "16M", "repeat": int(repeat), "fio": fio_version,
        "fio_io_uring_iodepth": int(depth), "xfer_params": params, "bar": BAR,
        "io_uring_unavailable": uring_note or None}
with open(f"{out}/posix-fio.json", "w") as f:
    json.dump({"meta": meta, "rows": rows}, f, indent=1)


def cell(values):
    if not values:
        return "-"
    return f"{statistics.median(values):.0f} ({min(values):.0f}–{max(values):.0f})"


names = {"fio-psync": "fio psync", "fio-io_uring": f"fio io_uring qd{depth}", "xfer-threads": "xfer threads",
         "xfer-uring": "xfer uring"}
extra = f", plus `{params}`" if params else ""
with open(f"{out}/posix-fio.md", "w") as f:
    print(machine, file=f)
    print(file=f)
    print(f"{fs}, one {size} file for every run, 16 MiB blocks; {fio_version}. MB/s = 10^6 bytes/s, median of", file=f)
    print(f"{repeat} round(s) (min–max in brackets), the tools in a rotating order each round. WRITE counts the", file=f)
    print("closing fsync (fio `--end_fsync=1`); READ starts with the file's pages dropped from the page cache", file=f)
    print("(fio `--invalidate=1`, xfer `posix_fadvise(DONTNEED)`). xfer: one request of 16 MiB descriptors, posix", file=f)
    print(f"`engine=threads` or `engine=uring`, the other parameters their defaults{extra}. Bar: xfer ÷ the better", file=f)
    print(f"fio ≥ {BAR}.", file=f)
    if uring_note:
        print(f"io_uring is not available on this machine (xfer threads only): {uring_note}", file=f)
    print(file=f)
    head = ["mode", "op"] + [f"{names[t]} MB/s" for t in tools]
    for t in engines:
        head += [f"{names[t]} ÷ fio", "bar"]
    print("| " + " | ".join(head) + " |", file=f)
    print("|" + "---|" * len(head), file=f)
    for row in rows:
        cells = [row["mode"], row["op"].upper()] + [cell(row["samples_mbps"][t]) for t in tools]
        for t in engines:
            ratio = row["ratio"].get(t)
            cells += ["-", "-"] if ratio is None else [f"{ratio:.2f}", "met" if ratio >= BAR else "missed"]
        print("| " + " | ".join(cells) + " |", file=f)
print(open(f"{out}/posix-fio.md").read())
EOF
echo "wrote $OUT/posix-fio.md $OUT/posix-fio.json" >&2
if [ "$OUT" = bench/results ]; then bench/update-readme.sh; fi
