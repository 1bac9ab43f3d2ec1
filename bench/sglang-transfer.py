#!/usr/bin/env python3
"""KV transfer time of real SGLang P/D pairs: over xfer (SGLang's own NIXL transfer backend with
pd_xfer.nixl as NIXL) against Mooncake's TCP transport (SGLang's default), the same model,
servers and prompts in one run.

For each transfer a prefill and a decode SGLang server are started (ci/sglang/engine.sh, the CPU
engine and tiny Llama of ci/sglang/), one pair at a time (an idle SGLang server's event loop
keeps a good part of a core busy, so pairs side by side would measure each other), warmed up
with one P/D request (the bootstrap and the agents' first contact), then every prompt length is
measured --repeat times with fresh prompts (random token ids: neither server has any of them
cached). --rounds repeats that, the pairs' order reversed every other round, so drift over the
run reaches every transfer alike; the figures are over all rounds. One request at a
time, so each prefill's `sglang:kv_transfer_latency_ms` sum grows by that request's transfer
alone: SGLang's own clock on its backend, from the transfer's start to its completion. Beside it,
the P/D request's time: both servers asked at once (as a proxy does) until the decode answers
with its 2 tokens.

    bench/sglang-transfer.py --venv VENV --xfer-site SITE [--lengths 256,1024,1900] [--repeat 9] [--rounds 2]

Writes bench/results/sglang-transfer.{json,md} and updates bench/README.md (bench/update-readme.sh).
"""

import argparse
import os
import random
import statistics
import sys
import threading
import time

from engine_bench import HERE, ROOT, engine, load_now, machine_line, metric, post, stop, write_report

ENGINE = os.path.join(ROOT, "ci", "sglang", "engine.sh")
TRANSFER_SUM = "sglang:kv_transfer_latency_ms_sum"
TRANSFER_COUNT = "sglang:kv_transfer_latency_ms_count"
TRANSFER_MB = "sglang:kv_transfer_total_mb_sum"
# Token ids the tiny Llama's vocabulary holds (as the end-to-end suite draws them).
TOKEN_IDS = range(10, 2010)


def pd_request(prefill, decode, bootstrap_port, ids, room):
    """Sends one P/D request to both servers at once; returns the seconds until the decode's
    answer and its output ids."""
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2, "temperature": 0},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap_port, "bootstrap_room": room}
    answers, errors = {}, []

    def ask(port):
        try:
            answers[port] = post(port, "/generate", body)
        except Exception as error:  # noqa: BLE001 - re-raised below with the server named
            errors.append(f"{port}: {error}")

    started = time.monotonic()
    prefill_call = threading.Thread(target=ask, args=(prefill,))
    prefill_call.start()
    ask(decode)
    took = time.monotonic() - started
    prefill_call.join()
    if errors:
        raise RuntimeError("a P/D request failed: " + "; ".join(errors))
    return took, answers[decode]["output_ids"]


def transfers(prefill):
    """The prefill's transfer count, summed transfer ms and summed MB."""
    return metric(prefill, TRANSFER_COUNT), metric(prefill, TRANSFER_SUM), metric(prefill, TRANSFER_MB)


def measured(prefill, decode, bootstrap_port, ids, room):
    count, total, mb = transfers(prefill)
    took, output = pd_request(prefill, decode, bootstrap_port, ids, room)
    # The prefill counts its transfer when it completes, maybe after the decode answered.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        after_count, after_total, after_mb = transfers(prefill)
        if after_count > count:
            return {"request_s": took, "transfer_ms": after_total - total, "kib": (after_mb - mb) * 1024,
                    "output_ids": output}
        time.sleep(0.02)
    raise RuntimeError("the prefill counted no transfer for a P/D request within 10 s")


