#!/usr/bin/env python3
"""KV handoff time of real vLLM engines: XferConnector (pd_xfer) against NixlConnector (NIXL),
the same model, engines and prompts in one run.

The handoff time of a request is the time from the prefill engine's answer (max_tokens 1,
do_remote_decode) to the decode engine's first streamed token for the same prompt with the
returned kv_transfer_params, minus the decode's own one-token time for that prompt once its KV
is local (the same prompt sent again, answered from its prefix cache). What remains is the
connector's part: handshake on first contact, pulling the blocks, and telling the engine.

For each connector a prefill and a decode engine are started (ci/vllm/engine.sh, one core
each), warmed up with one P/D request (the handshake), then every prompt length is measured
--repeat times with fresh prompts. NixlConnector runs over UCX's TCP transport
(UCX_TLS=tcp,self) for the like-for-like bar, and once more with UCX's defaults (shared memory
between the two local engines) for reference.

    bench/vllm-handoff.py --venv VENV --xfer-site SITE [--lengths 512,1024,1900] [--repeat 7]

Writes bench/results/vllm-handoff.{json,md} and updates bench/README.md (bench/update-readme.sh).
"""

import argparse
import http.client
import json
import os
import random
import statistics
import sys
import time

from engine_bench import HERE, REQUEST_TIMEOUT, ROOT, engine, load_now, machine_line, metric, post, stop, write_report

ENGINE = os.path.join(ROOT, "ci", "vllm", "engine.sh")
MAX_MODEL_LEN = 2048


