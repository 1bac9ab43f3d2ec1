"""SGLang's HiCache NIXL storage backend over pd_xfer: sglang_hicache.py runs SGLang's own
``HiCacheNixl`` with real host KV pools, its files through pd_xfer's POSIX backend, in the
SGLang venv (``PD_SGLANG_VENV``; ci/test.sh's SGLang step sets it). Without that venv this test
skips, saying so."""

import json
import os
import subprocess
import sys

import pytest

import pd_xfer

HERE = os.path.dirname(os.path.abspath(__file__))
LAYOUTS = ("layer_first", "page_first", "page_first_direct")


def test_sglang_hicache_stores_and_loads_pages_through_pd_xfer():
    venv = os.environ.get("PD_SGLANG_VENV", "")
    if not venv:
        pytest.skip(
            "PD_SGLANG_VENV is not set: this runs SGLang's HiCacheNixl in the SGLang venv "
            "(ci/test.sh's SGLang step; PD_SGLANG_VENV=$(ci/sglang/install.sh | tail -n1))"
        )
    python = os.path.join(venv, "bin", "python")
    assert os.path.exists(python), f"PD_SGLANG_VENV has no bin/python: {python}"
    # The pd_xfer this test imported, for the SGLang venv too.
    site = os.path.dirname(os.path.dirname(os.path.abspath(pd_xfer.__file__)))
    env = dict(os.environ, PYTHONPATH=site)
    out = subprocess.run(
        [python, os.path.join(HERE, "sglang_hicache.py")], capture_output=True, text=True, timeout=300, env=env
    )
    assert out.returncode == 0, f"sglang_hicache.py failed:\n{out.stderr[-4000:]}"
    lines = [line[2:] for line in out.stdout.splitlines() if line.startswith("@@")]
    assert lines, f"no record: {out.stdout[-2000:]}"
    seen = json.loads(lines[-1])
    print(json.dumps(seen, indent=1), file=sys.stderr)
    for layout in LAYOUTS:
        runs = {name: run for name, run in seen.items() if name.startswith(f"{layout} ")}
        assert runs, f"{layout} did not run: {sorted(seen)}"
        for name, run in runs.items():
            # Files named by path (NIXL's path mode, which SGLang probes for), none left open;
            # zero copy (a K and a V file per page) where the layout allows it.
            assert run["path_mode"] is True and run["left_open"] == 0, (name, run)
            assert run["zero_copy"] is (layout != "layer_first"), (name, run)
            assert run["files"] == run["pages"] * (2 if run["zero_copy"] else 1), (name, run)
            assert run["missing_batch"][-1] is False, (name, run)
