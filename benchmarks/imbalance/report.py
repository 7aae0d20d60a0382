"""The imbalance benchmark's report: figures of each fit, ratios, the goals, the table and the plot."""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import package_version
from benchmarks.imbalance.configs import CONFIGS, WORLD, Config
from benchmarks.imbalance.task import CLASSES, IN_DIM

LAST_LOSSES = 20  # training loss reported as the mean of rank 0's last batches


def _replica_check(config: Config, ranks: list[dict], args: argparse.Namespace) -> dict[str, Any]:
    """After which of the first optimizer steps all replicas were bit-identical, against what the strategy implies."""
    n = min(len(r["digests"]) for r in ranks)
    identical = [len({r["digests"][i] for r in ranks}) == 1 for i in range(n)]
    extra: dict[str, Any] = {}
    if config.strategy == "post_local_sgd":
        w, k = args.localsgd_warmup, args.averaging_period
        expected = [i < w or (i - w) % k == 0 for i in range(n)]
        rule = f"identical after steps 0..{w - 1} (warm-up: global gradient allreduce) and {w}, {w + k}, ... (averaging)"
    elif config.strategy == "no_comm":
        expected = [False] * n
        rule = "never identical (no communication)"
    elif config.strategy == "wagma_sgd":
        # As the fit ran (its record); records from before the worker kept it ran WAGMA's earlier default, 10.
        tau = ranks[0].get("global_every", 10)
        extra["global_every"] = tau  # a field, for the README's row (results_table.wagma_period)
        every = ranks[0].get("average_every", 1)  # optimizer steps per round
        # As the fit ran (its record); records from before the worker kept them: the configuration's.
        options = dict(config.options)
        mode = ranks[0].get("mode", options.get("mode", "solo"))
        group_size = ranks[0].get("group_size", options.get("group_size"))
        order = ranks[0].get("order") or options.get("order")  # None: the library's default
        if order == "average_then_step":
            # Each round step's local update follows its average, so no step leaves the replicas identical.
            expected = [False] * n
            rule = "identical only after the final average (average_then_step: every step ends on a local update)"
        # Below, step_then_average (the default): a round's average is the step's last word.
        elif tau is None and mode == "sync" and group_size == WORLD:
            # One group of every rank, every round waiting for every rank: each round's average is exact.
            expected = [(i + 1) % every == 0 for i in range(n)]
            rule = f"identical after every {every}th step (a synchronous round of one group of every rank)"
        elif tau is None and group_size == WORLD:
            # A round that finds every rank fresh also leaves them identical, one that does not leaves them
            # apart: identical at most after a round's step.
            expected = [s and (i + 1) % every == 0 for i, s in enumerate(identical)]
            rule = (f"identical only after a round's step (every {every}th) and after the final average "
                    "(global_every=None; a round of one group of every rank that finds every rank fresh "
                    "leaves them identical)")
        elif tau is None:
            expected = [False] * n
            rule = "identical only after the final average (global_every=None, groups smaller than the world)"
        else:
            expected = [(i + 1) % (tau * every) == 0 for i in range(n)]
            rule = (f"identical after every {tau * every}th step (global average, tau={tau} rounds of {every} "
                    "steps); within groups otherwise")
    elif config.strategy == "ds_sync":
        expected = [False] * n
        rule = "identical only after the final average (no periodic global average)"
    elif config.strategy == "abs_sgd":
        # A batch is a micro-batch: after the same batch the ranks stand at different optimizer steps, so
        # nothing is expected per batch; the final digests are checked below.
        expected = identical
        rule = "batches are micro-batches (not compared per batch); identical at the end of fit"
    else:
        expected = [True] * n
        rule = "identical after every step"
    final_identical = len({r.get("final_digest") for r in ranks}) == 1  # after the fit (the bound: never)
    return {
        **extra,
        "steps_checked": n,
        "identical": "".join("=" if s else "." for s in identical),  # step 0 first; '=' identical
        "expected": "".join("=" if s else "." for s in expected),
        "rule": rule,
        "final_identical": final_identical,
        "ok": identical == expected and (config.strategy != "abs_sgd" or final_identical),
    }


