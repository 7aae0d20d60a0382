"""What ``max_staleness`` alone costs under the imbalance protocol, with free communication.

``python -m benchmarks.imbalance`` measures eager-SGD solo against the no-communication
bound under the paper's protocol: every step one of ``P`` ranks, drawn with a
shared seed, sleeps ``D`` before its compute ``C``. This script computes the
fraction of the bound that the staleness gate by itself leaves, with
communication taking no time and no CPU. It is an exact simulation of the
gate, not a measurement: nothing runs in parallel.

The model is the engine's activation rule. Round ``q`` activates once a rank
has arrived at step ``q`` (solo) and every rank has arrived at step ``q - s``
(``max_staleness=s``). A rank blocks in ``arrive(q)`` until round ``q`` has
completed. So with ``A_i(q)`` the time rank ``i`` arrives at step ``q``:

    A_i(q) = T_i(q - 1) + C + D * [i is step q's straggler]
    T_i(q) = max(A_i(q), max_j A_j(q - s))

Throughput is counted as in ``benchmarks.imbalance``: the sum over ranks of
``steps / T_i``, divided by the same sum for ranks that never wait (the bound).
``s = 0`` is DDP without communication (one straggler every step): 1.5 / 3 = 0.5.

Run: ``python -m benchmarks.staleness_model`` (a second or two; no torch).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
from pathlib import Path
from typing import Optional

log = logging.getLogger(__name__)
HERE = Path(__file__).resolve().parent


def fraction_of_bound(
    max_staleness: Optional[int], *, ranks: int, steps: int, delay: float, stragglers: int, seed: int
) -> float:
    """One run of the gate with compute 1 and straggler delay ``delay``; returns throughput / bound."""
    rng = random.Random(seed)
    finished = [0.0] * ranks  # T_i(q - 1)
    alone = [0.0] * ranks  # the same rank never waiting (no-communication bound)
    arrivals: list[list[float]] = []  # A_j(q) for every step so far
    for q in range(steps):
        slow = set(rng.sample(range(ranks), stragglers))
        cost = [1.0 + (delay if i in slow else 0.0) for i in range(ranks)]
        arrived = [finished[i] + cost[i] for i in range(ranks)]
        arrivals.append(arrived)
        gate = max(arrivals[q - max_staleness]) if max_staleness is not None and q >= max_staleness else 0.0
        finished = [max(a, gate) for a in arrived]
        alone = [alone[i] + cost[i] for i in range(ranks)]
    return sum(steps / t for t in finished) / sum(steps / t for t in alone)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=250, help="steps per rank (the imbalance benchmark's default)")
    parser.add_argument("--delay", type=float, default=2.0, help="straggler delay D in units of the step compute C")
    parser.add_argument("--stragglers", type=int, default=1, help="ranks that sleep each step")
    parser.add_argument("--repeats", type=int, default=200, help="seeds averaged per setting")
    parser.add_argument("--staleness", default="0,1,2,3,4,6,8,12,none", help="comma-separated; 'none' is unbounded")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "staleness_model.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not 1 <= args.stragglers < args.ranks:
        raise SystemExit(f"--stragglers must be in 1..{args.ranks - 1}, got {args.stragglers}")
    if args.steps < 1 or args.repeats < 1 or args.delay < 0:
        raise SystemExit("--steps and --repeats must be >= 1 and --delay >= 0")
    settings: list[Optional[int]] = []
    for token in args.staleness.split(","):
        token = token.strip().lower()
        value = None if token == "none" else int(token)
        if value is not None and value < 0:
            raise SystemExit(f"max_staleness must be >= 0 or 'none', got {token}")
        settings.append(value)

    rows = []
    log.info("max_staleness  fraction of the no-communication bound (communication free)")
    for s in settings:
        fractions = [
            fraction_of_bound(s, ranks=args.ranks, steps=args.steps, delay=args.delay,
                              stragglers=args.stragglers, seed=seed)
            for seed in range(args.repeats)
        ]
        mean = statistics.fmean(fractions)
        rows.append({"max_staleness": s, "fraction_of_bound": mean, "min": min(fractions), "max": max(fractions)})
        log.info("%13s  %.3f  [%.3f-%.3f]", "none" if s is None else s, mean, min(fractions), max(fractions))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    parameters = {k: v for k, v in vars(args).items() if k != "out"}  # not the local path
    args.out.write_text(json.dumps({"parameters": parameters, "rows": rows}, indent=2))
    log.info("wrote %s", args.out)


if __name__ == "__main__":
    main()
