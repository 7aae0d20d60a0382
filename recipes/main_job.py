"""The main job: one recipe on built-in data, 4 CPU processes, injected stragglers, DDP against every strategy.

    python -m recipes.main_job

For each strategy (``ddp`` first, then ``eager_sgd``, ``eager_sgd_majority``,
``eager_sgd_backup``, ``wagma_sgd``, ``ds_sync`` and ``abs_sgd``) it runs
the reference recipe (``cifar_resnet``: a small ResNet-20 on the built-in
images, noisy enough that DDP ends near 90% instead of saturating) as its own
4-process fit::

    python -m recipes.cifar_resnet fit --config conf/main_job.yaml --trainer.strategy <strategy> ...

with Lightning's progress bar, a ``LoadImbalance`` straggler (1 of the 4 ranks,
drawn per batch with a shared seed, sleeps ``imbalance.delay_ms`` before its
forward pass), and an offline W&B run per strategy. Every fit trains for the
same number of epochs (the same samples in total, also under ``abs_sgd``,
whose epochs end by global samples) with the config's own optimizer (SGD,
momentum 0.9): no strategy gets settings of its own, so the table compares
strategies, not tunings. Then it prints a table (throughput, ratio to DDP,
held-out accuracy of rank 0's final model), writes a PNG plot and a JSON
file, and lists the W&B runs.

Throughput is measured per rank from its first batch to the end of the fit
(after the strategies' final synchronisation; Lightning's start-up excluded)
by ``recipes.summary.FitSummary``; samples/s is the sum over the ranks.

Options: ``--strategies ddp,eager_sgd``, ``--recipe`` (with its main-job
``--config`` by default: ``cifar_resnet``, ``translation_transformer``; another
recipe needs ``--config``), ``--config``,
``--devices``, ``--delay-ms``, ``--out``, ``--logger csv``, ``--timeout``;
anything after ``--`` goes to every fit's command line (e.g.
``-- --trainer.max_epochs 2``).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

from recipes.launch import free_port, launch_environment

log = logging.getLogger("recipes.main_job")

ROOT = Path(__file__).resolve().parent.parent
ALL_STRATEGIES = ("ddp", "eager_sgd", "eager_sgd_majority", "eager_sgd_backup", "wagma_sgd", "ds_sync", "abs_sgd")
LABELS = {
    "ddp": "DDP", "eager_sgd": "eager-SGD solo", "eager_sgd_majority": "eager-SGD majority",
    "eager_sgd_backup": "eager-SGD, 1 backup worker",
    "wagma_sgd": "WAGMA-SGD", "ds_sync": "DS-Sync", "abs_sgd": "ABS-SGD",
}


def fit_command(args: argparse.Namespace, strategy: str, records: Path) -> list[str]:
    """The command line of one strategy's fit (Lightning re-runs it for ranks 1..P-1).

    The fits differ only in their strategy (and where their records and logs go): no
    strategy gets options of its own. The user's ``--`` options come last (they win).
    """
    command = [
        sys.executable, "-m", f"recipes.{args.recipe}", "fit", "--config", str(args.config),
        "--trainer.strategy", strategy, "--trainer.devices", str(args.devices),
        "--summary.out_dir", str(records), "--summary.evaluate", "true",
    ]
    if args.delay_ms is not None:
        command += ["--imbalance.delay_ms", repr(args.delay_ms)]
    if args.logger == "wandb":
        command += ["--trainer.logger.save_dir", str(args.out), "--trainer.logger.name", f"main_job-{strategy}"]
    else:
        command += ["--config", str(ROOT / "conf" / "loggers" / "csv.yaml"), "--trainer.logger.save_dir",
                    str(args.out / "csv"), "--trainer.logger.name", strategy]
    return command + list(args.extra)


def run_fit(args: argparse.Namespace, strategy: str) -> dict[str, Any]:
    """One strategy's fit in its own process group (killed whole on timeout); returns its rank records."""
    records = args.out / "records" / strategy
    records.mkdir(parents=True, exist_ok=True)
    for stale in records.glob("rank*.json"):
        stale.unlink()
    # W&B's mode is the logger's to decide (lightning_partial.loggers: offline unless WANDB_MODE says otherwise).
    env = launch_environment(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                             MASTER_PORT=str(free_port()))
    command = fit_command(args, strategy, records)
    log.info("==> %s: %s", strategy, " ".join(command[1:]))
    t0 = time.monotonic()
    # Progress bar and logs go straight to this terminal; a new session so that a
    # time-out kills rank 0 and the ranks Lightning started together.
    proc = subprocess.Popen(command, cwd=ROOT, env=env, start_new_session=True)
    rc: Optional[int] = None
    try:
        rc = proc.wait(timeout=args.timeout)
        deadline = time.monotonic() + 60  # ranks 1.. may finish writing after rank 0 exits
        while rc == 0 and len(list(records.glob("rank*.json"))) < args.devices and time.monotonic() < deadline:
            time.sleep(0.2)
    except subprocess.TimeoutExpired:
        log.error("%s: no result after %.0f s: killing its processes", strategy, args.timeout)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # leftovers (also on Ctrl-C): nothing outlives its fit
        except ProcessLookupError:
            pass
        proc.wait()
    elapsed = time.monotonic() - t0
    ranks = sorted((json.loads(p.read_text()) for p in records.glob("rank*.json")), key=lambda r: r["rank"])
    ok = rc == 0 and len(ranks) == args.devices
    if not ok:
        log.error("%s failed (exit status %s, %d of %d rank records)", strategy, rc, len(ranks), args.devices)
    return {"strategy": strategy, "ok": ok, "returncode": rc, "elapsed_s": elapsed, "ranks": ranks}


