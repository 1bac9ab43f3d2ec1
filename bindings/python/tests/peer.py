"""The far side of test_native.py, in its own process: an agent that serves 1 MiB of patterned
memory on a side channel, then checks what the test wrote into it.

Protocol on stdout (one line each): ``READY <port> <name> <addr> <len>``, then after the
test's ``write-done`` notification ``VERIFIED <ok|bad>``. It exits after 30 s whatever happens.
"""

import sys

import pd_xfer

SIZE = 1 << 20
HALF = SIZE // 2


def pattern(seed: int, n: int) -> bytes:
    return bytes((i * 7 + seed) % 251 for i in range(n))


def main() -> int:
    backend = sys.argv[1] if len(sys.argv) > 1 else "tcp"
    agent = pd_xfer.Agent("peer-" + backend)
    agent.add_backend(backend)
    memory = bytearray(pattern(3, SIZE))
    registration = pd_xfer.register(agent, memory)
    (addr, length, _dev), = registration.descs()
    _, port = agent.start_side_channel("127.0.0.1:0")
    print(f"READY {port} {agent.name} {addr} {length}", flush=True)
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
