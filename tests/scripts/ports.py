"""A master port for the test launches that no outgoing connection can take meanwhile.

Lightning picks ``MASTER_PORT`` by binding port 0, which returns a port from the
kernel's ephemeral range (``ip_local_port_range``, usually 32768-60999). Between
that pick and rank 0's ``TCPStore`` binding it, any outgoing connection (gloo
opens many) may be given the same port: ``EADDRINUSE``, seen in CI. Ports below
the ephemeral range are never handed out to outgoing connections.
"""

from __future__ import annotations

import os
import random
import socket

_LOW, _HIGH = 20000, 32000


def free_port() -> int:
    """A port in ``[20000, 32000)`` that is free to bind on 127.0.0.1 now."""
    rng = random.Random()  # not the tests' seeded RNG: concurrent sessions should not collide
    for _ in range(200):
        port = rng.randrange(_LOW, _HIGH)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in [{_LOW}, {_HIGH}) after 200 tries")


def ensure_master_port() -> None:
    """Sets ``MASTER_PORT`` for a launch that has none (not torchrun, SLURM or a Lightning child)."""
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(free_port())
