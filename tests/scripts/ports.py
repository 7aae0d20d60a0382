"""A master port for the test launches that no outgoing connection can take meanwhile.

Lightning picks ``MASTER_PORT`` by binding port 0, which returns a port from the
kernel's ephemeral range (``ip_local_port_range``, usually 32768-60999). Between
that pick and rank 0's ``TCPStore`` binding it, any outgoing connection (gloo
opens many) may be given the same port: ``EADDRINUSE``, seen in CI. Ports below
the ephemeral range are never handed out to outgoing connections.

The port picker and the list of rendezvous variables are the launchers' own
(``recipes/launch.py``, standard library only), shared with the main job and the benchmarks.
"""

from __future__ import annotations

from recipes.launch import RANK_VARIABLES, ensure_master_port, free_port

__all__ = ["RANK_VARIABLES", "ensure_master_port", "free_port"]