def _per_step(cumulative: list[int], total: int) -> dict[str, Any]:
    """Per-step counts from cumulative ones, plus what came after the last batch."""
    steps = [b - a for a, b in zip([0, *cumulative], cumulative)]
    return {"per_step": steps, "after_last_step": total - (cumulative[-1] if cumulative else 0)}


def _round_summary(rounds: list[list[float]]) -> dict[str, Any] | None:
    """Eager-SGD's rounds seen by one rank: fresh gradients, contributions, staleness, time blocked in arrive."""
    if not rounds:
        return None
    fresh, contributions, staleness, wait = zip(*rounds)
    return {
        "rounds": len(rounds),
        "fresh_mean": statistics.fmean(fresh),
        "contributions_mean": statistics.fmean(contributions),
        "contributions_max": max(contributions),
        "staleness_max": max(staleness),
        "staleness_max_mean": statistics.fmean(staleness),
        "wait_ms_mean": statistics.fmean(wait) * 1e3,
        "wait_ms_total": sum(wait) * 1e3,
    }


def summarise_run(config: Config, ranks: list[dict], args: argparse.Namespace) -> dict[str, Any]:
    """Figures of one fit from its 4 rank records."""
    ranks = sorted(ranks, key=lambda r: r["rank"])
    r0 = ranks[0]
    steps_per_s = [r["steps"] / r["wall_s"] for r in ranks]
    return {
        "steps_per_rank": [r["steps"] for r in ranks],
        "optimizer_steps_rank0": r0.get("optimizer_steps"),
        "last_round_rank0": r0.get("last_round"),
        "samples_per_rank": [r["samples"] for r in ranks],
        "wall_s_per_rank": [r["wall_s"] for r in ranks],
        "startup_s_per_rank": [r["startup_s"] for r in ranks],
        "steps_per_s_per_rank": steps_per_s,
        "steps_per_s_mean": statistics.fmean(steps_per_s),
        "steps_per_s_rank0": steps_per_s[0],
        "step_ms_mean": statistics.fmean(r["wall_s"] / r["steps"] for r in ranks) * 1e3,
        "samples_per_s_total": sum(r["samples"] / r["wall_s"] for r in ranks),
        # CPU cost of a sample, all threads of all ranks: on a machine with fewer cores than
        # ranks, throughput is bounded by cores / this.
        "cpu_us_per_sample": sum(r["cpu_s"] for r in ranks) / sum(r["samples"] for r in ranks) * 1e6,
        **cpu_parts(ranks),
        "step_pieces_ms_per_step": step_pieces(ranks),
        # Share of the machine's CPU time the hypervisor stole during rank 0's training interval.
        "steal_fraction": r0["steal_fraction"] if r0["steal_fraction"] is not None else float("nan"),
        "train_loss_last_rank0": statistics.fmean(r0["losses"][-LAST_LOSSES:]),
        "train_loss_last_mean": statistics.fmean(statistics.fmean(r["losses"][-LAST_LOSSES:]) for r in ranks),
        "train_eval_loss_rank0": r0["train_eval_loss"],
        "test_loss_rank0": r0["test_loss"],
        "test_acc_rank0": r0["test_acc"],
        "test_acc_per_rank": [r["test_acc"] for r in ranks],
        "delayed_steps_per_rank": [r["delayed_steps"] for r in ranks],
        "injected_s_per_rank": [r["injected_s"] for r in ranks],
        "replica_check": _replica_check(config, ranks, args),
        "default_group_collectives_rank0": r0["default_group_collectives"],
        # Per step: how many default-group collective calls rank 0 made in it (after the final step:
        # those of on_train_end, e.g. post-local SGD's final average).
        "collectives_per_step_rank0": _per_step(r0["collectives_at_batch_end"], r0["collectives_total"]),
        "eager_rounds_per_rank": [_round_summary(r["rounds"]) for r in ranks],
        "strategy_class": r0["strategy_class"],
        "torch_threads_per_rank": [r["torch_threads"] for r in ranks],
        # Rank 0's loss against its own elapsed training time, for the plot.
        "curve_rank0": {"t_s": r0.get("loss_ends_s", r0["step_ends_s"]), "loss": r0["losses"]},
    }


