"""A GPU KV cache between two processes through ``pd_xfer.nixl`` (cuda_kv.py). It needs torch
with a CUDA device and skips everywhere else with the reason, which `pytest -rs` (ci/test.sh) lists;
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


def require_cuda():
    """Skips without torch and a CUDA device, with the reason; fails instead where
    ``XFER_REQUIRE_GPU=1`` (the GPU check)."""
    reason = cuda_missing()
    if reason:
        if os.environ.get("XFER_REQUIRE_GPU") == "1":
            pytest.fail(f"XFER_REQUIRE_GPU=1 but {reason}")
        pytest.skip(reason)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gpu_kv_blocks_read_and_written_between_processes(backend):
    require_cuda()
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


@pytest.mark.parametrize("backend", ["GDS", "POSIX"])
def test_gpu_kv_blocks_to_a_file_and_back(backend, tmp_path):
    """KV offload to storage as NIXL's GDS and POSIX plugins are used: GPU blocks WRITTEN to a
    registered file in reversed order (the agent names itself as the file list's remote
    agent), then READ back into other GPU memory; GDS through cuFile, POSIX staged through
    host memory."""
    require_cuda()
    import time

    import torch

    from pd_xfer.nixl import nixl_agent, nixl_agent_config

    agent = nixl_agent(f"files-{backend}", nixl_agent_config(backends=[backend]))
    blocks, block = 64, 256 * 1024
    size = blocks * block
    source = torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda")
    back = torch.zeros(size, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    path = tmp_path / "kv.bin"
    with open(path, "wb") as f:
        f.truncate(size)
    fd = os.open(path, os.O_RDWR)
    try:
        device = source.device.index
        for tensor in (source, back):
            agent.register_memory([(tensor.data_ptr(), size, device, "")], "VRAM")
        agent.register_memory([(0, size, fd, str(path))], "FILE")
        file_side = agent.prep_xfer_dlist(agent.name, [(i * block, block, fd) for i in range(blocks)], "FILE")
        for op, tensor in (("WRITE", source), ("READ", back)):
            local = agent.prep_xfer_dlist(
                "NIXL_INIT_AGENT", [(tensor.data_ptr() + i * block, block, device) for i in range(blocks)], "VRAM"
            )
            started = time.perf_counter()
            handle = agent.make_prepped_xfer(op, local, list(range(blocks)), file_side, list(reversed(range(blocks))))
            state = agent.transfer(handle)
            deadline = time.monotonic() + 60
            while state == "PROC" and time.monotonic() < deadline:
                state = agent.check_xfer_state(handle)
            seconds = time.perf_counter() - started
            assert state == "DONE", f"{op}: {state}"
            assert agent.query_xfer_backend(handle) == backend
            agent.release_xfer_handle(handle)
            print(f"{backend} {op} VRAM↔FILE: {size / seconds / 1e9:.2f} GB/s", file=sys.__stderr__, flush=True)
        torch.cuda.synchronize()
        assert torch.equal(back, source), "the blocks read back from the file differ"
        on_disk = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)
        assert torch.equal(on_disk[:block], source[size - block:].cpu()), "the file's first block is not the last one written"
    finally:
        os.close(fd)
