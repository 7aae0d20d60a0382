"""Memory over a long fit: each rank's resident set (RSS) during a 20,000-step fit of every strategy.

For each strategy (``eager_sgd``, ``wagma_sgd``, ``ds_sync``, ``abs_sgd``, by
registry name with its defaults) one 2-rank CPU fit (``Trainer(accelerator="cpu",
devices=2)``, Lightning's popen launcher, gloo over loopback) trains a tiny MLP
(32-64-10) on 8,192 random in-memory samples, batch 16 per rank, for
``--steps`` optimizer steps (``max_steps``; under ``abs_sgd`` these are applied
rounds). No logger, checkpointing, progress bar, model summary or validation.

A callback samples every rank's RSS (``/proc/self/statm``), its live Python
objects (``gc.get_objects()``), open file descriptors and OS threads at the first
batch end at or after every ``--every`` steps (500; step 2,000, the reference,
is one of them) and at the end of training (before the strategy's own end of
fit). Per strategy and rank the parent reports RSS at the reference step, at
the end, the maximum in between, the change (end against reference) and the
largest deviation from the reference; the target: RSS within ``--tolerance``
(10%) of the reference from step 2,000 to the end. ``--tracemalloc`` also
diffs rank 0's allocations between the reference and the end (slow: for
finding what grows, not for the figures).

Usage::

    python -m benchmarks.memory_soak                          # writes benchmarks/results/memory_soak.json
    python -m benchmarks.memory_soak --steps 3000 --strategies eager_sgd,abs_sgd

Each fit runs as a subprocess of this module in worker mode (``--run STRATEGY``;
Lightning re-runs that command line for rank 1) in its own process group,
killed as a whole after ``--timeout`` seconds.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import logging
import os
import platform
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import (
    BARE_TRAINER,
    REPO,
    RESULTS,
    free_port,
    kill_group,
    launch_environment,
    module_command,
    set_threads,
    thread_environment,
)
from benchmarks.imbalance.task import BatchDataset, batch_collate, build_mlp

log = logging.getLogger("benchmarks.memory_soak")

STRATEGIES = ("eager_sgd", "wagma_sgd", "ds_sync", "abs_sgd")
WORLD = 2
SAMPLES, IN_DIM, CLASSES, WIDTH = 8192, 32, 10, 64
PAGE = os.sysconf("SC_PAGE_SIZE")
MIB = 2**20


def rss_bytes() -> int:
    """This process's current resident set (``/proc/self/statm``: pages resident)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def probe(step: int, batches: int, t0: float) -> dict[str, Any]:
    """One sample: RSS, live Python objects, open file descriptors and threads, at ``step``."""
    return {
        "step": step,
        "batches": batches,
        "t_s": round(time.perf_counter() - t0, 3),
        "rss_mib": rss_bytes() / MIB,
        "python_objects": len(gc.get_objects()),
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": len(os.listdir("/proc/self/task")),  # OS threads: gloo's and the engines' included
    }


