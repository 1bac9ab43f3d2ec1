"""The calls vLLM's NixlConnector makes on a NIXL agent, made by two processes, with what each
call returned or raised written down as JSON. test_nixl_conformance.py runs it once with NIXL's
own ``nixl._api`` and once with ``pd_xfer.nixl`` and compares the two records.

    python nixl_calls.py IMPL BACKEND            # the decode side: prints the record (@@JSON)
    python nixl_calls.py IMPL BACKEND --target   # the prefill side, started by the decode side

IMPL is ``nixl`` or ``pd_xfer``; BACKEND a NIXL backend name (``UCX``, ``TCP``).
"""

import json
import os
import subprocess
import sys
import time

import numpy

BLOCK = 4096
BLOCKS = 16
SIZE = BLOCK * BLOCKS


def load(impl):
    if impl == "nixl":
        from nixl._api import nixl_agent, nixl_agent_config
    else:
        from pd_xfer.nixl import nixl_agent, nixl_agent_config
    return nixl_agent, nixl_agent_config


def observe(call):
    """What a call gave, in implementation-neutral terms: the type name and simple values, or
    the exception class name."""
    try:
        value = call()
    except Exception as error:  # noqa: BLE001 - recording what was raised is the point
        return {"raised": type(error).__name__}
    if value is None or isinstance(value, (bool, int, str)):
        return {"value": value}
    if isinstance(value, bytes):
        return {"type": "bytes"}
    if isinstance(value, dict):
        return {"dict": {str(k): [type(m).__name__ for m in v] for k, v in value.items()}}
    return {"type": type(value).__name__, "truthy": bool(value)}


# NIXL logs to stdout too: protocol lines carry this prefix.
MARK = "@@"


def emit(obj):
    print(MARK + json.dumps(obj, sort_keys=True), flush=True)


def read_emitted(stream):
    for line in stream:
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    raise EOFError("the other process ended without its record")


def buffer_descs(buffer):
    addr = buffer.ctypes.data
    return addr, [(addr + i * BLOCK, BLOCK, 0) for i in range(BLOCKS)]


def target(impl, backend):
    nixl_agent, nixl_agent_config = load(impl)
    agent = nixl_agent("prefill", nixl_agent_config(backends=[backend], capture_telemetry=True))
    memory = (numpy.arange(SIZE, dtype=numpy.uint64) * 7 + 3).astype(numpy.uint8)
    addr, _ = buffer_descs(memory)
    agent.register_memory(agent.get_reg_descs([(addr, SIZE, 0, "")], "DRAM"), backends=[backend])
    emit({"metadata": agent.get_agent_metadata().hex(), "addr": addr})
    received = []
    deadline = time.monotonic() + 30
    while len(received) < 2 and time.monotonic() < deadline:
        for name, messages in agent.get_new_notifs().items():
            received += [[name, m.decode()] for m in messages]
        time.sleep(0.005)
    emit({"notifs": received})


def decode(impl, backend):
    nixl_agent, nixl_agent_config = load(impl)
    peer = subprocess.Popen([sys.executable, __file__, impl, backend, "--target"], stdout=subprocess.PIPE, text=True)
    try:
        hello = read_emitted(peer.stdout)
        record = run_decode(nixl_agent, nixl_agent_config, backend, bytes.fromhex(hello["metadata"]), hello["addr"])
        record["target_notifs"] = read_emitted(peer.stdout)["notifs"]
        peer.wait(timeout=30)
        return record
    finally:
        if peer.poll() is None:
            peer.kill()


