"""The far side of test_native.py, in its own process: an agent that serves 1 MiB of patterned
memory on a side channel, then checks what the test wrote into it.

Protocol on stdout (one line each): ``READY <port> <name> <addr> <len>``, then after the
test's ``write-done`` notification ``VERIFIED <ok|bad>``. It exits after 30 s whatever happens.
"""

import sys

from peer_process import pattern, serve

SIZE = 1 << 20
HALF = SIZE // 2


def main() -> int:
    backend = sys.argv[1] if len(sys.argv) > 1 else "tcp"
    memory = bytearray(pattern(3, SIZE))
    agent, registration, _ = serve("peer", backend, memory)
    if not agent.wait_notifs(30.0):
        print("VERIFIED bad (no notification)", flush=True)
        return 1
    notifs = agent.get_notifs()
    messages = [m for ms in notifs.values() for m in ms]
    ok = messages == [b"write-done"] and bytes(memory[HALF:]) == pattern(11, HALF)
    print(f"VERIFIED {'ok' if ok else 'bad'} {sorted(notifs)} {messages}", flush=True)
    registration.deregister()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
