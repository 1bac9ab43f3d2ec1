"""The target of test_grants.py, in its own process: an agent that serves 64 KiB of patterned
memory on a side channel and issues, offers and revokes grants over it when told to.

Commands on stdin, one per line, each answered with one line on stdout:
``grant <peer> <offset> <len>`` -> ``TOKEN <hex>``; ``offer <name>`` -> ``OFFERED``;
``revoke`` -> ``REVOKED <grants claimed> <claimant or ->`` (revokes what was granted or
offered last). It starts with ``READY <port> <name> <addr> <len>`` and exits on EOF or after
60 s.
"""

import signal
import sys

from peer_process import pattern, serve

SIZE = 64 << 10


def main() -> int:
    signal.alarm(60)
    backend = sys.argv[1] if len(sys.argv) > 1 else "tcp"
    memory = bytearray(pattern(5, SIZE, step=13))
    agent, registration, addr = serve("grant-peer", backend, memory)
    last = None
    for line in sys.stdin:
        words = line.split()
        if words[0] == "grant":
            peer, offset, size = words[1], int(words[2]), int(words[3])
            last = agent.grant(peer, [(addr + offset, size, 0)], ttl=30.0)
            print(f"TOKEN {last.token.hex()}", flush=True)
        elif words[0] == "offer":
            last = agent.offer_grant(words[1], ttl=30.0)
            print("OFFERED", flush=True)
        elif words[0] == "revoke":
            claimant = getattr(last, "claimant", None) or "-"
            claimed = last.revoke()
            print(f"REVOKED {claimed if claimed is not None else 1} {claimant}", flush=True)
    registration.deregister()
    return 0


if __name__ == "__main__":
    sys.exit(main())
