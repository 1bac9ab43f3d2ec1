#!/usr/bin/env python3
"""Checks the Grafana dashboard against a real Prometheus scraping a running cluster.

Waits (bounded) until every scrape target is up, sends disaggregated requests through the decode
sidecars so the counters and histograms move, then evaluates every expression of the dashboard
through Prometheus's HTTP API until each returns at least one series and no NaN or infinite
value. Exits 1 naming each target down or expression without data at the deadline.

Only the standard library: it runs where python3 does.
"""

import argparse
import json
import math
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

# Grafana's interval variables; the test gives them a window covering the whole run, so that a
# rate sees the scrape taken before the requests and the one after.
INTERVAL_VARIABLES = re.compile(r"\$(?:\{__rate_interval\}|__rate_interval|\{__interval\}|__interval|\{__range\}|__range)")


def get_json(url, timeout=5.0):
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.load(response)


def expressions(dashboard):
    """Every targets[].expr of the dashboard's panels, rows' nested panels included, with its
    panel title."""
    found = []

    def walk(panels):
        for panel in panels:
            for target in panel.get("targets", []):
                if target.get("expr"):
                    found.append((panel.get("title", "?"), target["expr"]))
            walk(panel.get("panels", []))

    walk(dashboard.get("panels", []))
    return found


def wait_targets_up(prometheus, expected, deadline):
    """Waits until `expected` active targets are all up; returns the last target list."""
    while True:
        targets = get_json(f"{prometheus}/api/v1/targets?state=active")["data"]["activeTargets"]
        down = [t for t in targets if t["health"] != "up"]
        if len(targets) == expected and not down:
            return targets
        if time.monotonic() > deadline:
            lines = [f"  {t['labels'].get('job')} {t['scrapeUrl']}: {t['health']} {t.get('lastError', '')}" for t in targets]
            sys.exit(f"error: want {expected} targets up, Prometheus has {len(targets)}, {len(down)} not up:\n" + "\n".join(lines))
        time.sleep(0.5)


def drive_requests(sidecars, per_sidecar):
    """Completions through each decode sidecar, each prompt new from its first word and longer
    than the example coordinator's local-prefill-max-tokens, so each is disaggregated."""
    words = " ".join(f"dash{i % 89}" for i in range(400))
    sent = 0
    for sidecar in sidecars:
        for n in range(per_sidecar):
            body = json.dumps({"model": "sim-model", "prompt": f"observe {sidecar} {n} {time.time()} {words}", "max_tokens": 8})
            request = urllib.request.Request(
                f"{sidecar}/v1/completions", data=body.encode(), headers={"content-type": "application/json"}
            )
            with urllib.request.urlopen(request, timeout=30) as response:
                answer = json.load(response)
            if not answer.get("choices") or "text" not in answer["choices"][0]:
                sys.exit(f"error: no completion from {sidecar}: {answer}")
            sent += 1
    return sent


def evaluate(prometheus, expr):
    """None when the expression returns usable data, else why not."""
    url = f"{prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        answer = get_json(url)
    except urllib.error.HTTPError as e:
        return f"HTTP {e.code}: {e.read().decode(errors='replace')[:300]}"
    if answer.get("status") != "success":
        return f"{answer.get('errorType')}: {answer.get('error')}"
    result = answer["data"]["result"]
    if answer["data"]["resultType"] != "vector" or not result:
        return "no data"
    bad = [r["metric"] for r in result if not math.isfinite(float(r["value"][1]))]
    if bad:
        return f"NaN or infinite in {len(bad)} of {len(result)} series: {bad[:4]}"
    return None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prometheus", required=True, help="Prometheus base URL")
    parser.add_argument("--dashboard", required=True, help="Grafana dashboard JSON")
    parser.add_argument("--targets", type=int, required=True, help="scrape targets expected up")
    parser.add_argument("--sidecar", action="append", required=True, help="decode sidecar base URL (repeat)")
    parser.add_argument("--requests-per-sidecar", type=int, default=2)
    parser.add_argument("--rate-window", default="10m", help="value of $__rate_interval and the like")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds for the targets, then for the data")
    args = parser.parse_args()

    with open(args.dashboard) as f:
        exprs = expressions(json.load(f))
    if not exprs:
        sys.exit(f"error: no expressions in {args.dashboard}")
    queries = []
    for title, expr in exprs:
        query = INTERVAL_VARIABLES.sub(args.rate_window, expr)
        if "$" in query:
            sys.exit(f"error: panel {title!r}: a dashboard variable the test does not know: {expr}")
        queries.append((title, query))

    started = time.monotonic()
    targets = wait_targets_up(args.prometheus, args.targets, started + args.timeout)
    jobs = sorted({t["labels"]["job"] for t in targets})
    print(f"targets up: {len(targets)} ({', '.join(jobs)}) after {time.monotonic() - started:.1f} s")
    sent = drive_requests(args.sidecar, args.requests_per_sidecar)
    print(f"requests: {sent} disaggregated completions through {len(args.sidecar)} decode sidecars")

    deadline = time.monotonic() + args.timeout
    while True:
        failures = [(title, query, why) for title, query in queries if (why := evaluate(args.prometheus, query))]
        if not failures:
            break
        if time.monotonic() > deadline:
            print(f"error: {len(failures)} of {len(queries)} dashboard expressions without data:", file=sys.stderr)
            for title, query, why in failures:
                print(f"  [{title}] {query}\n      {why}", file=sys.stderr)
            sys.exit(1)
        time.sleep(0.5)
    panels = len({title for title, _ in queries})
    print(f"dashboard: all {len(queries)} expressions of {panels} panels return data "
          f"after {time.monotonic() - started:.1f} s")


if __name__ == "__main__":
    main()
