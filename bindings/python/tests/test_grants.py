"""Grants through the Python API, between two processes over real sockets: a grant issued by
the peer and loaded here, and a grant offered under a name and claimed here over the side
channel. Reads under a live grant deliver the peer's bytes; after the peer revokes, a read
raises kind ``refused`` (code: revoked) and delivers nothing, and a later claim is refused
the same way."""

import pytest

import pd_xfer
from pd_xfer import XferError
from peer_process import BACKENDS, pattern, spawn, stop

SIZE = 64 << 10
OFFSET, LEN = 4096, 16 << 10
REVOKED = "grant revoked or expired"


class GrantPeer:
    def __init__(self, backend: str):
        self.proc, ready = spawn("grant_peer.py", backend, stdin=True)
        self.side = f"127.0.0.1:{ready[0]}"
        self.name, self.addr = ready[1], int(ready[2])

    def ask(self, command: str) -> list[str]:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().split()

    def close(self):
        stop(self.proc)


@pytest.fixture(params=BACKENDS)
def pair(request):
    backend = request.param
    peer = GrantPeer(backend)
    agent = pd_xfer.Agent("grant-reader-" + backend)
    agent.add_backend(backend)
    local = bytearray(LEN)
    registration = pd_xfer.register(agent, local)
    assert agent.fetch_remote_metadata(peer.side) == peer.name
    yield agent, peer, local, registration
    registration.deregister()
    peer.close()


def read(agent, peer, local, registration):
    (addr, length, _), = registration.descs()
    request = agent.create_request("READ", [(addr, length, 0)], peer.name, [(peer.addr + OFFSET, LEN, 0)])
    try:
        request.post()
        request.wait(10.0)
    finally:
        request.release()


def assert_revoked(error: XferError):
    assert error.kind == "refused", error
    assert error.code == REVOKED, error


def test_grant_then_revoke(pair):
    agent, peer, local, registration = pair
    answer = peer.ask(f"grant {agent.name} {OFFSET} {LEN}")
    assert answer[0] == "TOKEN"
    assert agent.load_grant(bytes.fromhex(answer[1])) == peer.name
    read(agent, peer, local, registration)
    assert bytes(local) == pattern(5, SIZE, step=13)[OFFSET:OFFSET + LEN]

    assert peer.ask("revoke")[0] == "REVOKED"
    local[:] = bytes(LEN)
    with pytest.raises(XferError) as late:
        read(agent, peer, local, registration)
    assert_revoked(late.value)
    assert bytes(local) == bytes(LEN), "a read refused after revocation delivered bytes"


def test_published_list_does_not_go_through_a_loaded_grant(pair):
    agent, peer, local, registration = pair
    (addr, length, _), = registration.descs()
    remote = [(peer.addr + OFFSET, LEN, 0)]
    answer = peer.ask(f"grant {agent.name} {OFFSET} {LEN}")
    assert agent.load_grant(bytes.fromhex(answer[1])) == peer.name
    local_list = agent.prep_local([(addr, length, 0)])
    through_grant = agent.prep_remote(peer.name, remote)
    published = agent.prep_remote_published(peer.name, remote)
    assert peer.ask("revoke")[0] == "REVOKED"

    def read_from(remote_list):
        request = agent.make_request("READ", local_list, [0], remote_list, [0])
        try:
            request.post()
            request.wait(10.0)
        finally:
            request.release()

    with pytest.raises(XferError) as late:
        read_from(through_grant)
    assert_revoked(late.value)
    assert bytes(local) == bytes(LEN), "a read refused after revocation delivered bytes"
    # The peer serves its published memory without a grant: the published list still reads.
    read_from(published)
    assert bytes(local) == pattern(5, SIZE, step=13)[OFFSET:OFFSET + LEN]


def test_offered_grant_is_claimed_then_revoked(pair):
    agent, peer, local, registration = pair
    assert peer.ask("offer cmpl-1") == ["OFFERED"]
    ranges = [(peer.addr + OFFSET, LEN, 0)]
    assert agent.claim_grant(peer.side, "cmpl-1", ranges) == peer.name
    read(agent, peer, local, registration)
    assert bytes(local) == pattern(5, SIZE, step=13)[OFFSET:OFFSET + LEN]

    assert peer.ask("revoke") == ["REVOKED", "1", agent.name]
    local[:] = bytes(LEN)
    with pytest.raises(XferError) as late:
        read(agent, peer, local, registration)
    assert_revoked(late.value)
    assert bytes(local) == bytes(LEN), "a read refused after revocation delivered bytes"
    with pytest.raises(XferError) as late_claim:
        agent.claim_grant(peer.side, "cmpl-1", ranges)
    assert_revoked(late_claim.value)


def test_bad_grant_input_raises_typed_errors(pair):
    agent, peer, _local, _registration = pair
    with pytest.raises(XferError) as garbage:
        agent.load_grant(b"not a token")
    assert garbage.value.kind == "invalid_argument"
    with pytest.raises(XferError) as outside:
        agent.grant(peer.name, [(1, 4096, 0)])
    assert outside.value.kind == "invalid_argument"
    with pytest.raises(XferError) as ttl:
        agent.offer_grant("x", ttl=-1.0)
    assert ttl.value.kind == "invalid_argument"
