"""What one gloo allreduce and one ``TCPStore`` call cost in CPU, per rank, on this host.

4 processes (gloo over loopback, one intra-op thread each, nothing else
running), a plain ``dist.all_reduce`` of float32 tensors of several sizes,
``--calls`` times each after a warm-up, then ``store.add`` and
``store.delete_key`` on the job's store. Reported per rank: CPU seconds of the
whole process (``time.process_time()``: gloo's and the store's threads
included) and wall seconds, per call, and the allreduce's CPU split by
thread (the kernel's thread names: gloo's TCP event loop ``gloo_tcp_loop``,
which makes the socket calls, gloo's workers ``pt_gloo_runloop``, the calling
thread). On a host with fewer cores than ranks the CPU of a collective comes
out of the ranks' compute; this says how much of it is per call and how much
per byte, and which thread spends it.

With ``--variants`` it also measures what else ``torch.distributed`` offers for
the same sum, each on its own gloo group of the 4 ranks: the allreduce on
groups with 1, 2 and 4 gloo worker threads (``ProcessGroupGloo._Options._threads``;
torch's default is 2), each count measured twice in opposite orders, a
``reduce`` to rank 0 then a ``broadcast``, and an ``allgather`` then a local
sum (all of zeros): whether a round's price per collective is an option's or
gloo's.

Usage::

    python -m benchmarks.collective_cpu      # ~1 min; writes benchmarks/results/collective_cpu.json
    python -m benchmarks.collective_cpu --variants --out benchmarks/results/collective_cpu_variants.json  # ~2 min
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor

from benchmarks.harness import RESULTS, cpu_by_thread_name, free_port, positive_int, process_reports

log = logging.getLogger("benchmarks.collective_cpu")
WORLD = 4
# 1,000 elements; the imbalance benchmark's MLP gradient with the fused round header of its time (547,338 + 320;
# 4 ranks' header is 384 elements today). The heterogeneity benchmark's CNN round: 29,930 (29,546 + 384).
SIZES = (1_000, 547_658)


def _per_call(fn: Any, calls: int) -> tuple[float, float]:
    """(CPU, wall) seconds per call of ``fn`` over ``calls`` calls, this process."""
    cpu, wall = time.process_time(), time.perf_counter()
    for i in range(calls):
        fn(i)
    return (time.process_time() - cpu) / calls, (time.perf_counter() - wall) / calls


def _gloo_group(store: Any, prefix: str, rank: int, threads: int) -> Any:
    """A gloo group of the 4 ranks over loopback with ``threads`` worker threads."""
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timedelta(seconds=120)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    options._threads = threads
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, WORLD, options)


def _variants(store: Any, rank: int, calls: int, sizes: tuple[int, ...]) -> dict[str, dict[str, dict[str, float]]]:
    """CPU and wall ms per call of each variant of the sum (``--variants``), per tensor size; every rank runs the
    same sequence, so the collectives pair up."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    groups = {threads: _gloo_group(store, f"collective_cpu/threads{threads}", rank, threads) for threads in (1, 2, 4)}
    default = groups[2]
    for numel in sizes:
        # Zeros: a sum of zeros stays zero, so no call meets an infinity or a subnormal (values of any other kind
        # grow 4x per call and overflow float32 within 64 calls); gloo's work does not depend on the values.
        tensor = torch.zeros(numel)
        gathered = [torch.empty(numel) for _ in range(WORLD)]

        def reduce_broadcast(_: int, t: Tensor = tensor) -> None:
            default.reduce([t], dist.ReduceOptions()).wait()  # to rank 0
            default.broadcast([t]).wait()

        def allgather_sum(_: int, t: Tensor = tensor, parts: list[Tensor] = gathered) -> None:
            default.allgather([parts], [t]).wait()
            t.copy_(parts[0])  # the local sum in place: no stacked copy of the 4 parts
            for part in parts[1:]:
                t.add_(part)

        # The thread counts twice, in opposite orders (1, 2, 4, then 4, 2, 1): an effect of the order (the
        # process warming up) then shows as a difference between a count's two passes.
        variants = {f"allreduce, {threads} gloo threads, pass {k}": (lambda _, g=groups[threads], t=tensor:
                                                                     g.allreduce([t]).wait())
                    for k, order in ((1, (1, 2, 4)), (2, (4, 2, 1))) for threads in order}
        variants.update({"reduce + broadcast": reduce_broadcast, "allgather + local sum": allgather_sum})
        for name, fn in variants.items():
            for i in range(20):
                fn(i)
            default.allreduce([torch.zeros(1)]).wait()  # start together
            cpu, wall = _per_call(fn, calls)
            out.setdefault(name, {})[str(numel)] = {"cpu_ms": cpu * 1e3, "wall_ms": wall * 1e3}
    default.allreduce([torch.zeros(1)]).wait()
    return out


