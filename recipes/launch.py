"""What a process that starts ranks needs: the rendezvous variables it must not hand on, a master port.

Used by the main job, the benchmarks (``benchmarks/harness.py``) and the tests'
launches. Standard library only: importing it costs nothing (no torch, no Lightning).
"""

from __future__ import annotations

import os
import random
import socket

#: Variables that would make a fit believe its processes were started by someone else
#: (Lightning reads them to find its cluster environment).
RANK_VARIABLES = (
    "LOCAL_RANK", "NODE_RANK", "GLOBAL_RANK", "WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RUN_ID", "GROUP_RANK", "LOCAL_WORLD_SIZE",
)


def free_port(low: int = 20000, high: int = 32000) -> int:
    """A free port below the kernel's ephemeral range (usually 32768-60999).

    Lightning's own pick binds port 0, i.e. takes a port from that range, which
    any outgoing connection (gloo opens many, and six fits run in a row) may be
    handed before rank 0's store binds it: a rare ``EADDRINUSE``.
    """
    rng = random.Random()  # not a seeded RNG: concurrent runs should not collide
    for _ in range(200):
        port = rng.randrange(low, high)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in [{low}, {high})")


def launch_environment(**extra: str) -> dict[str, str]:
    """This process's environment without the rendezvous variables, plus ``extra``: for a fresh launch."""
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARIABLES}
    env.update(extra)
    return env


def ensure_master_port() -> None:
    """Sets ``MASTER_PORT`` for a launch that has none (not torchrun, SLURM or a Lightning child)."""
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(free_port())


__all__ = ["RANK_VARIABLES", "ensure_master_port", "free_port", "launch_environment"]
