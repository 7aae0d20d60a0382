"""What a one-round delay costs in progress per sample, on the heterogeneity benchmark's cnn task (one process).

``python -m benchmarks.heterogeneity`` measures time to DDP's final loss; whether abs_sgd can reach it in less time
depends on two things: its throughput, and how many samples it needs to reach that loss. This script isolates
the second. It trains the benchmark's cnn (same data, same plain SGD) sequentially, in one process, with
rounds of ``B`` samples whose mean gradient is applied ``delay`` rounds late (``delay=1`` is abs_sgd's rule
for the rank that requests the round; other ranks' gradients can be older), and counts the rounds until the
training loss (mean of the last 10 rounds) first reaches ``--target`` (default 0.221: DDP's final loss in
the benchmark, lr 0.4). ``B=512, delay=0`` is DDP's step.

No communication and no imbalance: only the arithmetic of the update rule. Rounds draw their samples with
replacement (the benchmark shuffles epochs), one seed. Results on this machine are in
docs/benchmarks.md (heterogeneity section).

Run: ``python -m benchmarks.delay_progress`` (about 2 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch

from benchmarks.harness import RESULTS
from benchmarks.heterogeneity import DEFAULT_LR, build_cnn, image_task, train_samples

log = logging.getLogger("delay_progress")


def rounds_to_loss(x: torch.Tensor, y: torch.Tensor, *, batch: int, delay: int, lr: float, target: float,
                   max_samples: int, seed: int) -> int | None:
    """Rounds of ``batch`` samples, each mean gradient applied ``delay`` rounds late, until the loss (mean of
    the last 10 rounds) reaches ``target``; ``None`` if not within ``max_samples``."""
    torch.manual_seed(seed)
    net = build_cnn()
    params = list(net.parameters())
    draw = torch.Generator().manual_seed(seed + 1)
    queue: list[tuple[torch.Tensor, ...]] = []
    losses: list[float] = []
    for r in range(max_samples // batch):
        idx = torch.randint(len(x), (batch,), generator=draw)
        loss = torch.nn.functional.cross_entropy(net(x[idx]), y[idx])
        queue.append(torch.autograd.grad(loss, params))
        losses.append(float(loss.detach()))
        if len(queue) > delay:
            with torch.no_grad():
                for p, g in zip(params, queue.pop(0)):
                    p.add_(g, alpha=-lr)
        if len(losses) >= 10 and sum(losses[-10:]) / 10 <= target:
            return r + 1
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="512:0,512:1,256:1,176:1,176:0",
                        help="comma-separated BATCH:DELAY pairs (default: DDP's step, then abs_sgd-like rounds)")
    parser.add_argument("--target", type=float, default=0.221, help="the loss to reach (DDP's final loss)")
    parser.add_argument("--lr", type=float, default=DEFAULT_LR["cnn"])
    parser.add_argument("--steps", type=int, default=120, help="the benchmark's --steps")
    parser.add_argument("--batch-size", type=int, default=128,
                        help="the benchmark's --batch-size (dataset = steps x 4 x batch size, as there)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/lightning_partial_heterogeneity"))
    parser.add_argument("--out", type=Path, default=RESULTS / "delay_progress.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args.workdir.mkdir(parents=True, exist_ok=True)
    n = train_samples(args)
    task = image_task(args.seed, n, args.workdir)
    rows = []
    for case in args.cases.split(","):
        batch, delay = (int(v) for v in case.split(":"))
        rounds = rounds_to_loss(task["x_train"], task["y_train"], batch=batch, delay=delay, lr=args.lr,
                                target=args.target, max_samples=3 * n, seed=args.seed)
        rows.append({"batch": batch, "delay": delay, "rounds": rounds,
                     "samples": rounds * batch if rounds is not None else None})
        log.info("rounds of %d, delay %d: %s rounds, %s samples", batch, delay, rounds, rows[-1]["samples"])
    ddp = next((r for r in rows if r["batch"] == 512 and r["delay"] == 0 and r["samples"]), None)
    for r in rows:
        r["samples_vs_ddp"] = r["samples"] / ddp["samples"] if ddp and r["samples"] else None
    for r in rows:
        ratio = f"{r['samples_vs_ddp']:.2f}x DDP's samples" if r["samples_vs_ddp"] else ""
        print(f"B {r['batch']:4d} delay {r['delay']}: {r['rounds']} rounds, {r['samples']} samples {ratio}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"target": args.target, "lr": args.lr, "seed": args.seed,
                                    "train_samples": n, "cases": rows},
                                   indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
