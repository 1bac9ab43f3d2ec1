"""pd_xfer.nixl.nixl_agent against NIXL's own agent: the same calls (those vLLM's NixlConnector
makes, nixl_calls.py) between two processes, once per implementation; the records must match
in return types, state strings, notification shapes, moved bytes and errors on bad input.

NIXL comes from the real-vLLM venv (nixl 1.5.1). Without it these tests fail, unless
PD_ALLOW_NO_NIXL=1, when they skip, saying so."""

import json
import os
import subprocess
import sys
import time

import pytest

import pd_xfer.nixl

HERE = os.path.dirname(os.path.abspath(__file__))

try:
    import nixl._api  # noqa: F401
    HAVE_NIXL = True
except ImportError:
    HAVE_NIXL = False

if not HAVE_NIXL and os.environ.get("PD_ALLOW_NO_NIXL") != "1":
    raise RuntimeError("NIXL (pip package nixl) is not importable; run inside the real-vLLM venv")

needs_nixl = pytest.mark.skipif(not HAVE_NIXL, reason="NIXL is not installed (PD_ALLOW_NO_NIXL=1)")


def record(impl: str, backend: str, **extra_env: str) -> dict:
    env = dict(os.environ, UCX_NET_DEVICES="lo", **extra_env)
    out = subprocess.run(
        [sys.executable, os.path.join(HERE, "nixl_calls.py"), impl, backend],
        capture_output=True, text=True, timeout=120, env=env, check=True,
    ).stdout
    lines = [line[2:] for line in out.splitlines() if line.startswith("@@")]
    assert lines, f"no record from {impl}/{backend}: {out[-2000:]}"
    return json.loads(lines[-1])


@pytest.fixture(scope="module")
def nixl_record():
    return record("nixl", "UCX")


def differences(theirs: dict, ours: dict) -> list:
    return [(k, theirs.get(k), ours.get(k)) for k in sorted(set(theirs) | set(ours)) if theirs.get(k) != ours.get(k)]


@needs_nixl
@pytest.mark.parametrize("backend", [b for b in ("UCX", "TCP") if b in pd_xfer.nixl.nixl_agent("probe").get_plugin_list()])
def test_same_behaviour_as_nixl(nixl_record, backend):
    assert nixl_record["bytes read"] is True and nixl_record["check_xfer_state"] == {"value": "DONE"}
    assert nixl_record["strided read bytes"] is True and nixl_record["strided read state"] == "DONE"
    ours = record("pd_xfer", backend)
    assert differences(nixl_record, ours) == []


@needs_nixl
def test_a_mixed_pair_is_refused_at_handshake():
    from nixl._api import nixl_agent, nixl_agent_config

    theirs = nixl_agent("nixl-side", nixl_agent_config(backends=["UCX"]))
    ours = pd_xfer.nixl.nixl_agent("xfer-side", pd_xfer.nixl.nixl_agent_config(backends=["TCP"]))
    buffer = bytearray(4096)
    regions = pd_xfer.regions(buffer)
    for agent in (theirs, ours):
        agent.register_memory(agent.get_reg_descs([(a, n, d, "") for a, n, d in regions], "DRAM"))
    with pytest.raises(pd_xfer.nixl.nixlMismatchError) as refused:
        ours.add_remote_agent(theirs.get_agent_metadata())
    assert "NIXL" in str(refused.value) and "same transfer library" in str(refused.value)
    with pytest.raises(Exception) as refused_by_nixl:
        theirs.add_remote_agent(ours.get_agent_metadata())
    assert type(refused_by_nixl.value).__name__ == "nixlMismatchError"


