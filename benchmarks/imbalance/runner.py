"""The imbalance benchmark's parent: calibration of the delay, every configuration's fit, the command line.

Only the standard library and torch at module level: the calibration processes
(spawned) and the parent import this module, and importing Lightning costs
~8 s a process on this machine. The worker mode imports Lightning itself.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import (
    RESULTS,
    add_device_argument,
    add_steal_arguments,
    launch_environment,
    module_command,
    positive_int,
    process_reports,
    retry_while_stolen,
    run_in_group,
    set_threads,
    thread_environment,
)
from benchmarks.imbalance.configs import CONFIGS, WORLD, Config
from benchmarks.imbalance.report import (
    FIGURES,
    add_ratios,
    environment,
    goal_figures,
    plot,
    print_table,
    summarise_run,
)
from benchmarks.imbalance.task import (
    CLASSES,
    IN_DIM,
    TEST_SAMPLES,
    TRAIN_SAMPLES,
    build_mlp,
)
from benchmarks.imbalance.worker import abs_sgd_epochs, catches_up

log = logging.getLogger("benchmarks.imbalance")
PACKAGE_DOC = sys.modules["benchmarks.imbalance"].__doc__ or ""


def _calibration_process(
    batch_size: int, width: int, depth: int, steps: int, rounds: int, barrier: Any, queue: Any, threads: int = 1
) -> None:
    """One calibration process: mean wall time of forward + backward + SGD step, ``threads`` threads, per round."""
    set_threads(threads)
    torch.manual_seed(0)
    net = build_mlp(width, depth)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch_size, IN_DIM)
    y = torch.randint(0, CLASSES, (batch_size,))

    def step() -> None:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        optimizer.step()

    for _ in range(5):  # warm-up: allocator, first-touch page faults
        step()
    means = []
    for _ in range(rounds):
        barrier.wait()  # concurrent processes time the same interval of machine time
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        means.append((time.perf_counter() - t0) / steps)
    queue.put(means)


def calibrate(
    batch_size: int, width: int, depth: int, steps: int = 15, rounds: int = 5, timeout: float = 120.0,
    threads: int = 1,
) -> dict[str, Any]:
    """Per-step compute time, alone and with ``WORLD`` processes competing for the cores as the ranks do.

    Each figure is the median over ``rounds`` short rounds (mean over the
    processes within a round): on a shared machine one burst of someone
    else's load would otherwise set ``D`` for the whole benchmark.
    """
    ctx = mp.get_context("spawn")
    result: dict[str, Any] = {}
    for procs, key in ((1, "single_process"), (WORLD, "concurrent")):
        barrier, queue = ctx.Barrier(procs), ctx.Queue()
        workers = [
            ctx.Process(
                target=_calibration_process,
                args=(batch_size, width, depth, steps, rounds, barrier, queue, threads),
                daemon=True,
            )
            for _ in range(procs)
        ]
        for w in workers:
            w.start()
        try:
            per_process = process_reports(queue, workers, timeout)
        finally:
            for w in workers:
                w.join(timeout=10)
                if w.is_alive():
                    w.kill()
        per_round = [statistics.fmean(p[i] for p in per_process) * 1e3 for i in range(rounds)]
        result[f"{key}_ms"] = statistics.median(per_round)
        result[f"{key}_rounds_ms"] = [round(x, 2) for x in per_round]
    result["concurrent_processes"] = WORLD
    result["threads_per_process"] = threads
    result["cores"] = os.cpu_count() or 0
    return result


def worker_command(name: str, tag: str, args: argparse.Namespace, delay_ms: float) -> list[str]:
    """The command line of configuration ``name``'s fit: every option the workers read, as the parent has it."""
    return module_command(
        "benchmarks.imbalance", "--run", name, "--tag", tag,
        "--workdir", str(args.workdir), "--steps", str(args.steps), "--batch-size", str(args.batch_size),
        "--delay-ms", repr(delay_ms), "--seed", str(args.seed), "--width", str(args.width),
        "--depth", str(args.depth), "--lr", repr(args.lr), "--momentum", repr(args.momentum),
        "--schedule", args.schedule, "--optimizer", args.optimizer,
        "--localsgd-warmup", str(args.localsgd_warmup), "--averaging-period", str(args.averaging_period),
        "--digest-steps", str(args.digest_steps), "--threads", str(args.threads),
        "--device-ms-per-sample", repr(args.device_ms_per_sample), "--straggle-at", args.straggle_at,
        *(["--step-pieces"] if args.step_pieces else []),
    )