# ---------------------------------------------------------------------- worker (one rank of one fit)
def run_worker(args: argparse.Namespace) -> int:
    """Worker mode (``--run STRATEGY``): one rank of a 2-rank fit; writes ``<workdir>/<strategy>.rank<R>.json``."""
    set_threads(1)
    import warnings

    import lightning as L
    from lightning.pytorch.plugins.environments import LightningEnvironment

    import lightning_partial  # noqa: F401 - registers the strategies

    warnings.filterwarnings("ignore")  # num_workers, max_epochs hints: printed once per rank, nothing to act on
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)

    class Classifier(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = build_mlp(WIDTH, 1)

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class MemorySampler(L.Callback):
        """Samples at the first batch end at or after each multiple of ``every`` steps, and at the train end.

        Steps are ``trainer.global_step`` (optimizer steps; abs_sgd: applied
        rounds, which may advance by 0 or several per batch). With
        ``trace``, tracemalloc runs from the train start and a snapshot is kept
        at the reference step and at the end.
        """

        def __init__(self, every: int, reference: int, trace: bool) -> None:
            self.every, self.reference, self.trace = every, reference, trace
            self.next_step = 0  # the first batch end is sampled too: the start-up level
            self.batches = 0
            self.t0 = time.perf_counter()
            self.samples: list[dict[str, Any]] = []
            self.snapshots: dict[str, tracemalloc.Snapshot] = {}

        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            self.t0 = time.perf_counter()
            if self.trace:
                tracemalloc.start(25)

        def on_train_batch_end(
            self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
        ) -> None:
            self.batches += 1
            step = trainer.global_step
            if step < self.next_step:
                return
            self.samples.append(probe(step, self.batches, self.t0))
            if self.trace and step >= self.reference and "reference" not in self.snapshots:
                self.snapshots["reference"] = tracemalloc.take_snapshot()
            self.next_step = (step // self.every + 1) * self.every
            if step < self.reference < self.next_step:
                self.next_step = self.reference

        def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            # Before the strategy's own end of fit (final flush or round): the steady state's last figure.
            self.samples.append({**probe(trainer.global_step, self.batches, self.t0), "end": True})
            if self.trace:
                self.snapshots["end"] = tracemalloc.take_snapshot()
                tracemalloc.stop()

    L.seed_everything(args.seed, verbose=False)
    g = torch.Generator().manual_seed(args.seed)
    x = torch.randn(SAMPLES, IN_DIM, generator=g)
    y = torch.randint(0, CLASSES, (SAMPLES,), generator=g)
    loader = torch.utils.data.DataLoader(
        BatchDataset(x, y), batch_size=args.batch_size, shuffle=True, drop_last=True, collate_fn=batch_collate
    )
    sampler = MemorySampler(args.every, args.reference_step, args.tracemalloc)
    trainer = L.Trainer(
        strategy=args.run,
        accelerator="cpu",
        devices=WORLD,
        plugins=[LightningEnvironment()],  # the 2 local ranks, whatever cluster environment is around
        max_steps=args.steps,
        callbacks=[sampler],
        **BARE_TRAINER,
        limit_val_batches=0,
    )
    t0 = time.perf_counter()
    trainer.fit(Classifier(), loader)
    rank = trainer.global_rank
    record: dict[str, Any] = {
        "strategy": args.run,
        "rank": rank,
        "global_step": trainer.global_step,
        "batches": sampler.batches,
        "fit_s": time.perf_counter() - t0,
        "samples": sampler.samples,
        "after_fit": probe(trainer.global_step, sampler.batches, sampler.t0),
    }
    if len(sampler.snapshots) == 2 and rank == 0:
        record["tracemalloc_growth"] = tracemalloc_growth(sampler.snapshots["reference"], sampler.snapshots["end"])
    path = args.workdir / f"{args.run}.rank{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(path)  # atomic: the parent never reads half a file
    return 0


def tracemalloc_growth(before: tracemalloc.Snapshot, after: tracemalloc.Snapshot, top: int = 25) -> list[dict]:
    """The allocation sites whose live size grew most between two snapshots (tracemalloc's own frames excluded)."""
    keep = [tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, "<frozen importlib._bootstrap>")]
    diff = after.filter_traces(keep).compare_to(before.filter_traces(keep), "traceback")
    diff.sort(key=lambda d: d.size_diff, reverse=True)
    return [
        {"size_diff_kib": d.size_diff / 1024, "count_diff": d.count_diff, "size_kib": d.size / 1024,
         "traceback": [f"{f.filename}:{f.lineno}" for f in d.traceback][-8:]}
        for d in diff[:top]
    ]


# ---------------------------------------------------------------------- parent
def source_state() -> dict[str, Any]:
    """The commit measured, and the library's files that differ from it (a shared working tree)."""
    def git(*argv: str) -> str:
        try:
            return subprocess.run(["git", *argv], cwd=REPO, capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            return ""

    return {"commit": git("rev-parse", "HEAD").strip() or None,
            "modified": [line[3:] for line in git("status", "--porcelain", "--", "lightning_partial").splitlines()]}


def run_fit(args: argparse.Namespace, strategy: str) -> tuple[list[dict], float]:
    """One strategy's 2-rank fit in its own process group; its rank records and wall time."""
    paths = [args.workdir / f"{strategy}.rank{r}.json" for r in range(WORLD)]
    for stale in paths:
        stale.unlink(missing_ok=True)
    cmd = module_command(
        "benchmarks.memory_soak", "--run", strategy, "--workdir", str(args.workdir),
        "--steps", str(args.steps), "--every", str(args.every), "--reference-step", str(args.reference_step),
        "--batch-size", str(args.batch_size), "--seed", str(args.seed),
        *(["--tracemalloc"] if args.tracemalloc else []),
    )
    env = launch_environment(**thread_environment(1), PYTHONUNBUFFERED="1", MASTER_PORT=str(free_port()))
    log_path = args.workdir / f"{strategy}.log"
    t0 = time.monotonic()
    with open(log_path, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=args.timeout)
            while rc == 0 and not all(p.exists() for p in paths) and time.monotonic() - t0 < args.timeout:
                time.sleep(0.2)  # rank 0 may exit before rank 1 has written
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            kill_group(proc.pid)  # nothing outlives its fit
            proc.wait()
    wall = time.monotonic() - t0
    if rc != 0 or not all(p.exists() for p in paths):
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-40:])
        raise RuntimeError(f"{strategy}: fit failed (exit {rc} after {wall:.0f} s); {log_path}:\n{tail}")
    return [json.loads(p.read_text()) for p in paths], wall