@needs_nixl
def test_backend_settings_from_the_environment(nixl_record, monkeypatch):
    """vLLM creates its backends with no settings: ``PD_XFER_TCP_PARAMS`` gives them. Over TLS
    (``tls=on`` in both processes' environment) the calls vLLM makes give NIXL's record; an agent
    made under it publishes a TLS fingerprint, one whose ``initParams`` say otherwise does not,
    and a malformed or unknown setting fails ``create_backend`` naming it."""
    assert differences(nixl_record, record("pd_xfer", "TCP", PD_XFER_TCP_PARAMS="tls=on")) == []

    config = pd_xfer.nixl.nixl_agent_config(backends=[])
    fingerprint = b"#tls-sha256="

    def metadata_with(name, init_params=None):
        agent = pd_xfer.nixl.nixl_agent(name, config)
        agent.create_backend("TCP", init_params)
        return agent.get_agent_metadata()

    assert fingerprint not in metadata_with("env-plain")
    # As NIXL does with its plugins, a caller's key the backend does not take is left out (and
    # logged); a key it takes is still checked, and the environment's keys all are.
    assert fingerprint in metadata_with("nixl-style", {"tls": "on", "use_uring": "true", "active": "True"})
    with pytest.raises(pd_xfer.nixl.nixlBackendError, match="tls"):
        metadata_with("bad-value", {"tls": "maybe", "active": "True"})
    monkeypatch.setenv("PD_XFER_TCP_PARAMS", "tls=on")
    assert fingerprint in metadata_with("env-tls")
    assert fingerprint not in metadata_with("env-overridden", {"tls": "off"})
    malformed = ("tls", "PD_XFER_TCP_PARAMS", pd_xfer.nixl.nixlInvalidParamError)
    unknown = ("tls=on,no_such_key=1", "no_such_key", pd_xfer.nixl.nixlBackendError)
    for bad, named, error in (malformed, unknown):
        monkeypatch.setenv("PD_XFER_TCP_PARAMS", bad)
        with pytest.raises(error, match=named):
            metadata_with("env-bad")
        with pytest.raises(error, match=named):
            metadata_with("env-bad-also-given", {"no_such_key": "1"})


def test_strided_lists_are_checked_before_they_are_expanded():
    import numpy

    agent = pd_xfer.nixl.nixl_agent("strided", pd_xfer.nixl.nixl_agent_config(backends=["TCP"]))
    buffer = numpy.zeros(4 * 4096, dtype=numpy.uint8)
    addr = buffer.ctypes.data
    agent.register_memory(agent.get_reg_descs([(addr, buffer.nbytes, 0, "")], "DRAM"))
    rows = numpy.array([[addr, 4096, 0, 4096, 4]], dtype=numpy.uint64)
    # An N×5 array is a strided list for prep_xfer_dlist only, never a buffer to describe.
    for call in (lambda: agent.get_xfer_descs(rows, "DRAM"), lambda: agent.get_reg_descs(rows, "DRAM"),
                 lambda: agent.get_xfer_descs(numpy.zeros((2, 2), dtype=numpy.uint64), "DRAM")):
        with pytest.raises(pd_xfer.nixl.nixlInvalidParamError, match="3 columns"):
            call()
    with pytest.raises(ValueError, match="memory type"):
        agent.prep_xfer_dlist("", rows)
    negative = numpy.array([[addr, 4096, 0, -4096, 4]], dtype=numpy.int64)
    with pytest.raises(pd_xfer.nixl.nixlInvalidParamError, match="negative"):
        agent.prep_xfer_dlist("", negative, "DRAM")
    huge = numpy.array([[addr, 1, 0, 0, pd_xfer.nixl.MAX_STRIDED_DESCS + 1]], dtype=numpy.uint64)
    with pytest.raises(pd_xfer.nixl.nixlInvalidParamError, match="more than"):
        agent.prep_xfer_dlist("", huge, "DRAM")
    past_the_end = numpy.array([[addr, 4096, 0, 4096, 5]], dtype=numpy.uint64)
    with pytest.raises(pd_xfer.nixl.nixlNotFoundError):
        agent.prep_xfer_dlist("", past_the_end, "DRAM")
    handle = agent.prep_xfer_dlist("", rows, "DRAM")
    agent.release_dlist_handle(handle)


