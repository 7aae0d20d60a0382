"""``abs_sgd``'s heterogeneity fits alone, one per seed: the spread of its accuracy under a set of options.

The heterogeneity benchmark's ``abs_sgd`` fit (``benchmarks/heterogeneity.py``: the same task,
speeds, protocol and options, passed through) without the DDP and no-communication fits beside
it: about 25 s a fit on 2 cores, so that an option can be compared over many seeds, interleaved
with another where both are given. Samples/s here are not ratios to DDP (none ran beside them):
compare them between options of one invocation only.

    .venv/bin/python -m benchmarks.abs_sgd_fits --seeds 0-7 --out FILE                 # the defaults
    .venv/bin/python -m benchmarks.abs_sgd_fits --seeds 0-7 --out FILE -- -- --adaptive  # defaults, then adaptive

Each ``--``-separated group of options is one arm (an empty one: the defaults); for each seed the
arms run one after another. ``--config ddp`` runs the benchmark's DDP fit instead (about 40 s a fit):
whether a fit far below the others is the task's at that seed or the strategy's.
Writes every fit's held-out accuracy and loss, samples/s, optimizer steps, rounds and step lags
(``abs_step_lag_by_rank``, ``abs_step_lag_shares``: see ``benchmarks.heterogeneity.lag_figures``),
and per arm the accuracy's mean, median, spread and range.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
from pathlib import Path
from typing import Any

from benchmarks import heterogeneity


def seed_range(value: str) -> list[int]:
    """``"0-7"`` or ``"0,3,5"``: the seeds."""
    if "-" in value:
        first, last = (int(x) for x in value.split("-", 1))
        return list(range(first, last + 1))
    return [int(x) for x in value.split(",")]


def arm_options(rest: list[str]) -> list[list[str]]:
    """The arms: groups of heterogeneity options separated by ``--`` (an empty group: the defaults)."""
    groups: list[list[str]] = [[]]
    for item in rest:
        if item == "--":
            groups.append([])
        else:
            groups[-1].append(item)
    return groups[1:] if rest[:1] == ["--"] else groups


def accuracy_summary(accuracies: list[float]) -> dict[str, Any]:
    return {"fits": len(accuracies), "mean": statistics.mean(accuracies), "median": statistics.median(accuracies),
            "stdev": statistics.stdev(accuracies) if len(accuracies) > 1 else 0.0,
            "min": min(accuracies), "max": max(accuracies)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--seeds", type=seed_range, default=seed_range("0-7"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--config", choices=("abs_sgd", "ddp"), default="abs_sgd",
                        help="the heterogeneity benchmark's fit to run (default abs_sgd)")
    args, rest = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    arms = arm_options(rest)
    fits: dict[str, list[dict[str, Any]]] = {" ".join(arm): [] for arm in arms}
    for seed in args.seeds:
        for arm in arms:
            options = heterogeneity.build_parser().parse_args([*arm, "--seed", str(seed)])
            if options.lr is None:
                options.lr = heterogeneity.default_lr(options)
            options.workdir.mkdir(parents=True, exist_ok=True)
            fit = heterogeneity.run_fit(options, args.config)
            record = {"seed": seed, "test_acc": fit["test_acc"], "test_loss": fit["test_loss"],
                      "samples_per_s": fit["samples_per_s"], "steps": fit["global_step"], "rounds": fit["rounds"],
                      "samples_by_rank": fit["samples"], "final_loss": fit["final_loss"],
                      "round_samples": fit.get("round_samples"),
                      **heterogeneity.lag_figures([fit["step_lags"]])}
            fits[" ".join(arm)].append(record)
            logging.info("seed %d, [%s]: accuracy %.2f %%, %.0f samples/s, %d steps, %s rounds", seed,
                         " ".join(arm) or "defaults", 100 * fit["test_acc"], fit["samples_per_s"],
                         fit["global_step"], fit["rounds"])
    report = {"seeds": args.seeds, "config": args.config,
              "arms": {arm or "defaults": {"accuracy": accuracy_summary([f["test_acc"] for f in runs]), "fits": runs}
                       for arm, runs in fits.items()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    for arm, result in report["arms"].items():
        a = result["accuracy"]
        print(f"[{arm}] {a['fits']} fits: accuracy mean {100 * a['mean']:.2f} %, median {100 * a['median']:.2f}, "
              f"stdev {100 * a['stdev']:.2f}, range {100 * a['min']:.2f}-{100 * a['max']:.2f}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