def summarise(rank: dict, reference_step: int, tolerance: float) -> dict[str, Any]:
    """RSS at the reference step, at the end, extremes in between, change and largest deviation (%)."""
    samples = rank["samples"]
    first = next(i for i, s in enumerate(samples) if s["step"] >= reference_step)
    window = samples[first:]
    ref, end = window[0], window[-1]
    rss = [s["rss_mib"] for s in window]
    deviation = max(abs(r - ref["rss_mib"]) for r in rss) / ref["rss_mib"] * 100
    return {
        "rank": rank["rank"],
        "reference_step": ref["step"],
        "end_step": end["step"],
        "rss_reference_mib": ref["rss_mib"],
        "rss_end_mib": end["rss_mib"],
        "rss_max_mib": max(rss),
        "rss_min_mib": min(rss),
        "change_mib": end["rss_mib"] - ref["rss_mib"],
        "change_pct": (end["rss_mib"] - ref["rss_mib"]) / ref["rss_mib"] * 100,
        "max_deviation_pct": deviation,
        "ok": deviation <= tolerance * 100,
        "python_objects": [ref["python_objects"], end["python_objects"]],
        "fds": [ref["fds"], end["fds"]],
        "threads": [ref["threads"], end["threads"]],
        "rss_first_batch_mib": samples[0]["rss_mib"],
        "rss_after_fit_mib": rank["after_fit"]["rss_mib"],
    }


def print_table(results: dict[str, dict]) -> None:
    header = (f"{'strategy':<10}{'rank':>5}{'RSS@ref MiB':>13}{'end MiB':>9}{'max MiB':>9}{'change':>9}{'MiB':>7}"
              f"{'max dev':>9}{'objects ref->end':>20}{'ms/step':>9}  verdict")
    print(header)
    print("-" * len(header))
    for name, entry in results.items():
        for r in entry["ranks"]:
            objects = f"{r['python_objects'][0]}->{r['python_objects'][1]}"
            print(f"{name:<10}{r['rank']:>5}{r['rss_reference_mib']:>13.1f}{r['rss_end_mib']:>9.1f}"
                  f"{r['rss_max_mib']:>9.1f}{r['change_pct']:>+8.2f}%{r['change_mib']:>+7.2f}"
                  f"{r['max_deviation_pct']:>8.2f}%"
                  f"{objects:>20}{entry['ms_per_step']:>9.2f}  {'ok' if r['ok'] else 'GROWS'}")