def run_decode(nixl_agent, nixl_agent_config, backend, metadata, remote_addr):
    record = {}
    agent = nixl_agent("decode", nixl_agent_config(backends=[backend], capture_telemetry=True))
    record["name"] = observe(lambda: agent.name)
    local = numpy.zeros(SIZE, dtype=numpy.uint8)
    addr, local_blocks = buffer_descs(local)
    reg = agent.get_reg_descs([(addr, SIZE, 0, "")], "DRAM")
    record["get_reg_descs"] = observe(lambda: reg)
    record["register_memory"] = observe(lambda: agent.register_memory(reg, backends=[backend]))
    record["get_agent_metadata"] = observe(agent.get_agent_metadata)

    record["add_remote_agent garbage"] = observe(lambda: agent.add_remote_agent(b"garbage"))
    remote_name = agent.add_remote_agent(metadata)
    record["add_remote_agent"] = observe(lambda: remote_name)
    record["add_remote_agent again"] = observe(lambda: agent.add_remote_agent(metadata))
    record["check_remote_metadata"] = observe(lambda: agent.check_remote_metadata(remote_name))
    record["check_remote_metadata unknown"] = observe(lambda: agent.check_remote_metadata("nobody"))

    local_descs = agent.get_xfer_descs(numpy.array(local_blocks, dtype=numpy.uint64), "DRAM")
    remote_blocks = [(remote_addr + i * BLOCK, BLOCK, 0) for i in range(BLOCKS)]
    remote_descs = agent.get_xfer_descs(numpy.array(remote_blocks, dtype=numpy.uint64), "DRAM")
    record["get_xfer_descs"] = observe(lambda: local_descs)
    local_side = agent.prep_xfer_dlist("NIXL_INIT_AGENT", local_descs)
    remote_side = agent.prep_xfer_dlist(remote_name, remote_descs)
    record["prep_xfer_dlist"] = observe(lambda: remote_side)
    record["prep_xfer_dlist unknown agent"] = observe(lambda: agent.prep_xfer_dlist("nobody", remote_descs))
    outside = agent.get_xfer_descs([(remote_addr + SIZE, BLOCK, 0)], "DRAM")
    record["prep_xfer_dlist outside"] = observe(lambda: agent.prep_xfer_dlist(remote_name, outside))

    wanted = numpy.array([3, 0, 7, 12], dtype=numpy.int64)
    into = numpy.array([0, 1, 2, 3], dtype=numpy.int64)
    record["make_prepped_xfer COPY"] = observe(
        lambda: agent.make_prepped_xfer("COPY", local_side, into, remote_side, wanted, notif_msg=b"x")
    )
    record["make_prepped_xfer count mismatch"] = observe(
        lambda: agent.make_prepped_xfer("READ", local_side, into[:2], remote_side, wanted, notif_msg=b"x")
    )
    handle = agent.make_prepped_xfer("READ", local_side, into, remote_side, wanted, notif_msg=b"req-1:1")
    record["make_prepped_xfer"] = observe(lambda: handle)
    record["check_xfer_state before transfer"] = observe(lambda: agent.check_xfer_state(handle))
    state = agent.transfer(handle)
    record["transfer"] = {"in": state in ("DONE", "PROC")}
    deadline = time.monotonic() + 20
    while state == "PROC" and time.monotonic() < deadline:
        state = agent.check_xfer_state(handle)
    record["check_xfer_state"] = observe(lambda: state)
    expected = (numpy.arange(SIZE, dtype=numpy.uint64) * 7 + 3).astype(numpy.uint8)
    record["bytes read"] = all(
        numpy.array_equal(local[i * BLOCK:(i + 1) * BLOCK], expected[r * BLOCK:(r + 1) * BLOCK])
        for i, r in zip(into.tolist(), wanted.tolist())
    )
    telemetry = agent.get_xfer_telemetry(handle)
    record["telemetry"] = {
        "fields": sorted(f for f in ("startTime", "postDuration", "xferDuration", "totalBytes", "descCount")
                         if isinstance(getattr(telemetry, f), int)),
        "totalBytes": telemetry.totalBytes,
    }
    record["release_xfer_handle"] = observe(lambda: agent.release_xfer_handle(handle))
    record.update(strided_read(agent, remote_name, addr, remote_addr, local, expected))
    record["release_xfer_handle again"] = observe(lambda: agent.release_xfer_handle(handle))
    record["send_notif"] = observe(lambda: agent.send_notif(remote_name, notif_msg=b"HB:req-1"))
    record["send_notif unknown"] = observe(lambda: agent.send_notif("nobody", notif_msg=b"HB:req-1"))
    record["get_new_notifs initiator"] = observe(agent.get_new_notifs)

    record["release_dlist_handle"] = observe(lambda: agent.release_dlist_handle(remote_side))
    record["release_dlist_handle again"] = observe(lambda: agent.release_dlist_handle(remote_side))
    agent.release_dlist_handle(local_side)
    record["remove_remote_agent"] = observe(lambda: agent.remove_remote_agent(remote_name))
    record["check_remote_metadata removed"] = observe(lambda: agent.check_remote_metadata(remote_name))
    record["remove_remote_agent again"] = observe(lambda: agent.remove_remote_agent(remote_name))
    record["deregister_memory"] = observe(lambda: agent.deregister_memory(reg))
    record["deregister_memory again"] = observe(lambda: agent.deregister_memory(reg))
    return record


