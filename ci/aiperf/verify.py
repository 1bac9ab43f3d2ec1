"""Checks an aiperf run against a `pdbench cluster --serve` cluster.

    python3 verify.py CLUSTER_JSON AIPERF_ARTIFACT_DIR

From aiperf's per-request records (profile_export.jsonl): some requests succeeded, some were
cancelled, and none failed otherwise. From the cluster's /metrics (engines and sidecars, named in
pdbench's --json report): once the load is gone no engine holds KV blocks for a decode or has a
lease open (polled, bounded), no KV transfer failed, and the sidecars counted no outcome other than
ok and cancelled. Exits non-zero with the reasons otherwise.
"""

import json
import sys
import time
import urllib.request
from pathlib import Path

SETTLE_SECS = 20


def metrics(url):
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
        return r.read().decode()


def total(text, name, label=None):
    """Sum of the samples named `name` (any labels; only those containing `label` if given)."""
    s = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        rest = line[len(name):]
        if rest.startswith("{"):
            labels, _, rest = rest[1:].partition("}")
            if label is not None and label not in labels:
                continue
        elif not rest.startswith(" ") or label is not None:
            continue
        s += float(rest.split()[0])
    return s


def main():
    cluster = json.loads(Path(sys.argv[1]).read_text())
    records = [json.loads(l) for l in (Path(sys.argv[2]) / "profile_export.jsonl").read_text().splitlines() if l]
    problems = []

    ok = [r for r in records if not r.get("error") and not r["metadata"].get("was_cancelled")]
    cancelled = [r for r in records if r["metadata"].get("was_cancelled")]
    failed = [r for r in records if r.get("error") and not r["metadata"].get("was_cancelled")]
    print(f"aiperf: {len(records)} requests: {len(ok)} ok, {len(cancelled)} cancelled, {len(failed)} failed")
    if not ok:
        problems.append("no request succeeded")
    if not cancelled:
        problems.append("no request was cancelled (--request-cancellation-rate had no effect)")
    for r in failed[:5]:
        problems.append(f"request failed: {r['error']}")

    engines = cluster["engines"]
    sidecars = cluster["sidecars"]
    deadline = time.monotonic() + SETTLE_SECS
    while True:
        held = {e["name"]: total(metrics(e["url"]), "pdsim:held_blocks") for e in engines}
        leases = {e["name"]: total(metrics(e["url"]), "pdsim:active_leases") for e in engines}
        busy = {s["url"]: total(metrics(s["url"]), "pd_sidecar_in_flight") for s in sidecars}
        if not any(held.values()) and not any(leases.values()) and not any(busy.values()):
            break
        if time.monotonic() > deadline:
            problems.append(f"after {SETTLE_SECS} s: held blocks {held}, open leases {leases}, in flight {busy}")
            break
        time.sleep(0.5)
    print(f"engines: held blocks {held}, open leases {leases}")

    outcomes = {}
    for s in sidecars:
        text = metrics(s["url"])
        for line in text.splitlines():
            if line.startswith("pd_sidecar_requests_total{"):
                outcome = line.split('outcome="')[1].split('"')[0]
                outcomes[outcome] = outcomes.get(outcome, 0) + float(line.split()[-1])
    released = sum(total(metrics(s["url"]), "pd_sidecar_releases_ok_total") for s in sidecars)
    # A redirected request is counted by the sidecar it entered and by the one that served it.
    print(f"sidecars: requests by outcome {outcomes}; held prefill blocks released early: {released:.0f}")
    for outcome, n in outcomes.items():
        if outcome not in ("ok", "cancelled") and n > 0:
            problems.append(f"sidecars counted {n:.0f} requests with outcome {outcome}")
    failed_transfers = sum(total(metrics(e["url"]), "vllm:nixl_num_failed_transfers_total") for e in engines)
    moved = sum(total(metrics(e["url"]), "vllm:nixl_bytes_transferred_total") for e in engines)
    print(f"engines: {moved / 1e6:.1f} MB of KV moved, {failed_transfers:.0f} failed transfers")
    if failed_transfers:
        problems.append(f"{failed_transfers:.0f} KV transfers failed")
    if not moved:
        problems.append("no KV moved: nothing was disaggregated")

    for p in problems:
        print(f"FAIL: {p}", file=sys.stderr)
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
