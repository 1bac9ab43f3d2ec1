"""Merges the comparison's result rows and prints ours ÷ each peer as a markdown table, then the
latency of one request (p50/p99) of those that measure it.

Inputs: xferbench --json arrays and JSON-lines files of rows {backend, op, block_size, gbps} (with
p50_us and p99_us where measured). Writes the merged rows (--json) and the markdown report
(--markdown); prints the report.

With --pipelined the rows are a sweep of settings (each peer row names its own in "settings"; ours
carry window and threads): the report keeps each tool's best row per (op, size), gives ours ÷ each
peer's best and whether it meets the bar (BAR), and --json holds those best rows.
"""

import argparse
import json
import os
import platform
from datetime import datetime, timezone

OURS, RAW = "tcp", "raw-tcp"
PEERS = [(RAW, "raw TCP"), ("nixl-ucx-tcp", "NIXL (UCX tcp)"), ("mooncake-tcp", "Mooncake (tcp)"),
         ("iperf3-stream", "iperf3 stream")]
PIPELINED_PEERS = PEERS[1:]
# Ours ÷ each peer's best, pipelined.
BAR = 1.2
# Those whose rows carry per-request latency.
TIMED = [(OURS, "ours"), (RAW, "raw TCP"), ("nixl-ucx-tcp", "NIXL (UCX tcp)")]


def load(path):
    with open(path) as f:
        text = f.read().strip()
    if text.startswith("["):
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def size_label(n):
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def machine():
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    when = f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC"
    return f"Generated on {when}. Machine: {cpu}, {os.cpu_count()} CPUs, {mem_gib:.1f} GiB memory, Linux {platform.release()}."


def settings(row):
    if "settings" in row:
        return row["settings"]
    streams = f", {row['streams']} streams" if "streams" in row else ""
    return f"window {row.get('window', 1)}, {row.get('threads', 1)} thread(s){streams}"


def best_rows(rows):
    """The fastest row of each (backend, op, block_size), with its settings spelled out."""
    best = {}
    for row in rows:
        key = (row["backend"], row["op"], int(row["block_size"]))
        if key not in best or float(row["gbps"]) > float(best[key]["gbps"]):
            best[key] = dict(row, settings=settings(row))
    return best


def tried(rows):
    """How many settings each tool ran per (op, size), e.g. `ours 6, Mooncake (tcp) 4-6`."""
    counts = {}
    for row in rows:
        cell = counts.setdefault(row["backend"], {}).setdefault((row["op"], int(row["block_size"])), set())
        cell.add(settings(row))
    parts = []
    for backend, label in [(OURS, "ours")] + PIPELINED_PEERS:
        sizes = [len(cell) for cell in counts.get(backend, {}).values()]
        if sizes:
            low, high = min(sizes), max(sizes)
            parts.append(f"{label} {low}" if low == high else f"{label} {low}-{high}")
    return ", ".join(parts)


