"""Entry points of the ranks that the process-based tests spawn (importable by the children)."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from lightning_partial.collectives import PartialAllreduce, PartialAllreduceConfig


def client(port: int, world_size: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, world_size, False, timeout=timedelta(seconds=30))


def sync_versus_all_reduce(rank: int, world_size: int, port: int) -> str:
    """Engine in sync mode against dist.all_reduce on the default group, bit for bit."""
    store = client(port, world_size)
    dist.init_process_group("gloo", store=dist.PrefixStore("default", store), rank=rank, world_size=world_size)
    try:
        like = torch.zeros(4096)
        cfg = PartialAllreduceConfig(mode="sync", normalize="sum", timeout=timedelta(seconds=30))
        with PartialAllreduce(cfg, store=store, rank=rank, world_size=world_size, like=like) as engine:
            engine.start()
            for step in range(10):
                g = torch.randn(4096, generator=torch.Generator().manual_seed(rank * 31 + step))
                expected = g.clone()
                dist.all_reduce(expected)
                got = engine.arrive(g).tensors[0]
                if not torch.equal(got, expected):
                    raise AssertionError(f"rank {rank}, round {step}: differs from dist.all_reduce")
            engine.flush()
        return "equal"
    finally:
        dist.destroy_process_group()


def killed_mid_run(rank: int, world_size: int, port: int, mode: str, victim: int, kill_at: int) -> str:
    """Runs rounds; the victim SIGKILLs itself at ``kill_at``; the others must raise, not hang."""
    store = client(port, world_size)
    cfg = PartialAllreduceConfig(mode=mode, timeout=timedelta(seconds=5), setup_timeout=timedelta(seconds=120))
    engine = PartialAllreduce(cfg, store=store, rank=rank, world_size=world_size, like=torch.zeros(10_000))
    engine.start()
    try:
        for step in range(10_000):
            if rank == victim and step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            engine.arrive(torch.ones(10_000))
            time.sleep(0.001)  # straggler-free pacing so that the victim is still around at kill_at
        return "completed"
    finally:
        engine.close(timeout=2)


def strategy_collectives_without_a_peer(rank: int, world_size: int, port: int, heartbeat: bool = False) -> list[str]:
    """The strategy's own collectives (barrier, broadcast, reduce, all_gather) on rank 0 while the last rank,
    alive, never joins: each raises within the group's timeout; returns their messages (the last rank: []).
    ``heartbeat``: rank 0 runs the strategy's liveness monitor (1 s), which the last rank never answers."""
    from lightning.fabric.plugins.environments import LightningEnvironment

    from lightning_partial import EagerSGDStrategy
    from lightning_partial.collectives import PartialCollectiveError, RoundStats

    store = client(port, world_size)
    # The group's timeout is the collectives' bound: 3 s, as a strategy's `timeout` would set it. It also bounds
    # the group's rendezvous, so the ranks first meet on the store (their imports end at different times).
    store.set(f"ready/{rank}", "1")
    store.wait([f"ready/{i}" for i in range(world_size)], timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.PrefixStore("default", store), rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=3))
    try:
        strategy = EagerSGDStrategy()
        strategy.cluster_environment = LightningEnvironment()
        strategy.cluster_environment.set_global_rank(rank)
        strategy.cluster_environment.set_world_size(world_size)
        strategy._make_collective_group()
        # The engine's last round (what a fit's rounds leave in round_stats).
        strategy.round_stats[0] = RoundStats(
            round_index=17, activator=0, initiator=None, synchronous=False, flush=False, fresh=(0,),
            counts=(1,) * world_size, staleness=(0,) * world_size, oldest_staleness=(0,) * world_size,
            progress=(18,) * world_size, dropped=(0,) * world_size, contributions=world_size, divisor=world_size,
        )
        if rank == world_size - 1:
            store.wait(["done"], timedelta(seconds=60))  # alive, never joining, until the others are done
            return []
        if heartbeat:
            from lightning_partial.collectives.liveness import Heartbeat

            strategy._heartbeat = Heartbeat(store, rank=rank, world_size=world_size, timeout=timedelta(seconds=1),
                                            on_dead=lambda error: None, name="test-heartbeat").start()
        messages = []
        try:
            # The first call ends at the group's timeout; gloo then closes the group's connections, and the
            # others fail at once (what each names is the point here, not its own bound).
            for call in (lambda: strategy.barrier("a test"), lambda: strategy.broadcast({"x": 1}),
                         lambda: strategy.reduce(torch.ones(2), reduce_op="sum"),
                         lambda: strategy.all_gather(torch.ones(2))):
                try:
                    call()
                    messages.append("no error")
                except PartialCollectiveError as err:
                    messages.append(f"{type(err).__name__}: {err}")
        finally:
            store.set("done", "1")
            if strategy._heartbeat is not None:
                strategy._heartbeat.stop()
        return messages
    finally:
        dist.destroy_process_group()
