"""Control-plane soak: the store's key count and the store host's memory over many rounds.

4 ranks as threads (one process, a real TCPStore on loopback), 1-element
tensors, solo mode with ``max_staleness`` (so every key kind is exercised).
Reports the number of keys in the store and the process's RSS every
``--every`` rounds; flat numbers mean old keys are deleted.

Usage::

    python -m benchmarks.store_soak --rounds 100000     # writes benchmarks/results/store_soak.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import resource
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_partial.collectives import PartialAllreduce, PartialAllreduceConfig

log = logging.getLogger("benchmarks.store_soak")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=100_000)
    parser.add_argument("--every", type=int, default=10_000)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "store_soak.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", 0, args.world, True, timeout=timeout, wait_for_workers=False)
    samples: list[dict] = []
    errors: list[BaseException] = []
    cfg = PartialAllreduceConfig(mode="solo", max_staleness=2, timeout=timeout)

    def rank_main(rank: int) -> None:
        try:
            e = PartialAllreduce(cfg, store=store.clone(), rank=rank, world_size=args.world, like=torch.zeros(1))
            e.start()
            one = torch.ones(1)
            t0 = time.perf_counter()
            for step in range(args.rounds):
                e.arrive(one).release()
                if rank == 0 and (step + 1) % args.every == 0:
                    samples.append(
                        {
                            "round": step + 1,
                            "keys": store.num_keys(),
                            "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                            "rounds_per_s": (step + 1) / (time.perf_counter() - t0),
                        }
                    )
                    log.info("%s", samples[-1])
                    write(samples)  # a partial run still leaves its numbers
            e.flush()
            e.close()
        except BaseException as err:  # noqa: BLE001
            errors.append(err)
            raise

    def write(done: list[dict]) -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"rounds": args.rounds, "world": args.world, "samples": done}, indent=2) + "\n")

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(args.world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    write(samples)
    log.info("wrote %s", args.out)
    return {"rounds": args.rounds, "world": args.world, "samples": samples}


if __name__ == "__main__":
    main()
