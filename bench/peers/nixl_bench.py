"""Bandwidth of NIXL's own Python agent (nixl-cu12, UCX backend) between two local processes.

Run as two processes sharing a scratch directory (metadata is exchanged through files):
    nixl_bench.py target    --dir D --max-bytes N
    nixl_bench.py initiator --dir D --sizes 65536,1048576 --op read --iters 50 --json out.json
With --window N the initiator keeps N requests in flight (one transfer handle each). It prints one
JSON line per (op, size) with GB/s (10^9 bytes/s) and the p50/p99 latency of one request in
microseconds (from its post to the check that found it done), then tells the target to exit with a notification. Every wait is
bounded (--timeout).
"""

import argparse
import json
import os
import sys
import time

import numpy as np
from nixl_cu12._api import nixl_agent, nixl_agent_config


def wait_for(path, timeout):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            sys.exit(f"timed out waiting for {path}")
        time.sleep(0.01)


def make_agent(name, progress_thread):
    return nixl_agent(name, nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"]))


def target(args):
    agent = make_agent("target", True)
    buf = np.full(args.max_bytes, 0x5A, dtype=np.uint8)
    agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    tmp = os.path.join(args.dir, "target.tmp")
    with open(tmp, "wb") as f:
        f.write(agent.get_agent_metadata())
    with open(os.path.join(args.dir, "target.addr"), "w") as f:
        f.write(str(buf.ctypes.data))
    os.rename(tmp, os.path.join(args.dir, "target.meta"))
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        notifs = agent.get_new_notifs()
        if any(b"done" in m for msgs in notifs.values() for m in msgs):
            return
        time.sleep(0.005)
    sys.exit("target: no 'done' notification before the timeout")


def initiator(args):
    meta_path = os.path.join(args.dir, "target.meta")
    wait_for(meta_path, args.timeout)
    agent = make_agent("initiator", args.progress_thread)
    with open(meta_path, "rb") as f:
        remote = agent.add_remote_agent(f.read())
    with open(os.path.join(args.dir, "target.addr")) as f:
        remote_addr = int(f.read())
    sizes = [int(s) for s in args.sizes.split(",")]
    local = np.zeros(max(sizes), dtype=np.uint8)
    agent.register_memory([(local.ctypes.data, local.nbytes, 0, "")], "DRAM")
    deadline = time.monotonic() + args.timeout
    while not agent.check_remote_metadata(remote):
        if time.monotonic() > deadline:
            sys.exit("initiator: remote metadata not loaded")
        time.sleep(0.01)
    results = []
    for op in args.op.split(","):
        for size in sizes:
            local_descs = agent.get_xfer_descs([(local.ctypes.data, size, 0)], "DRAM")
            remote_descs = agent.get_xfer_descs([(remote_addr, size, 0)], "DRAM")
            # One handle per request in flight (a handle is reposted only once done); all move
            # the same bytes.
            handles = [agent.initialize_xfer(op.upper(), local_descs, remote_descs, remote)
                       for _ in range(args.window)]
            iters = max(3, min(args.iters, (args.max_total << 20) // size))

            def finish(handle):
                until = time.monotonic() + args.timeout
                state = agent.check_xfer_state(handle)
                while state == "PROC":
                    if time.monotonic() > until:
                        sys.exit(f"initiator: {op} {size} timed out")
                    state = agent.check_xfer_state(handle)
                if state != "DONE":
                    sys.exit(f"initiator: {op} {size} failed: {state}")

            def run(count, latencies):
                # Keeps up to --window requests posted, finishing the oldest first.
                in_flight = []
                for i in range(count):
                    if len(in_flight) == args.window:
                        handle, posted = in_flight.pop(0)
                        finish(handle)
                        latencies.append(time.perf_counter() - posted)
                    handle = handles[i % args.window]
                    posted = time.perf_counter()
                    if agent.transfer(handle) == "ERR":
                        sys.exit(f"initiator: {op} {size} could not be posted")
                    in_flight.append((handle, posted))
                for handle, posted in in_flight:
                    finish(handle)
                    latencies.append(time.perf_counter() - posted)

            run(args.warmup, [])
            latencies = []
            start = time.perf_counter()
            run(iters, latencies)
            elapsed = time.perf_counter() - start
            for handle in handles:
                handle.release()
            p50, p99 = np.percentile(latencies, [50, 99]) * 1e6
            row = {"peer": "nixl-ucx", "op": op, "bytes": size, "iters": iters, "window": args.window,
                   "gbps": size * iters / elapsed / 1e9, "p50_us": round(p50, 1), "p99_us": round(p99, 1)}
            print(json.dumps(row), flush=True)
            results.append(row)
    if op == "read" and not (local[: sizes[-1]] == 0x5A).all():
        sys.exit("initiator: READ data mismatch")
    agent.send_notif(remote, b"done")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("role", choices=["target", "initiator"])
    p.add_argument("--dir", required=True)
    p.add_argument("--max-bytes", type=int, default=16 << 20)
    p.add_argument("--sizes", default="65536,1048576,16777216")
    p.add_argument("--op", default="read,write")
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--max-total", type=int, default=512, help="MiB moved per (op, size) at most")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--window", type=int, default=1, help="requests kept in flight")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="initiator: bound on each request; target: on the whole run (until 'done')")
    p.add_argument("--json")
    p.add_argument("--progress-thread", action="store_true",
                   help="initiator: NIXL's progress thread instead of progress on status checks")
    args = p.parse_args()
    target(args) if args.role == "target" else initiator(args)
    sys.stdout.flush()
    # The agents' teardown at interpreter exit has crashed (SIGSEGV) after a complete run; the
    # results are written by now, so leave without it.
    os._exit(0)


if __name__ == "__main__":
    main()