def test_unsupported_methods_name_themselves():
    agent = pd_xfer.nixl.nixl_agent("unsupported", pd_xfer.nixl.nixl_agent_config(backends=["TCP"]))
    with pytest.raises(NotImplementedError, match="prep_mem_view"):
        agent.prep_mem_view([], "DRAM")
    with pytest.raises(AttributeError):
        agent.no_such_method()


def test_vllm_builds_xfer_agents_once_the_connector_module_is_imported():
    pytest.importorskip("vllm")
    import pd_xfer.vllm

    assert pd_xfer.vllm.vllm_agent_class() is pd_xfer.vllm.FencingAgent
    assert issubclass(pd_xfer.vllm.FencingAgent, pd_xfer.nixl.nixl_agent)
    # Its agents serve grants and say where in the metadata; a peer loading it learns that.
    config = pd_xfer.nixl.nixl_agent_config(backends=["TCP"])
    prefill, decode = pd_xfer.vllm.FencingAgent("fenced-p", config), pd_xfer.nixl.nixl_agent("fenced-d", config)
    metadata = prefill.get_agent_metadata()
    assert metadata.startswith(pd_xfer.nixl.GRANT_METADATA_PREFIX + prefill.grant_service.encode() + b"|")
    assert decode.add_remote_agent(metadata) == b"fenced-p"
    assert decode._peer_grant_services == {"fenced-p": prefill.grant_service}
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector

    assert issubclass(pd_xfer.vllm.XferConnector, NixlConnector)


def test_dram_to_file_and_back_through_the_posix_backend(tmp_path):
    """NIXL's POSIX plugin usage: the agent names itself as the remote agent of FILE lists."""
    import numpy

    agent = pd_xfer.nixl.nixl_agent("files", pd_xfer.nixl.nixl_agent_config(backends=["POSIX"]))
    size, block = 1 << 20, 64 << 10
    path = tmp_path / "kv.bin"
    with open(path, "wb") as f:
        f.truncate(size)
    fd = os.open(path, os.O_RDWR)
    try:
        source = numpy.frombuffer(os.urandom(size), dtype=numpy.uint8).copy()
        back = numpy.zeros(size, dtype=numpy.uint8)
        for array in (source, back):
            agent.register_memory([(array.ctypes.data, size, 0, "")], "DRAM")
        agent.register_memory([(0, size, fd, str(path))], "FILE")
        blocks = size // block
        file_side = agent.prep_xfer_dlist(agent.name, [(i * block, block, fd) for i in range(blocks)], "FILE")
        for op, array in (("WRITE", source), ("READ", back)):
            local = agent.prep_xfer_dlist(
                "NIXL_INIT_AGENT", [(array.ctypes.data + i * block, block, 0) for i in range(blocks)], "DRAM"
            )
            # Reversed block order: memory block i goes to file block blocks-1-i and back.
            handle = agent.make_prepped_xfer(op, local, list(range(blocks)), file_side, list(reversed(range(blocks))))
            state = agent.transfer(handle)
            deadline = time.monotonic() + 20
            while state == "PROC" and time.monotonic() < deadline:
                state = agent.check_xfer_state(handle)
            assert state == "DONE", f"{op}: {state}"
            assert agent.query_xfer_backend(handle) == "POSIX"
            agent.release_xfer_handle(handle)
        assert numpy.array_equal(back, source), "the bytes read back from the file differ"
        on_disk = numpy.fromfile(path, dtype=numpy.uint8)
        assert numpy.array_equal(on_disk[:block], source[size - block:]), "the file's first block is not the last one written"
    finally:
        os.close(fd)


def _open_fds(wanted) -> int:
    """How many of this process's descriptors point at something ``wanted`` accepts (a path,
    or ``socket:[...]``)."""
    targets = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            targets.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # closed since the listing (the listing's own descriptor)
            continue
    return sum(map(wanted, targets))


def _wait_done(agent, handle, what: str):
    state = agent.transfer(handle)
    deadline = time.monotonic() + 20
    while state == "PROC" and time.monotonic() < deadline:
        state = agent.check_xfer_state(handle)
    assert state == "DONE", f"{what}: {state}"
    agent.release_xfer_handle(handle)