def run_transfer(label, transfer_args, args, ports, seed):
    prefill, decode, bootstrap = ports
    names = (f"transfer-prefill-{label}", f"transfer-decode-{label}")
    common = ["--venv", args.venv, *transfer_args]
    try:
        # Both start at once: a start is mostly one Python process importing.
        failed = []

        def start(*engine_args):
            try:
                engine(ENGINE, "start", *engine_args)
            except RuntimeError as error:
                failed.append(error)

        starts = [
            threading.Thread(target=start, args=(names[0], "--role", "prefill", "--port", str(prefill),
                                                 "--bootstrap-port", str(bootstrap), *common)),
            threading.Thread(target=start, args=(names[1], "--role", "decode", "--port", str(decode), *common)),
        ]
        for thread in starts:
            thread.start()
        for thread in starts:
            thread.join()
        if failed:
            raise failed[0]
        rng = random.Random(seed)
        room = rng.randrange(1 << 62)
        measured(prefill, decode, bootstrap, [rng.choice(TOKEN_IDS) for _ in range(64)], room)  # first contact
        figures = {}
        for length in args.lengths:
            samples = []
            for _ in range(args.repeat):
                room += 1
                samples.append(measured(prefill, decode, bootstrap, [rng.choice(TOKEN_IDS) for _ in range(length)],
                                        room))
            figures[length] = samples
            print(f"{label}: {length} tokens: transfer median "
                  f"{statistics.median(s['transfer_ms'] for s in samples):.1f} ms", file=sys.stderr)
        return {"samples": figures, "mb_moved": metric(prefill, TRANSFER_MB)}
    finally:
        for name in names:
            stop(ENGINE, name)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--venv", required=True, help="the real-SGLang venv (ci/sglang/install.sh prints it)")
    parser.add_argument("--xfer-site", required=True, help="the unpacked pd-xfer wheel (bindings/python/build.sh)")
    parser.add_argument("--backends", default="TCP", help="xfer backends to run, comma separated (TCP, UCX)")
    parser.add_argument("--lengths", default="256,1024,1900", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--repeat", default=9, type=int)
    parser.add_argument("--rounds", default=2, type=int)
    parser.add_argument("--port-base", default=28300, type=int)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args()
    load_start = load_now()

    runs = [("mooncake", ["--transfer", "mooncake"])] + [
        (f"xfer-{b.lower()}", ["--transfer", "xfer", "--xfer-site", args.xfer_site, "--xfer-backend", b])
        for b in args.backends.split(",")
    ]
    results = {label: {"samples": {length: [] for length in args.lengths}, "mb_moved": 0.0} for label, _ in runs}
    for round_ in range(args.rounds):
        # Every pair gets the same prompts in a round (the seed), and the order turns around.
        for i, (label, transfer_args) in sorted(enumerate(runs), reverse=round_ % 2 == 1):
            base = args.port_base + 10 * i
            run = run_transfer(label, transfer_args, args, (base, base + 1, base + 2), seed=11 + round_)
            for length in args.lengths:
                results[label]["samples"][length] += run["samples"][length]
            results[label]["mb_moved"] += run["mb_moved"]
    for length in args.lengths:
        outputs = {label: [s["output_ids"] for s in results[label]["samples"][length]] for label in results}
        if len({str(o) for o in outputs.values()}) != 1:
            raise RuntimeError(f"{length} tokens: the transfers' decodes answered differently: {outputs}")

    def median(label, length, field):
        return statistics.median(s[field] for s in results[label]["samples"][length])

    xfers = [label for label in results if label != "mooncake"]
    header = ("| prompt tokens | KV per request (KiB) | transfer: Mooncake TCP (ms) | "
              + " | ".join(f"transfer: {label} (ms) | ratio {label} / Mooncake" for label in xfers)
              + " | P/D request: Mooncake / " + " / ".join(xfers) + " (ms) |")
    lines = [
        f"KV transfer time, real SGLang {os.path.basename(args.venv)} (tiny Llama, CPU engine, page size 1), median "
        f"of {args.repeat} fresh prompts per length in each of {args.rounds} rounds (the pairs' order reversed every "
        "other round), one request at a time; transfer = the prefill's "
        "sglang:kv_transfer_latency_ms for that request (SGLang's own clock on its backend); P/D request = both "
        "servers asked at once until the decode's answer (2 tokens). Every decode answered with the same ids "
        "whatever the transfer.",
        "",
        machine_line("bench/sglang-transfer.py", load_start),
        "",
        header,
        "|---:|---:|---:|" + "---:|---:|" * len(xfers) + "---:|",
    ]
    for length in args.lengths:
        mooncake = median("mooncake", length, "transfer_ms")
        cells = [f"{length}", f"{median('mooncake', length, 'kib'):.0f}", f"{mooncake:.2f}"]
        for label in xfers:
            ours = median(label, length, "transfer_ms")
            cells += [f"{ours:.2f}", f"{ours / mooncake:.2f}" if mooncake > 0 else "–"]
        cells.append(" / ".join(f"{median(label, length, 'request_s') * 1e3:.0f}" for label in ["mooncake", *xfers]))
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("KV the prefills sent (sglang:kv_transfer_total_mb_sum): " + ", ".join(
        f"{label} {results[label]['mb_moved']:.2f} MB" for label in results) + ".")
    for label in results:
        for length in args.lengths:
            for sample in results[label]["samples"][length]:
                sample.pop("output_ids")
    write_report(args.out, "sglang-transfer", {"lengths": args.lengths, "repeat": args.repeat, "results": results},
                 lines)


if __name__ == "__main__":
    main()
