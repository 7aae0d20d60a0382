"""Stores for the engine's control plane.

The engine never reuses the job's default store (whose keys Lightning and
torch own): :func:`create_store` opens a dedicated ``TCPStore`` hosted by
rank 0, whose address travels once over the default group at set-up.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Optional

import torch.distributed as dist


def clone_store(store: dist.Store) -> dist.Store:
    """A new client of ``store`` with its own connection (where the store has connections).

    A ``TCPStore`` client is one connection: a thread blocked in ``wait`` stalls
    every other call on it, so each engine thread gets its own client.
    """
    if isinstance(store, dist.HashStore):
        return store  # in-process and thread-safe: nothing to clone
    try:
        return store.clone()
    except (AttributeError, RuntimeError) as err:
        raise ValueError(
            f"cannot open a second client on a {type(store).__name__}: pass a TCPStore, FileStore or HashStore"
        ) from err


def create_store(
    *, timeout: timedelta = timedelta(minutes=30), group: Optional[dist.ProcessGroup] = None
) -> dist.TCPStore:
    """A fresh ``TCPStore`` shared by all ranks of the (initialised) default group.

    Rank 0 hosts it on a free port of ``MASTER_ADDR`` (or its host name); the
    address is broadcast once over ``group`` (default: the default group).
    Collective: every rank must call it.
    """
    if not dist.is_initialized():
        raise RuntimeError("create_store() needs torch.distributed to be initialised (init_process_group)")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    address: list[object] = [None]
    server: Optional[dist.TCPStore] = None
    if rank == 0:
        host = os.environ.get("MASTER_ADDR") or socket.getfqdn()
        server = dist.TCPStore(host, 0, world_size, True, timeout=timeout, wait_for_workers=False)
        address = [(host, server.port)]
    dist.broadcast_object_list(address, src=0, group=group)
    if server is not None:
        return server
    host, port = address[0]  # type: ignore[misc]
    return dist.TCPStore(host, port, world_size, False, timeout=timeout)