def pipelined(rows, machine_line):
    best = best_rows(rows)
    sizes = sorted({size for backend, _, size in best if backend == OURS})
    head = ["op", "size", "ours GB/s (settings)"]
    for _, label in PIPELINED_PEERS:
        head += [f"{label} best GB/s (settings)", f"ours ÷ {label}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    met = total = 0
    for op in ("read", "write"):
        for size in sizes:
            ours = best.get((OURS, op, size))
            if ours is None:
                continue
            cells = [op.upper(), size_label(size), f"{ours['gbps']:.3f} ({ours['settings']})"]
            for backend, _ in PIPELINED_PEERS:
                peer = best.get((backend, op, size))
                if not peer or not float(peer["gbps"]):
                    cells += ["-", "-"]
                    continue
                value = ours["gbps"] / float(peer["gbps"])
                total += 1
                met += value >= BAR
                verdict = "met" if value >= BAR else "missed"
                cells += [f"{float(peer['gbps']):.3f} ({peer['settings']})", f"{value:.2f} {verdict}"]
            lines.append("| " + " | ".join(cells) + " |")
    repeat = max((int(r.get("repeat", 1)) for r in rows), default=1)
    report = "\n".join([
        machine_line,
        "",
        "Two processes on loopback, many requests in flight, each tool at the best of a short sweep of its own",
        f"settings; each setting's figure is the median of {repeat} run(s); GB/s = 10^9 bytes/s. Ours: xferbench",
        "--backend tcp, --params streams= x --window x --threads. NIXL 1.5.1 Python agent: UCX_TLS=tcp, one thread, a window of",
        "transfer handles. Mooncake transfer_engine_bench: protocol tcp, --batch_size x --threads where",
        "batch x block x threads fits its buffer. iperf3: -P streams of writes of the block size (at most",
        "1 MiB, one buffer written over and over, so it stays in the caches; the others move a block of",
        "their own per request in flight), READ with -R. Settings tried per cell: " + tried(rows) + ".",
        f"Bar: ours ≥ {BAR} × each peer's best; met in {met} of {total} cells.",
        "",
        *lines,
        "",
        "![GB/s by block size, best settings](peers-pipelined.svg)",
        "",
    ])
    return list(best.values()), report


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("inputs", nargs="+")
    p.add_argument("--json", required=True)
    p.add_argument("--markdown", required=True)
    p.add_argument("--machine", help="the report's first line: script, date, commit, machine (bench/machine.sh)")
    p.add_argument("--pipelined", action="store_true", help="rows of a settings sweep: report each tool's best")
    p.add_argument("--ours-params", default="", help="the backend parameters ours ran with (xferbench --params)")
    args = p.parse_args()
    rows = [row for path in args.inputs for row in load(path)]
    if args.pipelined:
        best, report = pipelined(rows, args.machine or machine())
        with open(args.json, "w") as f:
            json.dump(best, f, indent=1)
        with open(args.markdown, "w") as f:
            f.write(report)
        print(report)
        return
    with open(args.json, "w") as f:
        json.dump(rows, f, indent=1)
    gbps = {(r["backend"], r["op"], int(r["block_size"])): float(r["gbps"]) for r in rows}
    latency = {(r["backend"], r["op"], int(r["block_size"])): (float(r["p50_us"]), float(r["p99_us"]))
               for r in rows if "p50_us" in r and "p99_us" in r}
    sizes = sorted({int(r["block_size"]) for r in rows if r["backend"] == OURS})
    head = ["op", "size", "ours GB/s"]
    for _, label in PEERS:
        head += [f"{label} GB/s", f"ours ÷ {label}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for op in ("read", "write"):
        for size in sizes:
            ours = gbps.get((OURS, op, size))
            if ours is None:
                continue
            cells = [op.upper(), size_label(size), f"{ours:.3f}"]
            for backend, _ in PEERS:
                peer = gbps.get((backend, op, size))
                cells += ["-", "-"] if not peer else [f"{peer:.3f}", f"{ours / peer:.2f}"]
            lines.append("| " + " | ".join(cells) + " |")
    head = ["op", "size"] + [f"{label} p50 / p99 µs" for _, label in TIMED]
    latency_lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for op in ("read", "write"):
        for size in sizes:
            cells = [op.upper(), size_label(size)]
            for backend, _ in TIMED:
                pair = latency.get((backend, op, size))
                cells.append("-" if pair is None else f"{pair[0]:.1f} / {pair[1]:.1f}")
            latency_lines.append("| " + " | ".join(cells) + " |")
    repeat = max((int(r.get("repeat", 1)) for r in rows), default=1)
    report = "\n".join([
        args.machine or machine(),
        "",
        "Two processes on loopback, one request of one block in flight, placement left to the scheduler;",
        f"median of {repeat} run(s) per cell; GB/s = 10^9 bytes/s. Peers: NIXL 1.5.1 Python agent (nixl-cu12, UCX backend,",
        "UCX_TLS=tcp), Mooncake transfer_engine_bench 0.3.13 (protocol tcp, 1 thread, batch 1), iperf3 (one stream,",
        "writes of the block size: a streaming ceiling, not a request/response transfer). Ours: xferbench",
        "--backend tcp (default 2 streams" + (f"; --params {args.ours_params}" if args.ours_params else "")
        + "); raw TCP: xferbench's request/ack baseline between the same processes (blocking reads, no polling).",
        "",
        *lines,
        "",
        "Latency of one request (µs, from posting to completion; the run whose GB/s is the median,",
        "for NIXL the median of the runs' quantiles):",
        "",
        *latency_lines,
        "",
        "![GB/s by block size](peers.svg)",
        "",
    ])
    with open(args.markdown, "w") as f:
        f.write(report)
    print(report)


if __name__ == "__main__":
    main()