def strided_read(agent, remote_name, addr, remote_addr, local, expected):
    """Strided (N×5) lists, as SGLang's NIXL transfer backend prepares them: rows of (addr, len,
    devId, stride, count), indexed block by block in row order. Locally the even blocks, then the
    odd ones; remotely all of them in one row."""
    record = {}
    half = BLOCKS // 2
    local_rows = numpy.array(
        [[addr, BLOCK, 0, 2 * BLOCK, half], [addr + BLOCK, BLOCK, 0, 2 * BLOCK, half]], dtype=numpy.uint64
    )
    remote_rows = numpy.array([[remote_addr, BLOCK, 0, BLOCK, BLOCKS]], dtype=numpy.uint64)
    record["prep_xfer_dlist strided, no memory type"] = observe(
        lambda: agent.prep_xfer_dlist("NIXL_INIT_AGENT", local_rows)
    )
    past_the_end = numpy.array([[remote_addr, BLOCK, 0, BLOCK, BLOCKS + 1]], dtype=numpy.uint64)
    record["prep_xfer_dlist strided outside"] = observe(
        lambda: agent.prep_xfer_dlist(remote_name, past_the_end, "DRAM")
    )
    local_side = agent.prep_xfer_dlist("NIXL_INIT_AGENT", local_rows, "DRAM")
    remote_side = agent.prep_xfer_dlist(remote_name, remote_rows, "DRAM")
    record["prep_xfer_dlist strided"] = observe(lambda: remote_side)
    # Local indices 4, 12 and 15 are blocks 8, 9 and 15 (untouched by the first read).
    into, wanted = [4, 12, 15], [5, 9, 2]
    handle = agent.make_prepped_xfer("READ", local_side, into, remote_side, wanted)
    state = agent.transfer(handle)
    deadline = time.monotonic() + 20
    while state == "PROC" and time.monotonic() < deadline:
        state = agent.check_xfer_state(handle)
    record["strided read state"] = state
    record["strided read bytes"] = all(
        numpy.array_equal(local[b * BLOCK:(b + 1) * BLOCK], expected[r * BLOCK:(r + 1) * BLOCK])
        for b, r in zip([8, 9, 15], wanted)
    )
    agent.release_xfer_handle(handle)
    agent.release_dlist_handle(local_side)
    agent.release_dlist_handle(remote_side)
    return record


if __name__ == "__main__":
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    impl, backend = sys.argv[1], sys.argv[2]
    if "--target" in sys.argv:
        target(impl, backend)
    else:
        emit(decode(impl, backend))
    # NIXL 1.5.1 crashes (SIGSEGV) while the interpreter tears its agents down, after the record
    # is out; both implementations leave without that teardown so the exit status means something.
    sys.stdout.flush()
    os._exit(0)
