"""A master port for the test launches that no outgoing connection can take meanwhile.

Lightning picks ``MASTER_PORT`` by binding port 0, which returns a port from the
kernel's ephemeral range (``ip_local_port_range``, usually 32768-60999). Between
that pick and rank 0's ``TCPStore`` binding it, any outgoing connection (gloo
opens many) may be given the same port: ``EADDRINUSE``, seen in CI. Ports below
the ephemeral range are never handed out to outgoing connections.

The port picker and the list of rendezvous variables are the main job's
(``recipes/main_job.py``, which imports no more than the standard library).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `recipes` is not an installed package

from recipes.main_job import RANK_VARIABLES, free_port  # noqa: E402

__all__ = ["RANK_VARIABLES", "ensure_master_port", "free_port"]


def ensure_master_port() -> None:
    """Sets ``MASTER_PORT`` for a launch that has none (not torchrun, SLURM or a Lightning child)."""
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(free_port())