# CPU per trained sample by part, summed over the ranks (microseconds): ``compute`` is the main
# thread's forward and backward, ``step`` the rest of the main thread (the training loop, the
# optimizer update, the strategy's step, callbacks, data), ``communication`` the engine's threads
# (as they were before the strategy's on_train_end ended them), ``other`` the rest of the process's
# CPU: the threads Python does not know (gloo's, the TCPStore server's; DDP's allreduce).
CPU_PARTS = ("cpu_us_compute", "cpu_us_step", "cpu_us_communication", "cpu_us_other")


def cpu_parts(ranks: list[dict[str, Any]]) -> dict[str, float]:
    """:data:`CPU_PARTS` of one fit (NaN for records written before the worker measured them)."""
    samples = sum(r["samples"] for r in ranks)
    if any("thread_cpu_s" not in r for r in ranks):
        return dict.fromkeys(CPU_PARTS, float("nan"))
    compute = sum(r["compute_cpu_s"] for r in ranks)
    main = sum(r["thread_cpu_s"]["main"] for r in ranks)
    communication = sum(r["thread_cpu_s"]["communication"] for r in ranks)
    other = sum(r["cpu_s"] for r in ranks) - main - communication
    return {
        "cpu_us_compute": compute / samples * 1e6,
        "cpu_us_step": (main - compute) / samples * 1e6,
        "cpu_us_communication": communication / samples * 1e6,
        "cpu_us_other": other / samples * 1e6,
    }


def step_pieces(ranks: list[dict[str, Any]]) -> dict[str, float] | None:
    """``--step-pieces``: the training thread's CPU milliseconds per step in each piece of the strategy's step,
    the median over the ranks (``None`` when not measured)."""
    if any(not r.get("step_pieces") for r in ranks):
        return None
    names = sorted({name for r in ranks for name in r["step_pieces"]})
    return {name: statistics.median(r["step_pieces"].get(name, {"cpu_s": 0.0})["cpu_s"] / r["steps"] * 1e3
                                    for r in ranks) for name in names}


# Figures summarised over repeats (median, min, max).
FIGURES = (
    "steps_per_s_mean", "steps_per_s_rank0", "step_ms_mean", "samples_per_s_total", "train_loss_last_rank0",
    "train_loss_last_mean", "train_eval_loss_rank0", "test_loss_rank0", "test_acc_rank0", "cpu_us_per_sample",
    "steal_fraction", *CPU_PARTS,
)


def _reference(results: dict[str, dict], config: Config, strategy: str) -> dict | None:
    """The median figures of ``strategy`` under the same balance condition as ``config``, if it ran."""
    for other in CONFIGS.values():
        if other.strategy == strategy and other.imbalanced == config.imbalanced and other.name in results:
            return results[other.name]["median"]
    return None


def add_ratios(results: dict[str, dict]) -> None:
    """Ratios to DDP (same balance condition) and to the no-communication bound, on the medians."""
    for name, entry in results.items():
        config, med = CONFIGS[name], entry["median"]
        ratios: dict[str, float | None] = {}
        ddp = _reference(results, config, "ddp")
        bound = results.get("no_comm_imbalanced", {}).get("median") if config.imbalanced else None
        ddp_any = ddp or next((results[n]["median"] for n in ("ddp_balanced", "ddp_imbalanced") if n in results), None)
        ratios["throughput_vs_ddp"] = med["samples_per_s_total"] / ddp["samples_per_s_total"] if ddp else None
        ratios["step_time_vs_ddp"] = med["step_ms_mean"] / ddp["step_ms_mean"] if ddp else None
        ratios["throughput_vs_bound"] = med["samples_per_s_total"] / bound["samples_per_s_total"] if bound else None
        # DDP's model does not depend on the injected delays: either DDP run is the accuracy reference.
        ratios["test_acc_minus_ddp_points"] = (med["test_acc_rank0"] - ddp_any["test_acc_rank0"]) * 100 if ddp_any else None
        entry["ratios"] = ratios