def _files_by_path(api, agent_name: str, shared, directory) -> dict:
    """What an agent of ``api`` (NIXL's module or pd_xfer.nixl) answers to the file calls SGLang's
    HiCache NIXL storage makes: ``query_memory`` on paths, registration of files by path (NIXL's
    path mode, ``"rw,create:<path>"``), ``trim`` and a write and read through it. Queries are of
    ``shared``'s files, written in ``directory``."""
    import numpy

    agent = api.nixl_agent(agent_name, api.nixl_agent_config(backends=[]))
    agent.create_backend("POSIX")
    existing, missing = shared / "existing.bin", shared / "missing.bin"
    queried = [str(existing), str(missing), str(shared), f"rw:{existing}", ""]
    result = {"query": agent.query_memory([(0, 0, 0, path) for path in queried], "POSIX", mem_type="FILE")}
    # A network backend answers no queries; one not created is refused before that.
    network = "UCX" if "UCX" in agent.get_plugin_list() else "TCP"
    agent.create_backend(network)
    for backend, what in ((network, "a network backend"), ("NO_SUCH", "an unknown backend")):
        try:
            agent.query_memory([(0, 0, 0, str(existing))], backend, mem_type="FILE")
        except Exception as error:  # noqa: BLE001 - the class is what is compared
            result[f"query {what}"] = type(error).__name__
    try:
        agent.register_memory(agent.get_reg_descs([(0, 4096, 1, f"rw:{missing}")], "FILE"))
    except Exception as error:  # noqa: BLE001
        result["register missing"] = type(error).__name__
    assert not missing.exists()
    size = 1 << 16
    source = numpy.frombuffer(os.urandom(size), dtype=numpy.uint8).copy()
    back = numpy.zeros(size, dtype=numpy.uint8)
    for array in (source, back):
        agent.register_memory([(array.ctypes.data, size, 0, "")], "DRAM")
    created = directory / "kv.bin"
    # Two halves of one file, as two descriptors with devIds of the caller's choosing.
    halves = [(0, size // 2, 7000, f"rw,create:{created}"), (size // 2, size // 2, 7001, f"rw:{created}")]
    registered = agent.register_memory(agent.get_reg_descs(halves, "FILE"))
    file_side = registered.trim()
    result["trim"] = (type(file_side).__name__, file_side.descCount())
    for op, array in (("WRITE", source), ("READ", back)):
        local = agent.get_xfer_descs([(array.ctypes.data + i * (size // 2), size // 2, 0) for i in range(2)], "DRAM")
        _wait_done(agent, agent.initialize_xfer(op, local, file_side, agent_name), op)
    result["read back"] = bool(numpy.array_equal(back, source))
    result["on disk"] = created.read_bytes() == source.tobytes()
    result["created mode"] = oct(created.stat().st_mode)
    result["query created"] = agent.query_memory([(0, 0, 0, str(created))], "POSIX", mem_type="FILE")[0]["size"]
    agent.deregister_memory(registered)
    result["left open"] = _open_fds(lambda target: target == str(created))
    return result


@needs_nixl
def test_files_by_path_and_queries_as_nixl(tmp_path):
    """SGLang's HiCache NIXL storage asks whether files exist with ``query_memory`` and
    registers them by path; NIXL 1.5.1's POSIX plugin and pd_xfer answer the same."""
    import nixl._api

    for name in ("shared", "nixl", "ours"):
        (tmp_path / name).mkdir()
    (tmp_path / "shared" / "existing.bin").write_bytes(b"x" * 1000)
    theirs = _files_by_path(nixl._api, "paths-nixl", tmp_path / "shared", tmp_path / "nixl")
    ours = _files_by_path(pd_xfer.nixl, "paths-ours", tmp_path / "shared", tmp_path / "ours")
    assert theirs["read back"] and theirs["on disk"], theirs
    assert theirs["query"][1] is None and theirs["query"][0]["size"] == "1000", theirs
    assert differences(theirs, ours) == []
    assert ours["left open"] == 0


def test_files_by_path_name_one_file_per_devid_and_close_with_their_agent(tmp_path):
    """A devId names one file registered by path at a time (in one list or across lists, the
    second refused with the first untouched); a registration refused opens nothing; an agent
    collected without deregistering closes its files."""
    import gc

    def open_under(directory) -> int:
        return _open_fds(lambda target: target.startswith(str(directory)))

    agent = pd_xfer.nixl.nixl_agent("devids", pd_xfer.nixl.nixl_agent_config(backends=["POSIX"]))
    first = agent.register_memory([(0, 4096, 5, f"rw,create:{tmp_path / 'a'}")], "FILE")
    for clash in (
        [(0, 4096, 5, f"rw,create:{tmp_path / 'b'}")],
        [(0, 4096, 6, f"rw,create:{tmp_path / 'c'}"), (4096, 4096, 6, f"rw,create:{tmp_path / 'd'}")],
    ):
        with pytest.raises(pd_xfer.nixl.nixlInvalidParamError, match="devId"):
            agent.register_memory(clash, "FILE")
    assert open_under(tmp_path) == 1, "a refused registration left a file open"
    agent.deregister_memory(first)
    assert open_under(tmp_path) == 0
    agent.register_memory([(0, 4096, 5, f"rw:{tmp_path / 'a'}"), (0, 4096, 6, f"rw:{tmp_path / 'b'}")], "FILE")
    assert open_under(tmp_path) == 2
    del agent
    gc.collect()
    assert open_under(tmp_path) == 0, "a collected agent left its files open"


def test_make_connection_opens_what_the_first_transfer_uses_and_fails_fast():
    """``make_connection`` (NIXL's, optional for callers): over TCP it opens one connection per
    stream, which the first small transfer and the stream workers of the first large one then
    use (neither opens a socket), it names the peer it does not know, and a peer that is gone
    fails it at once."""
    import numpy

    config = pd_xfer.nixl.nixl_agent_config(backends=["TCP"])
    target, reader = pd_xfer.nixl.nixl_agent("conn-target", config), pd_xfer.nixl.nixl_agent("conn-reader", config)
    size = 1 << 20
    source = numpy.frombuffer(os.urandom(size), dtype=numpy.uint8).copy()
    back = numpy.zeros(size, dtype=numpy.uint8)
    target.register_memory([(source.ctypes.data, size, 0, "")], "DRAM")
    reader.register_memory([(back.ctypes.data, size, 0, "")], "DRAM")
    reader.add_remote_agent(target.get_agent_metadata())
    with pytest.raises(pd_xfer.nixl.nixlNotFoundError):
        reader.make_connection("nobody")
    with pytest.raises(KeyError):
        reader.make_connection("conn-target", ["UCX"])
    def sockets() -> int:
        return _open_fds(lambda target: target.startswith("socket:"))

    before = sockets()
    reader.make_connection(b"conn-target", ["TCP"])
    # One connection per stream (2 by default), both ends of each in this process.
    assert sockets() - before == 4
    for length in (4096, size):  # inline, then split over both streams
        remote = reader.get_xfer_descs([(source.ctypes.data, length, 0)], "DRAM")
        local = reader.get_xfer_descs([(back.ctypes.data, length, 0)], "DRAM")
        _wait_done(reader, reader.initialize_xfer("READ", local, remote, "conn-target"), "READ")
        assert numpy.array_equal(back[:length], source[:length])
        assert sockets() - before == 4, f"the first {length}-byte transfer opened a connection of its own"

    # A peer process killed after its metadata was loaded.
    script = (
        "import sys, time, pd_xfer, pd_xfer.nixl as n\n"
        "agent = n.nixl_agent('conn-gone', n.nixl_agent_config(backends=['TCP']))\n"
        "buffer = bytearray(4096)\n"
        "agent.register_memory([(a, l, d, '') for a, l, d in pd_xfer.regions(buffer)], 'DRAM')\n"
        "print(agent.get_agent_metadata().hex(), flush=True)\n"
        "time.sleep(60)\n"
    )
    peer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        reader.add_remote_agent(bytes.fromhex(peer.stdout.readline().strip()))
    finally:
        peer.kill()
        peer.wait(timeout=10)
    started = time.monotonic()
    with pytest.raises(pd_xfer.nixl.nixlRemoteDisconnectError):
        reader.make_connection("conn-gone")
    assert time.monotonic() - started < 5


def test_serialized_descriptor_lists_reach_a_peer_and_bad_bytes_are_refused():
    """The way NIXL's examples (and Ray's NIXL tensor transport) hand a target's list to its
    reader: ``get_serialized_descs`` on one side, ``deserialize_descs`` on the other, then a
    READ through the list received. The bytes are data, never unpickled: a peer's malformed
    bytes, or NIXL's own pickled ones, raise nixlInvalidParamError."""
    import numpy

    config = pd_xfer.nixl.nixl_agent_config(backends=["TCP"])
    target, reader = pd_xfer.nixl.nixl_agent("serial-target", config), pd_xfer.nixl.nixl_agent("serial-reader", config)
    size, block = 1 << 16, 4096
    source = numpy.frombuffer(os.urandom(size), dtype=numpy.uint8).copy()
    back = numpy.zeros(size, dtype=numpy.uint8)
    registered = target.register_memory([(source.ctypes.data, size, 0, "kv")], "DRAM")
    reader.register_memory([(back.ctypes.data, size, 0, "")], "DRAM")
    blocks = target.get_xfer_descs([(source.ctypes.data + i * block, block, 0) for i in range(size // block)], "DRAM")
    wire = target.get_serialized_descs(blocks)
    assert isinstance(wire, bytes)
    received = reader.deserialize_descs(wire)
    assert type(received) is pd_xfer.nixl.nixlXferDList and received.getType() == "DRAM"
    assert received.descs == blocks.descs
    again = reader.deserialize_descs(target.get_serialized_descs(registered))
    assert type(again) is pd_xfer.nixl.nixlRegDList and again.metas == ["kv"] and again.descs == registered.descs

    reader.add_remote_agent(target.get_agent_metadata())
    local = reader.get_xfer_descs([(back.ctypes.data + i * block, block, 0) for i in range(size // block)], "DRAM")
    _wait_done(reader, reader.initialize_xfer("READ", local, received, "serial-target"), "READ")
    assert numpy.array_equal(back, source)

    prefix = pd_xfer.nixl.SERIALIZED_DESCS_PREFIX
    malformed = [
        b"", b"garbage", prefix, prefix + b"{", prefix + b"[]", prefix + b'{"kind":"xfer"}',
        prefix + b'{"kind":"xfer","mem_type":"DRAM","descs":[]}',
        prefix + b'{"kind":"xfer","mem_type":"HBM","descs":[[1,2,0]]}',
        prefix + b'{"kind":"xfer","mem_type":"DRAM","descs":[[1,2]]}',
        prefix + b'{"kind":"xfer","mem_type":"DRAM","descs":[[-1,2,0]]}',
        prefix + b'{"kind":"xfer","mem_type":"DRAM","descs":[[18446744073709551616,2,0]]}',
        prefix + b'{"kind":"xfer","mem_type":"DRAM","descs":[[1.5,2,0]]}',
        prefix + b'{"kind":"xfer","mem_type":"DRAM","descs":[[true,2,0]]}',
        prefix + b'{"kind":"reg","mem_type":"DRAM","descs":[[1,2,0]],"metas":["a","b"]}',
        prefix + b'{"kind":"xfer","mem_type":"DRAM","descs":[[1,2,0]],"metas":["a"]}',
        prefix + b'{"kind":"xfer","mem_type":"DRAM","descs":[[1,2,0]],"extra":1}',
        prefix + b"\xff\xfe",
        prefix + b"[" * 100_000,
        prefix + b'{"kind":"xfer","mem_type":"DRAM","descs":[[' + b"9" * 5000 + b',2,0]]}',
    ]
    for data in malformed:
        with pytest.raises(pd_xfer.nixl.nixlInvalidParamError, match="deserialize_descs"):
            reader.deserialize_descs(data)
    if HAVE_NIXL:
        from nixl._api import nixl_agent, nixl_agent_config

        theirs = nixl_agent("serial-nixl", nixl_agent_config(backends=[]))
        pickled = theirs.get_serialized_descs(theirs.get_xfer_descs([(source.ctypes.data, size, 0)], "DRAM"))
        with pytest.raises(pd_xfer.nixl.nixlInvalidParamError, match="NIXL"):
            reader.deserialize_descs(pickled)


def test_code_that_imports_nixl_by_name_gets_pd_xfer():
    """SGLang's way: ``from nixl._api import nixl_agent, nixl_agent_config`` inside a function,
    exception classes from ``nixl._bindings``. A fresh interpreter, so the real NIXL of this
    venv is not imported first."""
    script = (
        "import pd_xfer.nixl as ours\n"
        "ours.install_as_nixl()\n"
        "from nixl._api import nixl_agent, nixl_agent_config\n"
        "from nixl._bindings import nixlBackendError, nixlCancelledError, nixlRemoteDisconnectError\n"
        "assert nixl_agent is ours.nixl_agent and issubclass(nixlBackendError, ours.XferError)\n"
        "agent = nixl_agent('sglang-style', nixl_agent_config(backends=[], num_threads=8))\n"
        "agent.create_backend('TCP', {'num_threads': '8'})\n"
        "assert 'TCP' in agent.get_plugin_list() and agent.backends == {'TCP': 'tcp'}\n"
        # SGLang's HiCache NIXL storage builds a binding agent for its thread-sync mode.
        "from nixl._api import nixlBind\n"
        "config = nixlBind.nixlAgentConfig()\n"
        "config.syncMode = getattr(nixlBind, 'NIXL_THREAD_SYNC_RW', nixlBind.NIXL_THREAD_SYNC_STRICT)\n"
        "config.pthrDelay, config.lthrDelay = 0, 100000\n"
        "agent.agent = nixlBind.nixlAgent('sglang-style', config)\n"
        "assert agent.agent.getAvailPlugins() == agent.get_plugin_list()\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_gds_is_listed_and_refused_with_the_reason_without_a_gpu():
    agent = pd_xfer.nixl.nixl_agent("gds-probe", pd_xfer.nixl.nixl_agent_config(backends=[]))
    assert "GDS" in agent.get_plugin_list()
    assert agent.get_plugin_mem_types("GDS") == ["FILE_SEG", "VRAM_SEG"]
    assert "VRAM_SEG" in agent.get_plugin_mem_types("TCP")
    try:
        agent.create_backend("GDS")
    except pd_xfer.nixl.XferError as err:
        # No CUDA driver (or no cuFile) here: the reason travels in the error.
        assert "CUDA is not available" in str(err) or "libcufile" in str(err), str(err)
    else:
        print("SKIPPED the refusal half: GDS attached (a GPU with cuFile is here)", file=sys.__stderr__)


def test_load_cufile_finds_pypi_nvidia_packages(tmp_path, monkeypatch):
    """Where PyPI's nvidia-cufile puts cuFile (``nvidia/cu13/lib/libcufile.so.0``, off the
    loader's path) is where ``load_cufile`` looks; a stand-in library (this extension module,
    which loads anywhere) is loaded from there by path, and nothing is loaded without it."""
    if "nvidia" in sys.modules:
        pytest.skip("an nvidia package is already imported: its search path is fixed")
    import importlib
    import shutil

    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    assert pd_xfer.load_cufile() is None or "nvidia" in pd_xfer.load_cufile()
    lib = tmp_path / "nvidia" / "cu13" / "lib"
    lib.mkdir(parents=True)
    (lib / "libcufile_rdma.so.1").write_bytes(b"not a library: never loaded")
    shutil.copy(pd_xfer._native.__file__, lib / "libcufile.so.0")
    importlib.invalidate_caches()
    assert pd_xfer.load_cufile() == str(lib / "libcufile.so.0")