def run_parent(args: argparse.Namespace) -> dict[str, Any]:
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        raise SystemExit(f"unknown strategies {unknown}; choose from {','.join(STRATEGIES)}")
    if args.steps < args.reference_step:
        raise SystemExit(f"--steps {args.steps} < --reference-step {args.reference_step}")
    args.workdir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "settings": {
            "steps": args.steps, "every": args.every, "reference_step": args.reference_step,
            "batch_size": args.batch_size, "world": WORLD, "samples": SAMPLES, "tolerance": args.tolerance,
            "model": f"MLP {IN_DIM}-{WIDTH}-{CLASSES}", "optimizer": "SGD lr 0.01", "tracemalloc": args.tracemalloc,
        },
        "environment": {
            "torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
            "cpus": os.cpu_count(), "backend": "gloo", "threads_per_rank": 1,
            "load_average_at_start": os.getloadavg(), "source": source_state(),
        },
        "target": (f"every rank's RSS within {args.tolerance:.0%} of its value at step {args.reference_step} "
                   "until the end"),
        "results": {},
    }
    t_start = time.monotonic()
    for name in strategies:
        log.info("%s: %d steps, 2 ranks ...", name, args.steps)
        ranks, wall = run_fit(args, name)
        fit_s = max(r["fit_s"] for r in ranks)
        entry = {
            "wall_s": wall,
            "fit_s": fit_s,
            "ms_per_step": fit_s / args.steps * 1e3,
            "ranks": [summarise(r, args.reference_step, args.tolerance) for r in ranks],
            "samples": {str(r["rank"]): r["samples"] for r in ranks},
        }
        for r in ranks:
            if "tracemalloc_growth" in r:
                entry["tracemalloc_growth_rank0"] = r["tracemalloc_growth"]
        report["results"][name] = entry
        for r in entry["ranks"]:
            log.info("%s rank %d: %.1f MiB at step %d, %.1f at the end (%+.2f%%), max deviation %.2f%%: %s",
                     name, r["rank"], r["rss_reference_mib"], r["reference_step"], r["rss_end_mib"],
                     r["change_pct"], r["max_deviation_pct"], "ok" if r["ok"] else "GROWS")
        report["total_wall_s"] = time.monotonic() - t_start
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")  # a partial run still leaves its numbers
    report["environment"]["load_average_at_end"] = os.getloadavg()
    report["all_ok"] = all(r["ok"] for e in report["results"].values() for r in e["ranks"])
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    log.info("wrote %s (%.0f s in all)", args.out, report["total_wall_s"])
    print_table(report["results"])
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20_000, help="optimizer steps per fit (max_steps)")
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated subset")
    parser.add_argument("--out", type=Path, default=RESULTS / "memory_soak.json")
    parser.add_argument("--every", type=int, default=500, help="steps between samples")
    parser.add_argument("--reference-step", type=int, default=2000, help="the step the end is compared with")
    parser.add_argument("--tolerance", type=float, default=0.10, help="largest allowed deviation from the reference")
    parser.add_argument("--batch-size", type=int, default=16, help="per-rank batch size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per fit before its processes are killed")
    parser.add_argument("--tracemalloc", action="store_true", help="diff rank 0's allocations, reference to end (slow)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/memory_soak"), help="rank records and fit logs")
    parser.add_argument("--run", choices=STRATEGIES, default=None, help=argparse.SUPPRESS)  # worker mode
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.run is not None:
        return run_worker(args)
    run_parent(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