def goal_figures(results: dict[str, dict]) -> list[dict[str, Any]]:
    """The figures behind the project's goals, with the goal beside each (reported, never asserted)."""

    def median(name: str, key: str) -> float | None:
        entry = results.get(name)
        return entry["median"][key] if entry and entry.get("runs") else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b is not None else None

    rows = [
        (
            "balanced eager_sgd step time / DDP's",
            ratio(median("eager_sgd_balanced", "step_ms_mean"), median("ddp_balanced", "step_ms_mean")),
            "<= 1.05",
        ),
    ]
    bound = median("no_comm_imbalanced", "samples_per_s_total")
    for name, label in (
        ("eager_sgd_imbalanced", "eager_sgd (solo, max_staleness=1: the default)"),
        ("eager_sgd_unbounded_imbalanced", "eager_sgd (solo, max_staleness=None)"),
    ):
        throughput = median(name, "samples_per_s_total")
        rows += [
            (f"imbalanced {label} throughput / DDP's", ratio(throughput, median("ddp_imbalanced", "samples_per_s_total")), ">= 1.5"),
            (f"imbalanced {label} throughput / post-local SGD's",
             ratio(throughput, median("post_local_sgd_imbalanced", "samples_per_s_total")), "> 1"),
            (f"imbalanced {label} throughput / no-communication bound", ratio(throughput, bound), ">= 0.85"),
            # Not a goal: with fewer cores than ranks the fits are CPU-bound, so the ratio to the
            # bound is roughly at most the inverse of this.
            (f"imbalanced {label} CPU per sample / the bound's",
             ratio(median(name, "cpu_us_per_sample"), median("no_comm_imbalanced", "cpu_us_per_sample")), "(diagnostic)"),
        ]
    for name in ("wagma_sgd_imbalanced", "ds_sync_imbalanced"):
        rows.append((f"{name} throughput / DDP's", ratio(median(name, "samples_per_s_total"),
                     median("ddp_imbalanced", "samples_per_s_total")), ">= 1.5"))
    for name in ("eager_sgd_balanced", "eager_sgd_imbalanced", "eager_sgd_majority_imbalanced",
                 "eager_sgd_unbounded_imbalanced", "eager_sgd_s2_imbalanced", "wagma_sgd_imbalanced",
                 "ds_sync_imbalanced"):
        if name in results and results[name].get("ratios"):
            rows.append(
                (f"{name} test accuracy - DDP's (points)", results[name]["ratios"]["test_acc_minus_ddp_points"], "within +-1")
            )
    return [{"figure": f, "value": v, "goal": g} for f, v, g in rows]


def _fmt(value: float | None, fmt: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, fmt)


def print_table(results: dict[str, dict], repeats: int) -> None:
    """The final table (stdout)."""
    header = (
        f"{'configuration':<31}{'steps/s':>8}{'r0':>7}{'ms/step':>9}{'samples/s':>11}{'xDDP':>7}{'xbound':>8}"
        f"{'loss':>8}{'acc r0':>8}{'dAcc':>7}{'cpu us/s':>9}{'steal':>7}  replicas"
    )
    print(header)
    print("-" * len(header))
    for name in CONFIGS:
        if name not in results:
            continue
        entry = results[name]
        if not entry["runs"]:
            print(f"{name:<31}  failed")
            continue
        med, ratios = entry["median"], entry["ratios"]
        checks = "ok" if all(r["replica_check"]["ok"] for r in entry["runs"]) else "MISMATCH"
        print(
            f"{name:<31}{med['steps_per_s_mean']:>8.2f}{med['steps_per_s_rank0']:>7.2f}{med['step_ms_mean']:>9.1f}"
            f"{med['samples_per_s_total']:>11.0f}{_fmt(ratios['throughput_vs_ddp'], '.2f'):>7}"
            f"{_fmt(ratios['throughput_vs_bound'], '.2f'):>8}{med['train_loss_last_rank0']:>8.3f}"
            f"{med['test_acc_rank0'] * 100:>8.2f}{_fmt(ratios['test_acc_minus_ddp_points'], '+.2f'):>7}"
            f"{med['cpu_us_per_sample']:>9.1f}{med['steal_fraction'] * 100:>6.1f}%  {checks}"
        )
    if repeats > 1:
        print(f"(medians of {repeats} runs; min and max in the JSON)")
    print()
    print(f"{'CPU us per trained sample':<31}{'compute':>9}{'step':>7}{'comm':>7}{'other':>7}{'total':>8}")
    for name in CONFIGS:
        if name in results and results[name]["runs"]:
            med = results[name]["median"]
            print(f"{name:<31}" + "".join(f"{_fmt(med[k], '.1f'):>{w}}" for k, w in zip(CPU_PARTS, (9, 7, 7, 7)))
                  + f"{med['cpu_us_per_sample']:>8.1f}")
    _print_step_pieces(results)
    goals = goal_figures(results)
    if goals:
        print()
        width = max(len(g["figure"]) for g in goals)
        for g in goals:
            if g["value"] is not None:  # a configuration left out with --only
                print(f"{g['figure']:<{width}}  {_fmt(g['value'], '.3f'):>7}   goal {g['goal']}")


