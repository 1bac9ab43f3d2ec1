"""pd_xfer's native API between two processes over real sockets: metadata over the side
channel, READ and WRITE by descriptor and by prepared index lists, notifications, telemetry,
and the typed errors for bad input."""

import time

import pytest

import pd_xfer
from pd_xfer import XferError
from peer_process import BACKENDS, pattern, spawn

SIZE = 1 << 20
HALF = SIZE // 2


class Peer:
    def __init__(self, backend: str):
        self.proc, ready = spawn("peer.py", backend)
        self.port, self.name = int(ready[0]), ready[1]
        self.addr, self.len = int(ready[2]), int(ready[3])

    def verdict(self) -> str:
        out = self.proc.stdout.readline()
        self.proc.wait(timeout=30)
        return out

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


@pytest.fixture(params=BACKENDS)
def pair(request):
    backend = request.param
    peer = Peer(backend)
    agent = pd_xfer.Agent("test-" + backend)
    agent.add_backend(backend)
    local = bytearray(SIZE)
    registration = pd_xfer.register(agent, local)
    yield agent, peer, local, registration
    registration.deregister()
    peer.kill()


def test_read_then_write_with_notification(pair):
    agent, peer, local, registration = pair
    (laddr, _, _), = registration.descs()
    assert agent.fetch_remote_metadata(f"127.0.0.1:{peer.port}") == peer.name
    assert peer.name in agent.peers()
    assert ("DRAM", peer.addr, peer.len, 0) in agent.remote_regions(peer.name)

    read = agent.create_request("READ", [(laddr, SIZE, 0)], peer.name, [(peer.addr, SIZE, 0)])
    assert read.telemetry() is None
    read.post()
    read.wait(20.0)
    assert bytes(local) == pattern(3, SIZE)
    telemetry = read.telemetry()
    assert telemetry["bytes"] == SIZE and telemetry["descriptors"] == 1
    assert telemetry["duration_us"] is not None and telemetry["posted_at_us"] > 0
    assert read.poll() is True
    read.release()
    assert read.released

    local[HALF:] = pattern(11, HALF)
    write = agent.create_request(
        "WRITE", [(laddr + HALF, HALF, 0)], peer.name, [(peer.addr + HALF, HALF, 0)], notif=b"write-done"
    )
    write.post()
    write.wait(20.0)
    assert write.op == "WRITE" and write.bytes == HALF and write.peer == peer.name
    assert peer.verdict().startswith("VERIFIED ok"), "the peer saw other bytes or notifications"


def test_prepared_lists_by_index(pair):
    agent, peer, local, registration = pair
    (laddr, _, _), = registration.descs()
    agent.fetch_remote_metadata(f"127.0.0.1:{peer.port}")
    block = 4096
    blocks = SIZE // block
    local_list = agent.prep_local([(laddr + i * block, block, 0) for i in range(blocks)])
    remote_list = agent.prep_remote(peer.name, [(peer.addr + i * block, block, 0) for i in range(blocks)])
    assert len(local_list) == blocks and len(remote_list) == blocks and remote_list.peer == peer.name
    # Remote blocks 5, 9, 2 into local blocks 0, 1, 2.
    request = agent.make_request("READ", local_list, [0, 1, 2], remote_list, [5, 9, 2])
    request.post()
    request.wait(20.0)
    expected = pattern(3, SIZE)
    for local_index, remote_index in ((0, 5), (1, 9), (2, 2)):
        got = bytes(local[local_index * block:(local_index + 1) * block])
        assert got == expected[remote_index * block:(remote_index + 1) * block]
    assert bytes(local[3 * block:4 * block]) == bytes(block), "an unrequested block changed"


def error_kind(call) -> str:
    with pytest.raises(XferError) as caught:
        call()
    return caught.value.kind


