"""A GPU KV cache between two processes through ``pd_xfer.nixl`` (cuda_kv.py). It needs torch
with a CUDA device and skips loudly, with the reason, everywhere else (every CI machine);
``ci/gpu-check.sh`` runs it on a GPU machine, where ``XFER_REQUIRE_GPU=1`` makes a skip a
failure."""

import json
import os
import subprocess
import sys

import pytest

import pd_xfer

HERE = os.path.dirname(os.path.abspath(__file__))


def cuda_missing() -> str | None:
    try:
        import torch
    except ImportError as error:
        return f"torch is not importable: {error}"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device"
    return None


# TCP stages GPU memory through CUDA lanes; UCX moves it natively when its build has CUDA and
# stages it otherwise.
BACKENDS = ["TCP"] + (["UCX"] if "ucx" in pd_xfer.Agent.available_backends() else [])


@pytest.mark.parametrize("backend", BACKENDS)
def test_gpu_kv_blocks_read_and_written_between_processes(backend):
    reason = cuda_missing()
    if reason:
        if os.environ.get("XFER_REQUIRE_GPU") == "1":
            pytest.fail(f"XFER_REQUIRE_GPU=1 but {reason}")
        print(f"SKIPPED test_gpu_kv_blocks ({backend}): {reason}", file=sys.__stderr__, flush=True)
        pytest.skip(reason)
    sys.path.insert(0, HERE)
    from cuda_kv import MARK

    run = subprocess.run([sys.executable, os.path.join(HERE, "cuda_kv.py"), backend],
                         capture_output=True, text=True, timeout=300)
    lines = [line for line in run.stdout.splitlines() if line.startswith(MARK)]
    assert run.returncode == 0 and lines, f"exit {run.returncode}\n{run.stdout}\n{run.stderr}"
    record = json.loads(lines[-1][len(MARK):])
    print(f"{backend}: {record}", file=sys.__stderr__, flush=True)
    assert record["read"] == "DONE", record
    assert record["read bytes"], "the blocks read differ from the prefill's"
    assert record["untouched"], "blocks outside the READ's descriptors changed"
    assert record["read to host"] == "DONE" and record["host bytes"], record
    assert record["write"] == "DONE", record
    assert record["intact"], "the prefill's cache differs from what the WRITE should have left"
    assert record["notifs"][0] == "req-1" and record["notifs"][-1] == "written:1,2,40", record["notifs"]
