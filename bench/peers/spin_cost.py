"""What the TCP backend's busy-polling (`spin_us`) buys and costs, one request in flight.

For each spin_us, a target process (xferbench --target) and an initiator process
(xferbench --connect) on loopback, both with that spin_us; for each size and op the initiator
runs twice, BASE and BASE + ITERS requests, and the difference of the two runs gives per
request: the CPU time of the initiator process (its rusage), of the target process (its
/proc/PID/stat, all threads) and their sum, beside the larger run's GB/s and p50/p99 latency.
The differences cancel process start-up, connection and registration. Runs of the spin values
alternate, and each figure is the median of --repeat rounds. Writes OUT/spin.{md,json} (OUT is
bench/results by default; then bench/README.md's block is updated too, bench/update-readme.sh).
Run from the repository root, after a release build of xferbench.

    python3 bench/peers/spin_cost.py --spins 0,20,50,100
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

TICKS = os.sysconf("SC_CLK_TCK")


def parse_size(text):
    units = {"K": 1 << 10, "M": 1 << 20}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def process_cpu_s(pid):
    """User + system CPU seconds of every thread of a running process."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


class Target:
    def __init__(self, xferbench, spin, max_bytes, timeout):
        args = [xferbench, "--target", "--backend", "tcp", "--params", f"spin_us={spin}",
                "--mem", str(max_bytes), "--max-mem", str(max_bytes)]
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline().split()
        if len(line) != 3 or line[0] != "READY":
            self.stop()
            sys.exit(f"target (spin_us={spin}) did not start: {line}")
        self.side = line[1]
        self.timeout = timeout

    def cpu(self):
        return process_cpu_s(self.proc.pid)

    def stop(self):
        self.proc.stdin.close()
        try:
            self.proc.wait(self.timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def initiator(xferbench, target, spin, op, size, iters, timeout):
    """One initiator run: (its CPU seconds, the target's CPU seconds, the JSON row)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        args = [xferbench, "--backend", "tcp", "--params", f"spin_us={spin}", "--connect", target.side,
                "--op", op, "--block-sizes", str(size), "--iters", str(iters), "--warmup", "0",
                "--no-progress", "--json", out.name]
        before = target.cpu()
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL)
        # wait4 for the child's own rusage (timeout-bounded by xferbench's own request bound).
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            sys.exit(f"xferbench {' '.join(args[1:])} failed ({status})")
        target_cpu = target.cpu() - before
        rows = json.load(open(out.name))
    return usage.ru_utime + usage.ru_stime, target_cpu, rows[0]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--xferbench", default="target/release/xferbench")
    p.add_argument("--spins", default="0,50")
    p.add_argument("--sizes", default="4K,16K,64K")
    p.add_argument("--ops", default="read,write")
    p.add_argument("--base", type=int, default=1000)
    p.add_argument("--iters", type=int, default=10000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--out", default="bench/results")
    args = p.parse_args()
    load_start = subprocess.run(["bench/machine.sh", "--load"], capture_output=True, text=True,
                                check=True).stdout.strip()
    spins = [int(s) for s in args.spins.split(",")]
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    ops = args.ops.split(",")
    samples = {}
    for _ in range(args.repeat):
        for spin in spins:
            target = Target(args.xferbench, spin, max(sizes), args.timeout)
            try:
                for size in sizes:
                    for op in ops:
                        small = initiator(args.xferbench, target, spin, op, size, args.base, args.timeout)
                        large = initiator(args.xferbench, target, spin, op, size, args.base + args.iters,
                                          args.timeout)
                        row = large[2]
                        sample = {
                            "initiator_us": (large[0] - small[0]) / args.iters * 1e6,
                            "target_us": (large[1] - small[1]) / args.iters * 1e6,
                            "gbps": row["gbps"], "p50_us": row["p50_us"], "p99_us": row["p99_us"],
                        }
                        sample["both_us"] = sample["initiator_us"] + sample["target_us"]
                        samples.setdefault((spin, op, size), []).append(sample)
                        print(json.dumps({"spin_us": spin, "op": op, "block_size": size, **sample}), flush=True)
            finally:
                target.stop()
    rows = []
    for (spin, op, size), runs in samples.items():
        keys = runs[0].keys()
        rows.append({"spin_us": spin, "op": op, "block_size": size, "repeat": len(runs),
                     **{k: statistics.median(r[k] for r in runs) for k in keys}})
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "spin.json"), "w") as f:
        json.dump(rows, f, indent=1)
    head = ["op", "size", "spin_us", "GB/s", "p50 µs", "p99 µs", "initiator CPU µs/req", "target CPU µs/req",
            "both µs/req"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for op in ops:
        for size in sizes:
            for spin in spins:
                r = next(r for r in rows if (r["spin_us"], r["op"], r["block_size"]) == (spin, op, size))
                lines.append(f"| {op.upper()} | {size >> 10}K | {spin} | {r['gbps']:.3f} | {r['p50_us']:.1f} | "
                             f"{r['p99_us']:.1f} | {r['initiator_us']:.1f} | {r['target_us']:.1f} | {r['both_us']:.1f} |")
    machine = subprocess.run(["bench/machine.sh", "bench/peers/spin_cost.py", load_start], capture_output=True,
                             text=True, check=True).stdout.strip()
    report = "\n".join([
        machine,
        "",
        "TCP backend, two processes on loopback, one request of one block in flight, both sides with the",
        f"same spin_us; CPU per request from the difference of runs of {args.base} and {args.base + args.iters}",
        f"requests (user + system, all threads of each process); median of {args.repeat} alternating round(s).",
        "",
        *lines,
        "",
    ])
    with open(os.path.join(args.out, "spin.md"), "w") as f:
        f.write(report)
    print(report)
    if args.out == "bench/results":
        subprocess.run(["bench/update-readme.sh"], check=True)


if __name__ == "__main__":
    main()
