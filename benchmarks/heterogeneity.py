"""ABS-SGD against DDP under persistent heterogeneity (speed factors 1, 1, 0.5, 0.25), one invocation.

Three configurations, each a 4-process CPU fit of the imbalance benchmark's task and model
(``benchmarks/imbalance.py``: teacher-labelled 10-class data, MLP 32-512-512-512-10,
plain SGD lr 0.15 by default: see below), each over **one epoch of the same dataset**
(``--steps x 4 x --batch-size`` samples; ``abs_sgd`` trains ``--abs-epochs`` 3 epochs), with
``LoadImbalance(speed=(1, 1, 0.5, 0.25))`` (a rank with factor ``f`` sleeps so
that its batches take ``1/f`` as long):

* ``ddp``: ``--steps`` synchronous steps of ``--batch-size`` per rank;
* ``abs_sgd``: ``ABSSGDStrategy(target_samples=512)`` (``--adaptive``: with
  ``AdaptiveBatchSize``): an epoch ends when the ranks together have drawn the
  dataset's samples;
* ``no_comm``: every rank trains alone on its shard (the bound: the sum of the
  ranks' solo speeds, samples/s summed over ranks).

Reported: samples/s (all ranks), ratios to DDP and to the bound, rank 0's
training loss at the end, the held-out accuracy, and the time ABS-SGD takes to
reach DDP's final loss (rank 0's loss averaged over 10 batches, against DDP's
last 10) as a ratio of DDP's training time. Writes ``results/heterogeneity.json``
and a PNG beside it.

Why no momentum by default: a gradient applied one round late shrinks SGD's
stable step size (on a quadratic of curvature ``l``: ``lr * l < 1`` instead of
``< 2`` without momentum; with momentum 0.9, ``< 0.1`` instead of ``< 3.8``).
With DDP's lr 0.05 and momentum 0.9 abs_sgd's loss spikes (``--momentum 0.9
--lr 0.05`` shows it). ``--target-samples`` trades throughput (fewer
allreduces) against progress per sample (fewer, larger updates).

``--reference-samples B`` gives abs_sgd the linear scaling rule per round
(``ABSSGDStrategy(reference_samples=B)``). The three fits run ``--repeats`` (3)
times, interleaved; the report holds medians, each repeat's figures and the
host's steal time per fit, and a fit during which the host stole more than
``--max-steal`` (5%) of the CPU runs again (a shared VM's noise moved single
runs by up to 50%).

Run: ``.venv/bin/python benchmarks/heterogeneity.py`` (about 5 minutes, on an idle machine).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from imbalance import (  # noqa: E402
    BatchDataset,
    add_steal_arguments,
    batch_collate,
    build_mlp,
    cpu_ticks,
    evaluate,
    make_task,
    retry_while_stolen,
    steal_between,
)

SPEED = (1.0, 1.0, 0.5, 0.25)
CONFIGS = ("ddp", "abs_sgd", "no_comm")
WINDOW = 10


def run_worker(args: argparse.Namespace) -> int:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import lightning as L
    from lightning.pytorch.plugins.environments import LightningEnvironment

    import lightning_partial
    from lightning_partial.callbacks import AdaptiveBatchSize, LoadImbalance

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    L.seed_everything(args.seed, verbose=False)
    task = make_task(args.seed)
    n = args.steps * 4 * args.batch_size
    dataset = BatchDataset(task["x_train"][:n], task["y_train"][:n])
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, shuffle=True, drop_last=True,
                                         collate_fn=batch_collate)

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = build_mlp(512, 3)
            self.trace: list[tuple[float, float, int]] = []  # (time, loss, samples)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.cross_entropy(self.net(x), y)
            self.trace.append((time.perf_counter(), float(loss.detach()), len(x)))
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=args.lr, momentum=args.momentum)

    class Clock(L.Callback):
        t_start = t_end = None
        ticks = None  # the machine's (steal, total) CPU ticks at the first batch

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if self.t_start is None:
                self.t_start = time.perf_counter()
                self.ticks = cpu_ticks()

        def on_train_end(self, trainer, pl_module):
            pass

    clock = Clock()
    callbacks: list[Any] = [clock, LoadImbalance(speed=args.speed, log=False)]
    if args.run == "abs_sgd":
        strategy: Any = lightning_partial.ABSSGDStrategy(target_samples=args.target_samples,
                                                         reference_samples=args.reference_samples)
        if args.adaptive:
            callbacks.append(AdaptiveBatchSize(window=8, log=False))
    elif args.run == "no_comm":
        from baselines import NoCommStrategy

        strategy = NoCommStrategy()
    else:
        strategy = "ddp"
    model = Net()
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=4, plugins=[LightningEnvironment()],
                        max_epochs=args.abs_epochs if args.run == "abs_sgd" else 1, callbacks=callbacks, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    assert lightning_partial  # registers abs_sgd
    trainer.fit(model, loader)
    t_end = time.perf_counter()
    steal = steal_between(clock.ticks, cpu_ticks())
    test_loss, test_acc = evaluate(model.net, task["x_test"], task["y_test"])
    record = {
        "rank": trainer.global_rank,
        "t_start": clock.t_start,
        "t_end": t_end,
        "samples": sum(s for _, _, s in model.trace),
        "batches": len(model.trace),
        "trace": [(round(t - clock.t_start, 4), round(x, 5)) for t, x, _ in model.trace],
        "global_step": trainer.global_step,
        "test_loss": test_loss,
        "test_acc": test_acc,
        "steal_fraction": steal,  # of the machine's CPU while this rank trained (/proc/stat is machine-wide)
    }
    path = args.workdir / f"{args.run}.rank{trainer.global_rank}.json"
    path.with_suffix(".tmp").write_text(json.dumps(record))
    path.with_suffix(".tmp").rename(path)  # atomic: the parent reads only complete files
    return 0


def smoothed(trace: list[list[float]]) -> list[tuple[float, float]]:
    out = []
    for i in range(WINDOW - 1, len(trace)):
        out.append((trace[i][0], sum(x for _, x in trace[i - WINDOW + 1 : i + 1]) / WINDOW))
    return out


def run_fit(args: argparse.Namespace, name: str) -> dict[str, Any]:
    """One 4-process fit of configuration ``name``; its figures, rank 0's loss curve and the CPU stolen meanwhile."""
    for stale in args.workdir.glob(f"{name}.rank*.json"):
        stale.unlink()
    subprocess.run([sys.executable, __file__, "--run", name, "--workdir", str(args.workdir), "--steps",
                    str(args.steps), "--batch-size", str(args.batch_size), "--speed", ",".join(map(str, args.speed)),
                    *([] if args.target_samples is None else ["--target-samples", str(args.target_samples)]),
                    *([] if args.reference_samples is None else ["--reference-samples", str(args.reference_samples)]),
                    "--adaptive" if args.adaptive else "--no-adaptive", "--lr", str(args.lr),
                    "--momentum", str(args.momentum), "--abs-epochs", str(args.abs_epochs)], check=True, timeout=900,
                   env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    files = [args.workdir / f"{name}.rank{r}.json" for r in range(4)]
    # The launcher (rank 0) may exit before the other ranks wrote (no_comm ends without a barrier).
    deadline = time.monotonic() + 60
    while not all(f.exists() for f in files) and time.monotonic() < deadline:
        time.sleep(0.2)
    ranks = [json.loads(f.read_text()) for f in files]
    steals = [r["steal_fraction"] for r in ranks if r.get("steal_fraction") is not None]
    wall = max(r["t_end"] for r in ranks) - min(r["t_start"] for r in ranks)
    if name == "no_comm":  # each rank alone: the sum of the ranks' own speeds
        samples_per_s = sum(r["samples"] / (r["t_end"] - r["t_start"]) for r in ranks)
    else:
        samples_per_s = sum(r["samples"] for r in ranks) / wall
    curve = smoothed(ranks[0]["trace"])
    return {
        "wall_s": wall,
        "samples": [r["samples"] for r in ranks],
        "batches": [r["batches"] for r in ranks],
        "samples_per_s": samples_per_s,
        "final_loss": curve[-1][1] if curve else None,
        "test_acc": ranks[0]["test_acc"],
        "test_loss": ranks[0]["test_loss"],
        "global_step": ranks[0]["global_step"],
        "steal_fraction": max(steals) if steals else None,  # the worst rank's training interval
        "curve": curve,
    }


def run_parent(args: argparse.Namespace) -> dict[str, Any]:
    """``--repeats`` rounds of the three fits, interleaved (a slow spell of the host hits all three); medians.

    A fit during which the hypervisor stole more than ``--max-steal`` of the
    machine's CPU is run again, at most ``--steal-retries`` times (then kept).
    """
    args.workdir.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in CONFIGS}
    per_repeat: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        for name in CONFIGS:
            began = time.monotonic()
            kept = retry_while_stolen(lambda attempt, name=name: run_fit(args, name), args, f"{name}.{repeat}")
            assert kept is not None  # run_fit raises on a failed fit (check=True)
            runs[name].append(kept)
            logging.info("%s.%d: done in %.0f s (host steal %s)", name, repeat, time.monotonic() - began,
                         f"{kept['steal_fraction']:.1%}" if kept["steal_fraction"] is not None else "unknown")
        ddp, abs_, bound = (runs[n][-1] for n in CONFIGS)
        # DDP is deterministic (same loss every repeat); abs_sgd's time to reach it, against this repeat's DDP.
        target = ddp["final_loss"]
        reach = next((t for t, x in abs_["curve"] if x <= target), None) if target is not None else None
        per_repeat.append({
            "abs_vs_ddp_samples_per_s": abs_["samples_per_s"] / ddp["samples_per_s"],
            "abs_vs_bound": abs_["samples_per_s"] / bound["samples_per_s"],
            "ddp_vs_bound": ddp["samples_per_s"] / bound["samples_per_s"],
            "abs_time_to_ddp_final_loss_s": reach,
            "abs_time_to_ddp_final_loss_ratio": reach / ddp["wall_s"] if reach is not None else None,
            "abs_samples_per_round": sum(abs_["samples"]) / max(abs_["global_step"], 1),
            "ddp_samples_per_step": sum(ddp["samples"]) / max(ddp["global_step"], 1),
        })

    def median(values: list[Any]) -> Any:
        # None (a repeat that never reached DDP's loss) counts as slower than every repeat that did.
        ordered = sorted(values, key=lambda v: math.inf if v is None else v)
        lo, hi = ordered[(len(ordered) - 1) // 2], ordered[len(ordered) // 2]
        return None if lo is None or hi is None else (lo + hi) / 2

    results: dict[str, Any] = {}
    for name in CONFIGS:
        order = sorted(range(args.repeats), key=lambda i: runs[name][i]["samples_per_s"])
        # Every field of the run with the median throughput (its curve is plotted), and each
        # figure's own median over the repeats beside it.
        results[name] = {**runs[name][order[(args.repeats - 1) // 2]],
                         "median": {key: median([r[key] for r in runs[name]])
                                    for key in ("wall_s", "samples_per_s", "final_loss", "test_acc", "test_loss")},
                         "runs": [{k: v for k, v in r.items() if k != "curve"} for r in runs[name]]}
    summary = {key: median([rep[key] for rep in per_repeat]) for key in per_repeat[0]}
    summary["range"] = {key: [min((rep[key] for rep in per_repeat if rep[key] is not None), default=None),
                              max((rep[key] for rep in per_repeat if rep[key] is not None), default=None)]
                        for key in per_repeat[0]}
    summary["per_repeat"] = per_repeat
    return {"lr": args.lr, "momentum": args.momentum, "speed": args.speed, "target_samples": args.target_samples,
            "reference_samples": args.reference_samples, "adaptive": args.adaptive, "abs_epochs": args.abs_epochs,
            "steps": args.steps, "batch_size": args.batch_size, "repeats": args.repeats, "results": results,
            "summary": summary}


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    names = list(CONFIGS)
    a.bar(names, [report["results"][n]["samples_per_s"] for n in names], color=["#888", "#2a7", "#ccc"])
    a.set_ylabel("samples/s (all ranks)")
    a.set_title(f"speeds {tuple(report['speed'])}")
    for n in ("ddp", "abs_sgd"):
        curve = report["results"][n]["curve"]
        b.plot([t for t, _ in curve], [x for _, x in curve], label=n)
    if report["results"]["ddp"]["final_loss"] is not None:
        b.axhline(report["results"]["ddp"]["final_loss"], color="#888", linestyle=":")
    b.set_xlabel("seconds")
    b.set_ylabel(f"rank 0 training loss (mean of {WINDOW} batches)")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120, help="DDP steps of the epoch (dataset = steps x 4 x batch)")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    add_steal_arguments(parser)
    parser.add_argument("--repeats", type=int, default=3,
                        help="rounds of the three fits, interleaved; medians are reported (the host is noisy)")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "heterogeneity.json")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/lightning_partial_heterogeneity"))
    parser.add_argument("--speed", type=lambda v: tuple(float(x) for x in v.split(",")), default=SPEED,
                        help="per-rank speed factors (default 1,1,0.5,0.25)")
    parser.add_argument("--target-samples", type=int, default=512,
                        help="abs_sgd's target_samples (default 512: four of the fastest rank's micro-batches)")
    parser.add_argument("--reference-samples", type=int, default=None,
                        help="abs_sgd's reference_samples (the linear scaling rule per round; default: none, "
                             "the paper's sample-weighted mean)")
    parser.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=False,
                        help="abs_sgd with AdaptiveBatchSize (default: no; it costs throughput here, see the README)")
    parser.add_argument("--abs-epochs", type=int, default=3,
                        help="epochs abs_sgd trains (ddp and no_comm: one), to see when it reaches DDP's final loss")
    parser.add_argument("--lr", type=float, default=0.15)
    parser.add_argument("--momentum", type=float, default=0.0)
    parser.add_argument("--run", choices=CONFIGS, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.run is not None:
        return run_worker(args)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    report = run_parent(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    slim = {**report, "results": {k: {kk: vv for kk, vv in v.items() if kk != "curve"}
                                  for k, v in report["results"].items()}}
    args.out.write_text(json.dumps(slim, indent=1))
    plot(report, args.out.with_suffix(".png"))
    def fmt(value: Any, spec: str) -> str:
        return format(value, spec) if value is not None else "-"

    print(f"medians over {report['repeats']} repeats:")
    print(f"{'config':10} {'samples/s':>10} {'x DDP':>7} {'x bound':>8} {'loss':>7} {'test acc':>8} {'wall s':>7}")
    medians = {name: report["results"][name]["median"] for name in CONFIGS}
    for name in CONFIGS:
        m = medians[name]
        print(f"{name:10} {m['samples_per_s']:10.0f} {m['samples_per_s'] / medians['ddp']['samples_per_s']:7.2f} "
              f"{m['samples_per_s'] / medians['no_comm']['samples_per_s']:8.2f} "
              f"{fmt(m['final_loss'], '7.3f'):>7} {m['test_acc']:8.3f} {m['wall_s']:7.1f}")
    summary = report["summary"]
    print(f"abs_sgd, median [min-max] over {report['repeats']} repeats: "
          + "; ".join(f"{key} {summary[key]:.3g} [{lo:.3g}-{hi:.3g}]" if summary[key] is not None and lo is not None
                      else f"{key} {summary[key]}" for key, (lo, hi) in summary["range"].items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