def run_fit(config: Config, tag: str, args: argparse.Namespace, delay_ms: float) -> list[dict] | None:
    """Runs one configuration as a 4-process fit in its own process group; returns the 4 rank records."""
    cmd = worker_command(config.name, tag, args, delay_ms)
    env = launch_environment(**thread_environment(args.threads), PYTHONUNBUFFERED="1")
    log_path = args.workdir / f"{tag}.log"
    paths = [args.workdir / f"{tag}.rank{r}.json" for r in range(WORLD)]
    for stale in paths:  # a reused --workdir must not hand back an earlier run's records
        stale.unlink(missing_ok=True)
    t0 = time.monotonic()
    with open(log_path, "w") as log_file:
        rc = run_in_group(cmd, records=paths, timeout=args.timeout, env=env, stdout=log_file)
    if rc is None:
        log.error("%s: no result after %.0f s: killed its process group", tag, args.timeout)
    elapsed = time.monotonic() - t0
    if rc != 0 or not all(p.exists() for p in paths):
        tail = log_path.read_text(errors="replace").splitlines()[-40:]
        log.error("%s failed (exit %s after %.0f s); last lines of %s:\n%s", tag, rc, elapsed, log_path, "\n".join(tail))
        return None
    log.info("%s: done in %.0f s (fit, start-up and evaluation)", tag, elapsed)
    return [json.loads(p.read_text()) for p in paths]