def first_token_time(port, body):
    """Sends a streaming completion; returns the monotonic time of its first text chunk."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT)
    try:
        connection.request("POST", "/v1/completions", json.dumps(dict(body, stream=True)),
                           {"content-type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"decode answered {response.status}: {response.read()[:500]!r}")
        first = None
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if first is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                first = time.monotonic()
        if first is None:
            raise RuntimeError("the decode streamed no text")
        return first
    finally:
        connection.close()


def tokens(port, prompt):
    return len(post(port, "/tokenize", {"model": "tiny-llama", "prompt": prompt})["tokens"])


def prompt_of(port, length, rng):
    """A fresh prompt (random words: no engine has any of it cached) of about `length` tokens."""
    words = "kv block cache prefill decode transfer engine token layer head rank node pool".split()
    text = " ".join(rng.choice(words) + str(rng.randrange(1000)) for _ in range(length // 3))
    while tokens(port, text) < length - 8:
        text += " " + " ".join(rng.choice(words) + str(rng.randrange(1000)) for _ in range(16))
    ids = post(port, "/tokenize", {"model": "tiny-llama", "prompt": text})["tokens"][: length - 8]
    return post(port, "/detokenize", {"model": "tiny-llama", "tokens": ids})["prompt"]


def handoff(prefill, decode, prompt):
    base = {"model": "tiny-llama", "prompt": prompt, "temperature": 0}
    answer = post(prefill, "/v1/completions", dict(base, max_tokens=1, kv_transfer_params={
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None}))
    answered = time.monotonic()
    params = answer.get("kv_transfer_params")
    if not params:
        raise RuntimeError(f"the prefill returned no kv_transfer_params: {answer}")
    remote_first = first_token_time(decode, dict(base, max_tokens=2, kv_transfer_params=params)) - answered
    sent = time.monotonic()
    local_first = first_token_time(decode, dict(base, max_tokens=2)) - sent
    return remote_first, local_first


def run_connector(label, connector_args, env_extra, args, ports):
    env = dict(os.environ, **env_extra)
    prefill_port, decode_port = ports
    common = ["--venv", args.venv, "--block-size", "32", *connector_args, "--", "--max-model-len", str(MAX_MODEL_LEN)]
    names = (f"handoff-prefill-{label}", f"handoff-decode-{label}")
    try:
        engine(ENGINE, "start", names[0], "--port", str(prefill_port), "--side-port", str(prefill_port + 1), "--core", "0",
               *common, env=env)
        engine(ENGINE, "start", names[1], "--port", str(decode_port), "--side-port", str(decode_port + 1), "--core", "1",
               *common, env=env)
        rng = random.Random(7)
        handoff(prefill_port, decode_port, prompt_of(decode_port, 64, rng))  # the handshake
        figures = {}
        for length in args.lengths:
            # vLLM on CPU compiles a kernel the first time it meets a batch shape: one untimed
            # request per length (every prompt of a length has the same token count).
            handoff(prefill_port, decode_port, prompt_of(decode_port, length, rng))
            samples = []
            for _ in range(args.repeat):
                remote, local = handoff(prefill_port, decode_port, prompt_of(decode_port, length, rng))
                samples.append({"remote_first_token_s": remote, "local_first_token_s": local,
                                "handoff_s": remote - local})
            figures[length] = samples
            median_ms = statistics.median(s["handoff_s"] for s in samples) * 1e3
            print(f"{label}: {length} tokens: handoff median {median_ms:.1f} ms", file=sys.stderr)
        moved = metric(decode_port, "vllm:nixl_bytes_transferred_sum")
        failed = metric(decode_port, "vllm:nixl_num_failed_transfers_total")
        return {"samples": figures, "bytes_moved": moved, "failed_transfers": failed}
    finally:
        for name in names:
            stop(ENGINE, name, env=env)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--venv", required=True, help="the real-vLLM venv (ci/vllm/install.sh prints it)")
    parser.add_argument("--xfer-site", required=True, help="the unpacked pd-xfer wheel (bindings/python/build.sh)")
    parser.add_argument("--lengths", default="512,1024,1900", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--repeat", default=9, type=int)
    parser.add_argument("--port-base", default=28100, type=int)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args()
    load_start = load_now()

    runs = [
        ("xfer-tcp", ["--connector", "xfer", "--xfer-site", args.xfer_site, "--xfer-backend", "TCP"], {}),
        ("nixl-tcp", ["--connector", "nixl"], {"UCX_TLS": "tcp,self"}),
        ("nixl-default", ["--connector", "nixl"], {}),
    ]
    results = {}
    for i, (label, connector_args, env) in enumerate(runs):
        ports = (args.port_base + 10 * i, args.port_base + 10 * i + 5)
        results[label] = run_connector(label, connector_args, env, args, ports)

    def median_ms(label, length, field="handoff_s"):
        return statistics.median(s[field] for s in results[label]["samples"][length]) * 1e3

    labels = ("xfer-tcp", "nixl-tcp", "nixl-default")
    rows = []
    for length in args.lengths:
        xfer, nixl, nixl_default = (median_ms(label, length) for label in labels)
        firsts = [median_ms(label, length, "remote_first_token_s") for label in labels]
        rows.append((length, xfer, nixl, xfer / nixl if nixl > 0 else float("nan"), nixl_default, *firsts))
    machine = machine_line("bench/vllm-handoff.py", load_start)
    lines = [
        f"KV handoff time, real vLLM {os.path.basename(args.venv)} (tiny Llama, CPU, block size 32), median of "
        f"{args.repeat} fresh prompts per length; handoff = decode's first token after the prefill's answer minus "
        "the decode's own one-token time for the same prompt.",
        "",
        machine,
        "",
        "| prompt tokens | handoff: XferConnector, TCP (ms) | NixlConnector, UCX tcp (ms) | ratio xfer / nixl | "
        "NixlConnector, UCX defaults (ms) | first token after the prefill's answer: xfer TCP / NIXL tcp / NIXL "
        "defaults (ms) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for length, xfer, nixl, ratio, nixl_default, *firsts in rows:
        lines.append(f"| {length} | {xfer:.1f} | {nixl:.1f} | {ratio:.2f} | {nixl_default:.1f} | "
                     + " / ".join(f"{f:.1f}" for f in firsts) + " |")
    lines.append("")
    lines.append("Bytes moved by the decodes (vllm:nixl_bytes_transferred_sum): " + ", ".join(
        f"{label} {results[label]['bytes_moved'] / 1e6:.1f} MB ({int(results[label]['failed_transfers'])} failed)"
        for label in results) + ".")
    write_report(args.out, "vllm-handoff", {"lengths": args.lengths, "repeat": args.repeat, "results": results}, lines)


if __name__ == "__main__":
    main()
