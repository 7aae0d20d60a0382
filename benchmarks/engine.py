"""Engine benchmark: overhead of the partial allreduce, and what solo buys under a straggler.

One invocation, 4 CPU ranks (processes, gloo over loopback), three measurements:

1. **Balanced overhead.** Per-round time of ``PartialAllreduce`` in ``sync`` mode
   against a plain ``dist.all_reduce`` of the same 4 MB float32 buffer, in
   alternating blocks so that both see the same machine. Goal: <= 1.10x.
2. **Solo under a straggler.** Every rank "computes" ``--compute-ms`` per step
   (a sleep, so that 4 ranks on 2 cores do not fight for CPU); each step one
   rank, drawn with a shared seed, computes ``--delay-ms`` longer. Reported:
   the fast ranks' mean step time (steps in which they were not the delayed
   one) in ``solo``, over their step time with no delay at all. Goal: <= 1.2x.
   ``sync`` under the same delays is shown for contrast.
3. **Activation latency.** In solo, the time from the first rank entering
   ``arrive`` to each other rank's communication thread seeing the round
   activated (system-wide monotonic clock), and the store's key count after
   the run (flat: old keys are deleted).

Usage::

    python -m benchmarks.engine                 # 3 runs (~2 min); writes benchmarks/results/engine.json
    python -m benchmarks.engine --repeat 1      # one run
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_partial.collectives import PartialAllreduce, PartialAllreduceConfig

log = logging.getLogger("benchmarks.engine")
TIMEOUT = datetime.timedelta(seconds=120)


def _engine(mode: str, store: dist.Store, rank: int, world: int, like: torch.Tensor, name: str) -> PartialAllreduce:
    cfg = PartialAllreduceConfig(mode=mode, normalize="world", timeout=TIMEOUT, name=name)
    return PartialAllreduce(cfg, store=store, rank=rank, world_size=world, like=like).start()


def _balanced_overhead(rank: int, world: int, store: dist.Store, numel: int, rounds: int, blocks: int) -> dict:
    like = torch.zeros(numel)
    grad = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    engine = _engine("sync", store, rank, world, like, "overhead")
    plain, ours = [], []
    for _ in range(blocks):
        dist.barrier()
        for _ in range(rounds):
            buf = grad.clone()  # a fresh gradient buffer each step, as in training
            t0 = time.perf_counter()
            dist.all_reduce(buf)
            buf.div_(world)
            plain.append(time.perf_counter() - t0)
        dist.barrier()
        for _ in range(rounds):
            t0 = time.perf_counter()
            engine.arrive(grad).release()  # release(): the engine reuses the buffer
            ours.append(time.perf_counter() - t0)
    engine.flush()
    engine.close()
    return {"plain": plain, "engine": ours}


def _straggler_run(
    rank: int, world: int, store: dist.Store, mode: str, numel: int, rounds: int, compute: float, delay: float,
    name: str,
) -> dict:
    like = torch.zeros(numel)
    grad = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    engine = _engine(mode, store, rank, world, like, name)
    chooser = random.Random(42)  # shared seed: every rank draws the same straggler
    fast, slow, arrived, activated, activator = [], [], [], [], []
    dist.barrier()
    for _ in range(rounds):
        straggler = chooser.randrange(world) if delay > 0 else -1
        t0 = time.perf_counter()
        time.sleep(compute + (delay if rank == straggler else 0.0))  # simulated compute + injected delay
        result = engine.arrive(grad)
        result.release()
        arrived.append(result.stats.arrived_at)
        activated.append(result.stats.activated_at)
        activator.append(result.stats.activator)
        (slow if rank == straggler else fast).append(time.perf_counter() - t0)
    engine.flush()
    engine.close()
    return {"fast": fast, "slow": slow, "arrived": arrived, "activated": activated, "activator": activator}


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: dict) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, False, timeout=TIMEOUT)
    dist.init_process_group("gloo", store=dist.PrefixStore("default", store), rank=rank, world_size=world)
    numel = args.mbytes * 1024 * 1024 // 4
    res: dict = {"overhead": _balanced_overhead(rank, world, store, numel, args.rounds // args.blocks, args.blocks)}
    compute, delay = args.compute_ms / 1000, args.delay_ms / 1000
    res["solo_balanced"] = _straggler_run(rank, world, store, "solo", numel, args.rounds, compute, 0.0, "b")
    res["solo_straggler"] = _straggler_run(rank, world, store, "solo", numel, args.rounds, compute, delay, "s")
    res["sync_straggler"] = _straggler_run(rank, world, store, "sync", numel, args.rounds, compute, delay, "y")
    dist.barrier()
    res["store_keys"] = store.num_keys()
    out[rank] = res
    dist.destroy_process_group()


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def _run_once(args: argparse.Namespace) -> dict:
    """One full measurement: 4 processes, the three parts above."""
    store = dist.TCPStore("127.0.0.1", 0, args.world, True, timeout=TIMEOUT, wait_for_workers=False)
    manager = mp.Manager()
    out = manager.dict()
    mp.start_processes(_worker, args=(args.world, store.port, args, out), nprocs=args.world, start_method="spawn")
    ranks = [out[r] for r in range(args.world)]
    manager.shutdown()
    return _summarise(args, ranks)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--mbytes", type=int, default=4, help="buffer size in MB (float32)")
    parser.add_argument("--rounds", type=int, default=90)
    parser.add_argument("--blocks", type=int, default=6, help="alternating blocks for the overhead comparison")
    parser.add_argument("--compute-ms", type=float, default=30.0)
    parser.add_argument("--delay-ms", type=float, default=60.0)
    parser.add_argument("--repeat", type=int, default=3, help="independent runs; the table shows medians and ranges")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "engine.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    runs = [_run_once(args) for _ in range(args.repeat)]
    keys = [k for k, v in runs[0].items() if isinstance(v, float) and k not in ("compute_ms", "delay_ms", "mbytes")]
    summary = {
        "median": {k: statistics.median(r[k] for r in runs) for k in keys},
        "min": {k: min(r[k] for r in runs) for k in keys},
        "max": {k: max(r[k] for r in runs) for k in keys},
        "runs": runs,
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    med, lo, hi = summary["median"], summary["min"], summary["max"]

    def cell(key: str, fmt: str) -> str:
        return f"{med[key]:{fmt}} [{lo[key]:{fmt}}-{hi[key]:{fmt}}]"

    rows = [
        ("4 MB allreduce, plain dist.all_reduce (ms)", cell("allreduce_ms", ".2f"), ""),
        ("4 MB allreduce, engine sync mode (ms)", cell("sync_engine_ms", ".2f"), ""),
        ("  ratio engine / plain", cell("sync_overhead_ratio", ".3f"), "goal <= 1.10"),
        ("step, balanced, solo (ms)", cell("balanced_step_ms", ".1f"), ""),
        ("fast ranks' step, 1 straggler/step, solo (ms)", cell("solo_fast_step_ms", ".1f"), ""),
        ("  ratio to balanced", cell("solo_fast_ratio", ".3f"), "goal <= 1.2"),
        ("fast ranks' step, 1 straggler/step, sync (ms)", cell("sync_fast_step_ms", ".1f"), ""),
        ("  ratio to balanced", cell("sync_fast_ratio", ".3f"), "for contrast"),
        ("activation latency, median (ms)", cell("activation_latency_median_ms", ".2f"), "goal ~1"),
        ("activation latency, p90 (ms)", cell("activation_latency_p90_ms", ".2f"), ""),
        ("store keys after all parts", cell("store_keys_after", ".0f"), ""),
    ]
    width = max(len(r[0]) for r in rows)
    log.info("median [min-max] of %d runs, %d ranks, %d rounds", args.repeat, args.world, args.rounds)
    for name, value, note in rows:
        log.info("%s  %-26s %s", name.ljust(width), value, note)
    log.info("wrote %s", args.out)
    return summary


def _summarise(args: argparse.Namespace, ranks: list[dict]) -> dict:
    # 1. overhead: per-round medians over all ranks' rounds
    plain = _median([t for r in ranks for t in r["overhead"]["plain"]])
    ours = _median([t for r in ranks for t in r["overhead"]["engine"]])
    # 2. solo under a straggler: mean step time of the ranks not delayed in that step
    balanced = _mean([t for r in ranks for t in r["solo_balanced"]["fast"]])
    solo_fast = _mean([t for r in ranks for t in r["solo_straggler"]["fast"]])
    sync_fast = _mean([t for r in ranks for t in r["sync_straggler"]["fast"]])
    # 3. activation latency: the activator's arrival -> each rank that had not
    #    arrived yet sees the round activated (its communication thread wakes up)
    latencies = []
    run = [r["solo_straggler"] for r in ranks]
    for i in range(args.rounds):
        a = run[0]["activator"][i]
        t = run[a]["arrived"][i]
        latencies += [run[k]["activated"][i] - t for k in range(args.world) if run[k]["arrived"][i] > t]
    return {
        "world": args.world,
        "mbytes": float(args.mbytes),
        "rounds": args.rounds,
        "compute_ms": args.compute_ms,
        "delay_ms": args.delay_ms,
        "allreduce_ms": plain * 1e3,
        "sync_engine_ms": ours * 1e3,
        "sync_overhead_ratio": ours / plain,
        "balanced_step_ms": balanced * 1e3,
        "solo_fast_step_ms": solo_fast * 1e3,
        "solo_fast_ratio": solo_fast / balanced,
        "sync_fast_step_ms": sync_fast * 1e3,
        "sync_fast_ratio": sync_fast / balanced,
        "activation_latency_median_ms": _median(latencies) * 1e3,
        "activation_latency_p90_ms": sorted(latencies)[int(0.9 * len(latencies))] * 1e3 if latencies else float("nan"),
        "store_keys_after": float(ranks[0]["store_keys"]),
    }


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