def _rank(rank: int, port: int, calls: int, variants: bool, sizes: tuple[int, ...], queue: Any) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, WORLD, rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    out: dict[str, Any] = {"rank": rank, "allreduce": {}}
    for numel in sizes:
        tensor = torch.randn(numel)
        for _ in range(20):
            dist.all_reduce(tensor)
        dist.barrier()
        threads = cpu_by_thread_name()
        cpu, wall = _per_call(lambda _, t=tensor: dist.all_reduce(t), calls)
        by_thread = {name: (seconds - threads.get(name, 0.0)) / calls * 1e3
                     for name, seconds in cpu_by_thread_name().items()}
        out["allreduce"][str(numel)] = {"cpu_ms": cpu * 1e3, "wall_ms": wall * 1e3,
                                        "cpu_ms_by_thread": {k: v for k, v in by_thread.items() if v > 0}}
    if variants:
        out["variants"] = _variants(store, rank, calls, sizes)
    own = dist.PrefixStore(f"collective_cpu/{rank}", store)
    dist.barrier()
    add_cpu, add_wall = _per_call(lambda i: own.add(f"k{i}", 1), calls)
    delete_cpu, delete_wall = _per_call(lambda i: own.delete_key(f"k{i}"), calls)
    out["store"] = {"add": {"cpu_ms": add_cpu * 1e3, "wall_ms": add_wall * 1e3},
                    "delete_key": {"cpu_ms": delete_cpu * 1e3, "wall_ms": delete_wall * 1e3}}
    dist.barrier()
    dist.destroy_process_group()
    queue.put(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=positive_int, default=200, help="timed calls per measurement")
    parser.add_argument("--out", type=Path, default=RESULTS / "collective_cpu.json")
    parser.add_argument("--variants", action="store_true",
                        help="also the allreduce with 1, 2 and 4 gloo threads (two passes), reduce + broadcast, "
                             "allgather + sum")
    parser.add_argument("--sizes", type=positive_int, nargs="+", default=list(SIZES),
                        help="float32 elements per collective (default: %(default)s)")
    args = parser.parse_args()
    sizes = tuple(args.sizes)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, args.calls, args.variants, sizes, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    ranks = sorted(process_reports(queue, procs, timeout=600.0), key=lambda r: r["rank"])
    for p in procs:
        p.join(timeout=60)
        if p.exitcode != 0:
            raise RuntimeError(f"a rank exited with {p.exitcode}")

    def spread(values: list[float]) -> dict[str, float]:
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    summary = {
        "allreduce": {n: {k: spread([r["allreduce"][n][k] for r in ranks]) for k in ("cpu_ms", "wall_ms")}
                      for n in map(str, sizes)},
        "store": {op: {k: spread([r["store"][op][k] for r in ranks]) for k in ("cpu_ms", "wall_ms")}
                  for op in ("add", "delete_key")},
        # Per thread name, over the ranks that have such a thread (a /proc tick is 10 ms: over --calls calls
        # the per-call figure is exact to 10 ms / calls).
        "allreduce_by_thread": {
            n: {name: spread([r["allreduce"][n]["cpu_ms_by_thread"].get(name, 0.0) for r in ranks])
                for name in sorted({k for r in ranks for k in r["allreduce"][n]["cpu_ms_by_thread"]})}
            for n in map(str, sizes)},
    }
    if args.variants:
        summary["variants"] = {
            name: {n: {k: spread([r["variants"][name][n][k] for r in ranks]) for k in ("cpu_ms", "wall_ms")}
                   for n in map(str, sizes)}
            for name in ranks[0]["variants"]}
    report = {
        "world": WORLD, "calls": args.calls, "sizes": list(sizes), "cores": os.cpu_count(), "torch": torch.__version__,
        "python": platform.python_version(), "load_average_before": os.getloadavg(),
        "summary": summary, "ranks": ranks,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    for n, figures in summary["allreduce"].items():
        c, w = figures["cpu_ms"], figures["wall_ms"]
        log.info("allreduce of %s float32: CPU %.2f ms per rank [%.2f-%.2f], wall %.2f ms", n, c["median"], c["min"],
                 c["max"], w["median"])
        log.info("  by thread (median over ranks): %s", ", ".join(
            f"{name} {v['median']:.2f} ms" for name, v in summary["allreduce_by_thread"][n].items()))
    for name, by_size in summary.get("variants", {}).items():
        log.info("%s: %s", name, "; ".join(
            f"{n} float32 CPU {f['cpu_ms']['median']:.2f} ms [{f['cpu_ms']['min']:.2f}-{f['cpu_ms']['max']:.2f}], "
            f"wall {f['wall_ms']['median']:.2f} ms" for n, f in by_size.items()))
    for op, figures in summary["store"].items():
        log.info("store.%s: CPU %.3f ms per call [%.3f-%.3f], wall %.3f ms", op, figures["cpu_ms"]["median"],
                 figures["cpu_ms"]["min"], figures["cpu_ms"]["max"], figures["wall_ms"]["median"])
    log.info("wrote %s", args.out)


if __name__ == "__main__":
    main()
