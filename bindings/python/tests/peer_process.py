"""What the two-process tests share: the backends to run, patterned memory, and the peer
processes themselves (the test side spawns a peer script and reads its READY line; the peer
side registers its memory, opens a side channel and prints that line)."""

import os
import subprocess
import sys

import pd_xfer

HERE = os.path.dirname(os.path.abspath(__file__))
BACKENDS = [b for b in ("tcp", "ucx") if b in pd_xfer.Agent.available_backends()]


def pattern(seed: int, n: int, step: int = 7) -> bytes:
    return bytes((i * step + seed) % 251 for i in range(n))


def spawn(script: str, backend: str, stdin: bool = False) -> tuple[subprocess.Popen, list[str]]:
    """Starts ``script`` (next to this file) for ``backend``; returns it and its READY line's
    fields after the word READY: port, agent name, address, length."""
    env = dict(os.environ, UCX_NET_DEVICES=os.environ.get("UCX_NET_DEVICES", "lo"))
    proc = subprocess.Popen(
        [sys.executable, os.path.join(HERE, script), backend],
        stdin=subprocess.PIPE if stdin else None, stdout=subprocess.PIPE, text=True, env=env,
    )
    line = proc.stdout.readline().split()
    if not line or line[0] != "READY":
        proc.kill()
        proc.wait(timeout=10)
        raise AssertionError(f"{script} did not start: {line}")
    return proc, line[1:]


def stop(proc: subprocess.Popen) -> None:
    """Lets a peer that reads stdin end on EOF; kills it if it does not within 10 s."""
    if proc.stdin is not None:
        proc.stdin.close()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def serve(prefix: str, backend: str, memory: bytearray) -> tuple[pd_xfer.Agent, object, int]:
    """The peer side: an agent named ``prefix-backend`` serving ``memory`` on a side channel,
    announced with ``READY <port> <name> <addr> <len>``. Returns the agent, the registration
    (keep it alive) and the memory's address."""
    agent = pd_xfer.Agent(f"{prefix}-{backend}")
    agent.add_backend(backend)
    registration = pd_xfer.register(agent, memory)
    (addr, length, _dev), = registration.descs()
    _, port = agent.start_side_channel("127.0.0.1:0")
    print(f"READY {port} {agent.name} {addr} {length}", flush=True)
    return agent, registration, addr