def run_parent(args: argparse.Namespace) -> dict[str, Any]:
    """Parent mode: calibration, every configuration (in subprocesses), summary, table, JSON, plot."""
    selected = (
        [n for n, c in CONFIGS.items() if c.default] if args.only is None
        else [n.strip() for n in args.only.split(",") if n.strip()]
    )
    unknown = [n for n in selected if n not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown configuration(s) {unknown}; choose from {list(CONFIGS)}")
    if any(CONFIGS[n].strategy == "abs_sgd" for n in selected):
        try:  # before any fit starts, not in the workers after the others ran
            abs_sgd_epochs(args.steps, args.batch_size)
        except ValueError as err:
            raise SystemExit(str(err)) from None
    if any(catches_up(CONFIGS[n]) for n in selected):
        if args.schedule != "constant":
            raise SystemExit("the catch_up configurations run until they have trained the others' samples, in a "
                             "number of rounds not known in advance: they need --schedule constant")
    model_parameters = sum(p.numel() for p in build_mlp(args.width, args.depth).parameters())
    env = environment(args, model_parameters)
    log.info("load average before the run: %s (the figures assume an otherwise idle machine)", env["load_average_at_start"])

    calibration: dict[str, Any]
    if args.delay_ms is None:
        calibration = calibrate(args.batch_size, args.width, args.depth, threads=args.threads)
        device_ms = args.device_ms_per_sample * args.batch_size
        delay_ms = 2.0 * (calibration["concurrent_ms"] + device_ms)
        calibration["method"] = (
            f"mean step time (forward + backward + SGD step, batch {args.batch_size}, {args.threads} "
            f"thread{'s' if args.threads > 1 else ''}) of {WORLD} "
            f"concurrent processes on {env['cpus']} cores, as the {WORLD} ranks compete in the fits"
            + (f", plus {device_ms:g} ms of emulated device time per step" if device_ms else "") + "; D = 2 x that"
        )
    else:
        calibration, delay_ms = {"method": "--delay-ms given"}, args.delay_ms
    calibration["delay_ms"] = delay_ms
    log.info("calibration: %s", {k: round(v, 2) if isinstance(v, float) else v for k, v in calibration.items()})

    cleanup: tempfile.TemporaryDirectory | None = None
    if args.workdir is None:
        cleanup = tempfile.TemporaryDirectory(prefix="imbalance-")
        args.workdir = Path(cleanup.name)
    args.workdir.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {n: [] for n in selected}
    try:
        # Repeats outermost: a drift in the machine's load spreads over every configuration.
        for repeat in range(args.repeats):
            for name in selected:
                def fit(attempt: int, name: str = name, repeat: int = repeat) -> dict | None:
                    ranks = run_fit(CONFIGS[name], f"{name}.{repeat}.{attempt}", args, delay_ms)
                    return None if ranks is None else summarise_run(CONFIGS[name], ranks, args)

                kept = retry_while_stolen(fit, args, name)
                if kept is not None:
                    runs[name].append(kept)
                    # One line per fit: a run cut short (a device call's limit) still leaves its figures in the log.
                    log.info(
                        "%s repeat %d: %.0f samples/s, held-out accuracy %.4f, CPU %.1f us/sample",
                        name, repeat, kept["samples_per_s_total"], kept["test_acc_rank0"], kept["cpu_us_per_sample"],
                    )
    finally:
        if cleanup is not None and not args.keep_workdir:
            cleanup.cleanup()
        elif args.keep_workdir:
            log.info("worker logs and rank records kept in %s", args.workdir)

    results: dict[str, dict] = {}
    for name, config_runs in runs.items():
        entry: dict[str, Any] = {
            "label": CONFIGS[name].label, "strategy": CONFIGS[name].strategy,
            "imbalanced": CONFIGS[name].imbalanced, "runs": config_runs,
        }
        if config_runs:
            for stat, fn in (("median", statistics.median), ("min", min), ("max", max)):
                entry[stat] = {k: fn(r[k] for r in config_runs) for k in FIGURES}
        results[name] = entry
    add_ratios({n: e for n, e in results.items() if e["runs"]})
    for entry in results.values():
        for run in entry["runs"]:
            if not run["replica_check"]["ok"]:
                log.warning("replica check failed: %s", run["replica_check"])

    summary = {
        "environment": env,
        "settings": {
            "steps": args.steps, "batch_size": args.batch_size, "repeats": args.repeats, "seed": args.seed,
            "threads": args.threads,
            "max_steal": args.max_steal, "steal_retries": args.steal_retries,
            "lr": args.lr, "momentum": args.momentum, "schedule": args.schedule, "optimizer": args.optimizer,
            "width": args.width, "depth": args.depth,
            "train_samples": TRAIN_SAMPLES, "test_samples": TEST_SAMPLES,
            "post_local_sgd": {
                "start_localSGD_iter": args.localsgd_warmup, "model_averaging_period": args.averaging_period,
                "subgroup": "each rank alone (dist.new_subgroups(group_size=1))", "final_average": True,
            },
            "imbalance": {"stragglers_per_step": 1, "delay_ms": delay_ms, "seed": args.seed},
            "device_ms_per_sample": args.device_ms_per_sample,
            "straggle_at": args.straggle_at,
            "step_pieces": args.step_pieces,
        },
        "calibration": calibration,
        "notes": [
            (
                "wall time per rank: first on_train_batch_start to the end of the strategy's on_train_end "
                "(after eager-SGD's final flush / post-local SGD's final average); Lightning start-up excluded"
            ),
            (
                "post_local_sgd and no_comm run with Lightning's per-batch SIGTERM broadcast replaced by a local "
                "check (lightning_partial._compat.replace_sigterm_broadcast), as eager_sgd does; ddp keeps it"
            ),
            "ratios are taken between medians; throughput_vs_ddp compares with DDP under the same balance condition",
            "4 ranks share the machine's cores: a sleeping straggler frees CPU for the others",
        ],
        "goals": goal_figures(results),
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    png = args.out.with_suffix(".png")
    written = [str(args.out)]
    if any(e["runs"] for e in results.values()):
        if importlib.util.find_spec("matplotlib") is None:
            log.warning("matplotlib is not installed: no plot (%s)", png)
        else:
            plot(results, png, delay_ms, args.threads)
            written.append(str(png))
    log.info(
        "D = %.1f ms (%s); %d steps x batch %d per rank; model %s (%d parameters)",
        delay_ms, calibration["method"], args.steps, args.batch_size, env["model"], model_parameters,
    )
    log.info("wrote %s", " and ".join(written))
    print_table(results, args.repeats)
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.imbalance", description=PACKAGE_DOC.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=250, help="training steps per rank in every configuration")
    parser.add_argument("--batch-size", type=int, default=384, help="per-rank batch size")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each configuration; medians are reported")
    parser.add_argument("--only", default=None, help=f"comma-separated subset of {','.join(CONFIGS)}")
    parser.add_argument("--out", type=Path, default=RESULTS / "imbalance.json", help="JSON; the PNG goes beside it")
    parser.add_argument("--delay-ms", type=float, default=None, help="straggler delay D (default: 2 x calibrated step)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per fit before its process group is killed")
    parser.add_argument("--threads", type=positive_int, default=1,
                        help="intra-op threads of every rank and calibration process (default 1)")
    add_device_argument(parser)
    parser.add_argument("--seed", type=int, default=0)
    add_steal_arguments(parser)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum, or AdamW's beta1")
    parser.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd",
                        help="SGD with --momentum (default) or AdamW (betas (--momentum, 0.999), weight decay 0.01)")
    parser.add_argument(
        "--schedule", choices=("cosine", "constant"), default="cosine",
        help="learning rate over the fit: cosine decay to 0 per step (default) or constant",
    )
    parser.add_argument(
        "--straggle-at", choices=("batch_start", "backward"), default="batch_start",
        help="when the drawn straggler sleeps (LoadImbalance's straggle_at): before the forward pass (default, the "
             "paper's) or before the backward, as part of the batch's compute (a batch that eager_sgd's catch_up "
             "skips then does not straggle); every configuration alike",
    )
    parser.add_argument("--localsgd-warmup", type=int, default=8, help="post-local SGD: steps of plain DDP first")
    parser.add_argument("--averaging-period", type=int, default=4, help="post-local SGD: steps between averages")
    parser.add_argument("--digest-steps", type=int, default=24, help="steps whose replicas are compared")
    parser.add_argument("--workdir", type=Path, default=None, help="worker logs and rank records (default: a temp dir)")
    parser.add_argument("--keep-workdir", action="store_true", help="keep the temporary worker directory")
    parser.add_argument("--step-pieces", action="store_true",
                        help="measure the training thread's CPU in each piece of the strategy's step (a little overhead)")
    # Worker mode (internal): one 4-process fit; Lightning re-runs this command line for ranks 1-3.
    parser.add_argument("--run", choices=list(CONFIGS), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--tag", default="run", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.run is not None:
        if args.workdir is None or args.delay_ms is None:
            raise SystemExit("--run needs --workdir and --delay-ms")
        from benchmarks.imbalance.worker import run_worker

        return run_worker(args)
    run_parent(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