def _print_step_pieces(results: dict[str, dict]) -> None:
    """``--step-pieces``: per configuration, the training thread's CPU ms per step in each piece (first run)."""
    measured = {name: entry["runs"][0]["step_pieces_ms_per_step"] for name, entry in results.items()
                if entry["runs"] and entry["runs"][0].get("step_pieces_ms_per_step")}
    if not measured:
        return
    names = sorted({piece for pieces in measured.values() for piece in pieces})
    print()
    print(f"{'CPU ms per step, training thread':<31}" + "".join(f"{n:>{max(len(n), 6) + 2}}" for n in names))
    for config, pieces in measured.items():
        print(f"{config:<31}" + "".join(f"{pieces.get(n, 0.0):>{max(len(n), 6) + 2}.3f}" for n in names))
    print("(inclusive: submit holds flatten and store; medians over the ranks, the first run of each configuration)")


def plot(results: dict[str, dict], path: Path, delay_ms: float, threads: int = 1) -> None:
    """Throughput normalised to DDP (same balance), test accuracy, and rank 0's loss against time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in CONFIGS if n in results and results[n]["runs"]]
    labels = [("imb. " if CONFIGS[n].imbalanced else "bal. ") + CONFIGS[n].label for n in names]
    colors = ["tab:orange" if CONFIGS[n].imbalanced else "tab:blue" for n in names]
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.2))
    ax = axes[0]
    ratios = [results[n]["ratios"]["throughput_vs_ddp"] or float("nan") for n in names]
    ax.bar(range(len(names)), ratios, color=colors)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(names)), labels, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("total samples/s / DDP (same balance)")
    where = f"{WORLD} CPU ranks x {threads} thread{'s' if threads > 1 else ''}, {os.cpu_count()} cores"
    ax.set_title(f"Throughput, {where} (D = {delay_ms:.0f} ms)", fontsize=10)
    for i, r in enumerate(ratios):
        if not math.isnan(r):
            ax.text(i, r, f"{r:.2f}", ha="center", va="bottom", fontsize=8)
    ax = axes[1]
    accs = [results[n]["median"]["test_acc_rank0"] * 100 for n in names]
    ax.bar(range(len(names)), accs, color=colors)
    ax.set_xticks(range(len(names)), labels, rotation=35, ha="right", fontsize=8)
    low = min(accs)
    ax.set_ylim(max(0.0, low - 5), max(accs) + 2)
    ax.set_ylabel("held-out accuracy of rank 0's model (%)")
    ax.set_title("Accuracy after the fit")
    for i, a in enumerate(accs):
        ax.text(i, a, f"{a:.1f}", ha="center", va="bottom", fontsize=8)
    ax = axes[2]
    for n, label in zip(names, labels):
        curve = results[n]["runs"][0]["curve_rank0"]
        window = 10  # moving average: per-batch losses are noisy
        loss = curve["loss"]
        smooth = [statistics.fmean(loss[max(0, i - window + 1) : i + 1]) for i in range(len(loss))]
        ax.plot(curve["t_s"], smooth, label=label, lw=1.2, ls="-" if CONFIGS[n].imbalanced else "--")
    ax.set_xlabel("rank 0's training time (s)")
    ax.set_ylabel("rank 0's training loss (10-batch mean)")
    ax.set_title("Loss against wall time (first run)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def environment(args: argparse.Namespace, model_parameters: int) -> dict[str, Any]:
    return {
        "torch": torch.__version__,
        "lightning": package_version("lightning"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "ranks": WORLD,
        "threads_per_rank": args.threads,
        "backend": "gloo",
        "model": f"MLP {IN_DIM}-" + "-".join([str(args.width)] * args.depth) + f"-{CLASSES}",
        "model_parameters": model_parameters,
        "gradient_mbytes": model_parameters * 4 / 2**20,
        "load_average_at_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }
