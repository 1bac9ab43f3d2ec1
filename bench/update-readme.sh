#!/usr/bin/env bash
# Copies the generated reports bench/results/NAME.md into bench/README.md, between the markers
# `<!-- results:NAME:begin -->` and `<!-- results:NAME:end -->`. Relative links in a report (its
# plots) are rewritten to point into bench/results/. A block whose report is missing is left as
# it is. The benchmark scripts run this themselves when they write into bench/results/.
# Given a README and a results folder (paths from the current directory, the folder as the
# README links it), it fills that README instead (coordinator/BENCH.md from coordinator/results).
#
#   bench/update-readme.sh [README RESULTS_DIR]
set -euo pipefail
if [ $# -eq 0 ]; then
    cd "$(dirname "$0")"
    set -- README.md results
fi

python3 - "$1" "$2" <<'EOF'
import os
import re
import sys

readme, results = sys.argv[1], sys.argv[2]
with open(readme) as f:
    text = f.read()
block = re.compile(r"(<!-- results:([a-z0-9_-]+):begin -->\n)(.*?)(<!-- results:\2:end -->)", re.S)


def relink(report):
    # ](peers.svg) -> ](results/peers.svg); absolute links and anchors stay.
    return re.sub(r"\]\((?![a-z]+:|/|#)", "](" + results + "/", report)


def fill(m):
    path = os.path.join(results, m.group(2) + ".md")
    if not os.path.exists(path):
        print(f"update-readme: no {path}, block '{m.group(2)}' left as it is", file=sys.stderr)
        return m.group(0)
    with open(path) as f:
        report = f.read().strip("\n")
    print(f"update-readme: {readme} <- {path}", file=sys.stderr)
    return m.group(1) + relink(report) + "\n" + m.group(4)


new = block.sub(fill, text)
if new != text:
    with open(readme, "w") as f:
        f.write(new)
EOF