def summarise(run: dict[str, Any]) -> dict[str, Any]:
    """Figures of one fit from its rank records."""
    ranks = run["ranks"]
    r0 = ranks[0]
    return {
        "batches_per_s": statistics.fmean(r["batches_per_s"] for r in ranks),
        "samples_per_s": sum(r["samples_per_s"] for r in ranks),
        "samples": sum(r["samples"] for r in ranks),
        "wall_s": max(r["wall_s"] for r in ranks),
        "val_acc": r0.get("val_acc", float("nan")),
        "val_loss": r0.get("val_loss", float("nan")),
        "replicas_identical": len({r["parameter_digest"] for r in ranks}) == 1,
        "loss_curve": r0["losses"],
    }


def add_ratios(results: dict[str, dict[str, Any]]) -> None:
    """Throughput ratio and accuracy difference to DDP, where DDP ran."""
    ddp = results.get("ddp", {}).get("summary")
    for entry in results.values():
        s = entry.get("summary")
        if s is None:
            continue
        s["x_ddp"] = s["samples_per_s"] / ddp["samples_per_s"] if ddp else None
        s["acc_vs_ddp_points"] = (s["val_acc"] - ddp["val_acc"]) * 100 if ddp else None


def _fmt(value: Optional[float], spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def table(results: dict[str, dict[str, Any]], chance: Optional[float]) -> str:
    """The final table, as text."""
    header = (f"{'strategy':<20}{'batches/s':>10}{'samples/s':>11}{'x DDP':>8}{'accuracy %':>12}{'vs DDP':>8}"
              f"{'fit s':>8}{'run s':>7}  replicas")
    lines = [header, "-" * len(header)]
    for name, entry in results.items():
        s = entry.get("summary")
        if s is None:
            lines.append(f"{name:<20}  failed")
            continue
        lines.append(
            f"{name:<20}{s['batches_per_s']:>10.2f}{s['samples_per_s']:>11.0f}{_fmt(s['x_ddp'], '.2f'):>8}"
            f"{s['val_acc'] * 100:>12.2f}{_fmt(s['acc_vs_ddp_points'], '+.2f'):>8}{s['wall_s']:>8.1f}"
            f"{entry['elapsed_s']:>7.0f}  {'identical' if s['replicas_identical'] else 'DIFFER'}"
        )
    if chance is not None:
        lines.append(f"(chance: {chance * 100:.0f}%; accuracy: rank 0's final model on the held-out built-in set; "
                     "throughput: sum over ranks, first batch to end of fit)")
    return "\n".join(lines)


def plot(results: dict[str, dict[str, Any]], path: Path, title: str) -> None:
    """Throughput relative to DDP, accuracy, and rank 0's loss against time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n, e in results.items() if e.get("summary")]
    labels = [LABELS.get(n, n) for n in names]
    colors = ["tab:gray" if n == "ddp" else "tab:orange" for n in names]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    ratios = [results[n]["summary"]["x_ddp"] or float("nan") for n in names]
    axes[0].bar(range(len(names)), ratios, color=colors)
    axes[0].axhline(1.0, color="k", lw=0.8)
    axes[0].set_ylabel("samples/s relative to DDP")
    axes[0].set_title("Throughput under injected stragglers")
    accs = [results[n]["summary"]["val_acc"] * 100 for n in names]
    axes[1].bar(range(len(names)), accs, color=colors)
    axes[1].set_ylabel("held-out accuracy of rank 0's model (%)")
    axes[1].set_title("Accuracy after the same samples")
    for ax, values, spec in ((axes[0], ratios, "{:.2f}"), (axes[1], accs, "{:.1f}")):
        ax.set_xticks(range(len(names)), labels, rotation=30, ha="right", fontsize=8)
        for i, v in enumerate(values):
            if not math.isnan(v):
                ax.text(i, v, spec.format(v), ha="center", va="bottom", fontsize=8)
    for n, label in zip(names, labels):
        curve = results[n]["summary"]["loss_curve"]
        if curve:
            t, loss = zip(*curve)
            window = 8
            smooth = [statistics.fmean(loss[max(0, i - window + 1) : i + 1]) for i in range(len(loss))]
            axes[2].plot(t, smooth, label=label, lw=1.2, ls="--" if n == "ddp" else "-")
    axes[2].set_xlabel("rank 0's training time (s)")
    axes[2].set_ylabel("training loss (8-batch mean)")
    axes[2].set_title("Loss against time (rank 0)")
    axes[2].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


#: Each recipe's main-job configuration, the default of ``--config`` (another recipe needs ``--config``).
MAIN_JOB_CONFIGS = {"cifar_resnet": "main_job.yaml", "translation_transformer": "main_job_transformer.yaml"}


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        extra, argv = argv[argv.index("--") + 1 :], argv[: argv.index("--")]
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--recipe", default="cifar_resnet", help="the recipe (recipes/<recipe>.py)")
    parser.add_argument("--config", type=Path, default=None,
                        help="the fits' configuration (model and data sizes, epochs, imbalance, logger); default: "
                             "the recipe's main-job config ("
                             + ", ".join(f"{r}: conf/{c}" for r, c in MAIN_JOB_CONFIGS.items()) + ")")
    parser.add_argument("--strategies", default=",".join(ALL_STRATEGIES), help="comma-separated, ddp first")
    parser.add_argument("--devices", type=int, default=4, help="CPU processes per fit")
    parser.add_argument("--delay-ms", type=float, default=None, help="straggler delay (default: the config's)")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "main_job", help="results, plot, W&B runs")
    parser.add_argument("--logger", choices=("wandb", "csv"), default="wandb", help="wandb (offline) or csv")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per fit before it is killed")
    args = parser.parse_args(argv)
    args.extra = extra
    args.out = args.out.resolve()
    if args.config is None:
        if args.recipe not in MAIN_JOB_CONFIGS:
            parser.error(f"--recipe {args.recipe} has no main-job configuration: pass --config (a complete one, "
                         f"e.g. conf/{args.recipe}.yaml with its sizes cut down); the main-job configurations: "
                         + ", ".join(f"{r}: conf/{c}" for r, c in MAIN_JOB_CONFIGS.items()))
        args.config = ROOT / "conf" / MAIN_JOB_CONFIGS[args.recipe]
    args.config = args.config.resolve()
    if not args.config.is_file():
        parser.error(f"--config: {args.config} does not exist")
    if not (ROOT / "recipes" / f"{args.recipe}.py").is_file():
        parser.error(f"--recipe: no recipes/{args.recipe}.py")
    if args.devices < 1:
        parser.error(f"--devices must be >= 1, got {args.devices}")
    names = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = [s for s in names if s not in ALL_STRATEGIES]
    if unknown or not names:
        parser.error(f"--strategies: unknown {unknown}; choose from {','.join(ALL_STRATEGIES)}")
    args.strategy_list = names
    return args


def main(argv: Optional[list[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    if args.logger == "wandb":
        from lightning_partial.loggers import offline_runs  # the fits' logger writes them

        before = offline_runs(args.out)
    results: dict[str, dict[str, Any]] = {}
    for strategy in args.strategy_list:
        run = run_fit(args, strategy)
        results[strategy] = {"elapsed_s": run["elapsed_s"], "returncode": run["returncode"], "ranks": run["ranks"]}
        if run["ok"]:
            results[strategy]["summary"] = summarise(run)
    add_ratios(results)
    total = time.monotonic() - t0
    chance = None
    config_text = args.config.read_text()
    if "synthetic_classes" in config_text:  # the built-in data's classes, for the "chance" line
        for line in config_text.splitlines():
            if line.strip().startswith("synthetic_classes:"):
                chance = 1.0 / int(line.split(":", 1)[1].split("#")[0])
    for i, part in enumerate(args.extra):  # the fits' own options win over the config's
        if part.startswith("--data.synthetic_classes"):
            value = part.partition("=")[2] or (args.extra[i + 1] if i + 1 < len(args.extra) else "")
            if value.isdigit() and int(value) > 0:
                chance = 1.0 / int(value)
    title = (f"recipe {args.recipe}, {args.devices} CPU processes, built-in data, "
             f"config {args.config.name}{' ' + ' '.join(args.extra) if args.extra else ''}")
    payload = {"recipe": args.recipe, "config": str(args.config), "devices": args.devices, "extra": args.extra,
               "delay_ms": args.delay_ms, "total_s": total, "results": results,
               "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None}
    (args.out / "results.json").write_text(json.dumps(payload, indent=1) + "\n")
    plotted = any(e.get("summary") for e in results.values())
    if plotted:
        plot(results, args.out / "main_job.png", title)
    print()
    print(table(results, chance))
    print()
    print(f"main job: {len(results)} fits in {total:.0f} s; results {args.out / 'results.json'}, "
          + (f"plot {args.out / 'main_job.png'}" if plotted else "no plot (no fit succeeded)"))
    if args.logger == "wandb":
        new_runs = sorted(offline_runs(args.out) - before)
        print(f"W&B offline runs ({len(new_runs)}): " + (", ".join(str(p) for p in new_runs) or "none"))
        if new_runs:
            print(f"upload later with: wandb sync {new_runs[0].parent}/offline-run-*")
    return 0 if all(e.get("summary") for e in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
