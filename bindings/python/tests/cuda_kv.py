"""A KV cache in GPU memory moved between two processes through ``pd_xfer.nixl`` the way vLLM's
NixlConnector moves it: per-layer cache tensors registered as VRAM, block descriptors prepared
on both sides, the decode side READs chosen prefill blocks with a notification, then WRITEs
blocks back. test_cuda_kv.py runs it; it needs torch with a CUDA device.

    python cuda_kv.py BACKEND            # the decode side: prints its record (@@JSON)
    python cuda_kv.py BACKEND --target   # the prefill side, started by the decode side
"""

import os
import subprocess
import sys
import time

import numpy
import torch

from nixl_calls import MARK, emit, read_emitted
from pd_xfer.nixl import nixl_agent, nixl_agent_config

LAYERS = 4
BLOCKS = 64
BLOCK = 256 * 1024 + 512  # not a power of two: the staging slots' edges fall inside blocks
WAIT_S = 60


def pattern(layer: int, seed: int) -> torch.Tensor:
    """Layer ``layer``'s cache as the prefill computes it (seed 0) or as the decode writes it back
    (seed 1), made on the GPU."""
    n = torch.arange(BLOCKS * BLOCK, dtype=torch.int64, device="cuda")
    return ((n * (7 + 4 * seed) + 13 * layer + seed) % 251).to(torch.uint8).view(BLOCKS, BLOCK)


def caches(fill: bool) -> list[torch.Tensor]:
    if fill:
        return [pattern(layer, 0) for layer in range(LAYERS)]
    return [torch.zeros(BLOCKS, BLOCK, dtype=torch.uint8, device="cuda") for _ in range(LAYERS)]


def block_descs(tensors: list[torch.Tensor]) -> list[tuple[int, int, int]]:
    """Every block of every layer, layer-major, as vLLM lists them."""
    return [(t.data_ptr() + b * BLOCK, BLOCK, t.device.index) for t in tensors for b in range(BLOCKS)]


def new_agent(name: str, backend: str, tensors: list[torch.Tensor]):
    agent = nixl_agent(name, nixl_agent_config(backends=[backend]))
    regions = [(t.data_ptr(), t.nbytes, t.device.index, "") for t in tensors]
    agent.register_memory(agent.get_reg_descs(regions, "VRAM"), backends=[backend])
    return agent


def wait_notifs(agent, last_prefix: str) -> list[str]:
    """Notifications in order of arrival, until one starts with ``last_prefix`` (bounded)."""
    received = []
    deadline = time.monotonic() + WAIT_S
    while not any(m.startswith(last_prefix) for m in received) and time.monotonic() < deadline:
        for messages in agent.get_new_notifs().values():
            received += [m.decode() for m in messages]
        time.sleep(0.005)
    return received


def target(backend: str):
    tensors = caches(fill=True)
    torch.cuda.synchronize()
    agent = new_agent("prefill", backend, tensors)
    emit({"metadata": agent.get_agent_metadata().hex(), "blocks": block_descs(tensors)})
    notifs = wait_notifs(agent, "written:")
    torch.cuda.synchronize()
    written = [int(b) for m in notifs if m.startswith("written:") for b in m.split(":")[1].split(",")]
    # Blocks the decode wrote hold its pattern; every other block is untouched.
    intact = all(
        torch.equal(tensors[layer][b], pattern(layer, 1 if b in written else 0)[b])
        for layer in range(LAYERS)
        for b in range(BLOCKS)
    )
    emit({"notifs": notifs, "intact": intact})


def transfer(agent, op, local_side, local_ids, remote_side, remote_ids, notif):
    handle = agent.make_prepped_xfer(op, local_side, local_ids, remote_side, remote_ids, notif_msg=notif)
    state = agent.transfer(handle)
    deadline = time.monotonic() + WAIT_S
    while state == "PROC" and time.monotonic() < deadline:
        state = agent.check_xfer_state(handle)
    agent.release_xfer_handle(handle)
    return state


def decode(backend: str) -> dict:
    peer = subprocess.Popen([sys.executable, __file__, backend, "--target"], stdout=subprocess.PIPE, text=True)
    try:
        hello = read_emitted(peer.stdout)
        record = run_decode(backend, bytes.fromhex(hello["metadata"]), hello["blocks"])
        record.update(read_emitted(peer.stdout))
        peer.wait(timeout=WAIT_S)
        return record
    finally:
        if peer.poll() is None:
            peer.kill()


def run_decode(backend: str, metadata: bytes, remote_blocks: list) -> dict:
    record = {}
    tensors = caches(fill=False)
    agent = new_agent("decode", backend, tensors)
    host = numpy.zeros(BLOCKS * BLOCK, dtype=numpy.uint8)
    agent.register_memory(agent.get_reg_descs([(host.ctypes.data, host.nbytes, 0, "")], "DRAM"))
    remote = agent.add_remote_agent(metadata)
    local_side = agent.prep_xfer_dlist("NIXL_INIT_AGENT", agent.get_xfer_descs(block_descs(tensors), "VRAM"))
    host_blocks = [(host.ctypes.data + b * BLOCK, BLOCK, 0) for b in range(BLOCKS)]
    host_side = agent.prep_xfer_dlist("NIXL_INIT_AGENT", agent.get_xfer_descs(host_blocks, "DRAM"))
    remote_side = agent.prep_xfer_dlist(remote, agent.get_xfer_descs([tuple(b) for b in remote_blocks], "VRAM"))

    # READ: each layer's prefill blocks, scattered and reversed, into the decode's first blocks.
    chosen = [b for b in range(BLOCKS - 1, -1, -3)]
    remote_ids = [layer * BLOCKS + b for layer in range(LAYERS) for b in chosen]
    local_ids = [layer * BLOCKS + i for layer in range(LAYERS) for i in range(len(chosen))]
    started = time.perf_counter()
    record["read"] = transfer(agent, "READ", local_side, local_ids, remote_side, remote_ids, b"req-1")
    seconds = time.perf_counter() - started
    torch.cuda.synchronize()
    record["read MB/s"] = round(len(remote_ids) * BLOCK / seconds / 1e6, 1)
    record["read bytes"] = all(
        torch.equal(tensors[layer][i], pattern(layer, 0)[b])
        for layer in range(LAYERS)
        for i, b in enumerate(chosen)
    )
    record["untouched"] = all(
        not tensors[layer][len(chosen):].any().item() for layer in range(LAYERS)
    )

    # GPU memory of the peer into host memory here.
    record["read to host"] = transfer(agent, "READ", host_side, list(range(BLOCKS)), remote_side,
                                      list(range(BLOCKS, 2 * BLOCKS)), b"")
    record["host bytes"] = bool(numpy.array_equal(host, pattern(1, 0).flatten().cpu().numpy()))

    # WRITE: the decode's blocks of its own pattern into prefill blocks 1, 2 and 40 of every layer.
    written = [1, 2, 40]
    for layer in range(LAYERS):
        tensors[layer][written] = pattern(layer, 1)[written]
    torch.cuda.synchronize()
    ids = [layer * BLOCKS + b for layer in range(LAYERS) for b in written]
    notif = ("written:" + ",".join(map(str, written))).encode()
    record["write"] = transfer(agent, "WRITE", local_side, ids, remote_side, ids, notif)
    return record


if __name__ == "__main__":
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    backend = sys.argv[1]
    if "--target" in sys.argv:
        target(backend)
    else:
        emit(decode(backend))
    sys.stdout.flush()
    os._exit(0)