def test_bad_input_raises_typed_errors(pair):
    agent, peer, local, registration = pair
    (laddr, _, _), = registration.descs()
    assert error_kind(lambda: agent.prep_remote("nobody", [(0, 1, 0)])) == "unknown_peer"
    assert error_kind(lambda: agent.load_remote_metadata(b"not a metadata blob")) == "metadata"
    assert error_kind(lambda: agent.load_remote_metadata(b"")) == "metadata"
    assert error_kind(lambda: agent.add_backend("no-such-backend")) == "unknown_backend"
    assert error_kind(lambda: agent.add_backend(agent.backends()[0])) == "backend_exists"
    assert error_kind(lambda: agent.prep_local([(laddr, SIZE + 1, 0)])) == "not_registered"
    assert error_kind(lambda: agent.prep_local([(laddr, 1, 0)], "GPU-ish")) == "invalid_argument"
    assert error_kind(lambda: agent.wait_notifs(-1.0)) == "invalid_argument"
    assert error_kind(lambda: pd_xfer.regions(bytes(8))) == "invalid_argument"
    agent.fetch_remote_metadata(f"127.0.0.1:{peer.port}")
    assert error_kind(
        lambda: agent.create_request("READ", [(laddr, 8, 0)], peer.name, [(peer.addr + peer.len, 8, 0)])
    ) == "not_registered"
    assert error_kind(
        lambda: agent.create_request("READ", [(laddr, 8, 0)], peer.name, [(peer.addr, 16, 0)])
    ) == "length_mismatch"
    assert error_kind(lambda: agent.create_request("MOVE", [(laddr, 8, 0)], peer.name, [(peer.addr, 8, 0)])) == (
        "invalid_argument"
    )
    request = agent.create_request("READ", [(laddr, 8, 0)], peer.name, [(peer.addr, 8, 0)])
    assert error_kind(request.poll) == "not_posted"
    request.release()
    assert error_kind(request.post) == "invalid_argument"
    assert error_kind(lambda: agent.fetch_remote_metadata("127.0.0.1:1")) == "side_channel"


def test_dead_peer_is_an_error_not_a_hang(pair):
    agent, peer, local, registration = pair
    (laddr, _, _), = registration.descs()
    agent.fetch_remote_metadata(f"127.0.0.1:{peer.port}")
    peer.kill()
    request = agent.create_request("READ", [(laddr, SIZE, 0)], peer.name, [(peer.addr, SIZE, 0)])
    started = time.monotonic()
    with pytest.raises(XferError) as caught:
        request.post()
        request.wait(20.0)
    assert caught.value.kind in ("peer_disconnected", "backend", "timed_out"), caught.value.kind
    assert time.monotonic() - started < 20.0


def test_gil_is_released_while_waiting():
    import threading

    agent = pd_xfer.Agent("gil")
    agent.add_backend("tcp")
    ticks = []
    stop = threading.Event()

    def tick():
        while not stop.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.01)

    thread = threading.Thread(target=tick)
    thread.start()
    assert agent.wait_notifs(0.5) is False
    stop.set()
    thread.join()
    # With the GIL held for the half second, the ticker would have run only before and after.
    assert len(ticks) >= 20, f"only {len(ticks)} ticks while wait_notifs waited"


def test_tensors_and_arrays_describe_their_memory():
    numpy = pytest.importorskip("numpy")
    array = numpy.zeros(1024, dtype=numpy.uint8)
    (addr, length, dev), = pd_xfer.regions(array)
    assert (addr, length, dev) == (array.ctypes.data, 1024, 0)
    table = numpy.array([[10, 20, 0], [30, 40, 1]])
    assert pd_xfer.regions(table) == [(10, 20, 0), (30, 40, 1)]
    assert pd_xfer.regions([(1, 2, 3, "meta")]) == [(1, 2, 3)]
    torch = pytest.importorskip("torch")
    tensor = torch.zeros(256, dtype=torch.float32)
    assert pd_xfer.regions(tensor) == [(tensor.data_ptr(), 1024, 0)]
    assert pd_xfer.memory_type_of([tensor]) == "DRAM"
