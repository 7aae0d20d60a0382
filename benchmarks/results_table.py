"""Writes README.md's result tables from the JSON files in benchmarks/results/.

    python -m benchmarks.results_table            # rewrites the blocks in README.md
    python -m benchmarks.results_table --check    # exit 1 if README.md differs from the JSON

Three blocks of README.md are generated, each between a pair of markers:

* ``<!-- main_job:begin -->`` ... ``<!-- main_job:end -->``: the main job
  (``recipes/main_job.py``), from ``main_job.json``: each strategy's samples/s,
  its ratio to DDP's, and rank 0's held-out accuracy against DDP's.
* ``<!-- main_job_adamw:begin -->`` ... ``<!-- main_job_adamw:end -->``: the
  main job with AdamW (``--recipe translation_transformer --config
  conf/main_job_transformer.yaml``), from ``main_job_transformer*.json``, the same columns.
* ``<!-- results:begin -->`` ... ``<!-- results:end -->``: the two benchmarks
  that compare the strategies with DDP and with the no-communication bound:
  ``IMBALANCE_FILE`` (``benchmarks/imbalance/``: eager_sgd, wagma_sgd,
  ds_sync, post-local SGD; one straggler per step) and ``HETEROGENEITY_FILE``
  (``benchmarks/heterogeneity.py``: abs_sgd; persistent per-rank speeds; the run
  at today's defaults for that case: ``AdaptiveBatchSize`` in the fit, so
  ``delay="auto"`` is 0, each synchronous round one step split by speed).

Everything between a pair of markers is replaced; everything else in the file
is left byte for byte. Only the standard library is used.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"

#: Rows of the main-job table: the strategies in the order main_job.py runs them.
MAIN_JOB_ROWS: tuple[str, ...] = (
    "ddp", "eager_sgd", "eager_sgd_majority", "eager_sgd_backup", "wagma_sgd", "ds_sync", "abs_sgd",
)

#: Rows taken from IMBALANCE_FILE: (configuration key, how the table names it). ``wagma_sgd``'s global period is
#: read from the run itself (``wagma_period``), so a file run at another default names it.
IMBALANCE_ROWS: tuple[tuple[str, str], ...] = (
    ("ddp_imbalanced", "`ddp`"),
    ("post_local_sgd_imbalanced", "post-local SGD (period 4)"),
    ("eager_sgd_imbalanced", "`eager_sgd` (solo, `max_staleness=1`)"),
    ("eager_sgd_majority_imbalanced", "`eager_sgd_majority`"),
    ("wagma_sgd_imbalanced", "`wagma_sgd` (S=2, tau={tau})"),
    ("ds_sync_imbalanced", "`ds_sync` (G=2, `max_staleness=1`)"),
    ("no_comm_imbalanced", "no communication (the bound)"),
)

Json = dict[str, Any]

#: ABSSGDStrategy's defaults for the options a heterogeneity run records, and what a run from before an option
#: existed ran (no synchronous finish; steps ended at the first round to reach the global batch). Written out here
#: (this module uses only the standard library); tests/test_benchmark_helpers.py checks them against the strategy.
ABS_SGD_DEFAULTS: dict[str, Any] = {"final_sync": 0.05, "step_boundary": "nearest"}
ABS_SGD_BEFORE: dict[str, Any] = {"final_sync": 0.0, "step_boundary": "at_least"}
#: The imbalance run in README.md's table: the table's rows only, at the current defaults.
IMBALANCE_FILE = "imbalance_defaults.json"
#: The heterogeneity run in README.md's table.
HETEROGENEITY_FILE = "heterogeneity_first_window_defaults_5repeats.json"


def load(name: str) -> Json:
    """One results file, by its name in benchmarks/results/."""
    with open(RESULTS / name, encoding="utf-8") as f:
        data: Json = json.load(f)
    return data


def signed(points: float) -> str:
    """A difference in percentage points, with its sign (``+0.00`` for none)."""
    return f"{points:+.2f}"


def ratio(value: Optional[float]) -> str:
    """A ratio with two decimals; empty where the benchmark has none."""
    return "" if value is None else f"{value:.2f}"


#: The main job's seeds: ``main_job.json`` (seed 0) and one file per further seed.
MAIN_JOB_FILES: tuple[str, ...] = (
    "main_job.json", "main_job_seed1.json", "main_job_seed2.json", "main_job_seed3.json", "main_job_seed4.json",
)
#: The main job with AdamW (the translation Transformer), its seeds likewise.
MAIN_JOB_ADAMW_FILES: tuple[str, ...] = (
    "main_job_transformer.json", *(f"main_job_transformer_seed{seed}.json" for seed in range(1, 10)),
)


def main_job_table(jobs: Sequence[Json], files: str = "main_job*.json") -> list[str]:
    """The main job over its seeds: samples/s x DDP and accuracy vs DDP's, mean and range, per strategy.

    Every seed's strategies are compared with that seed's DDP fit: the same initial weights, data set and
    straggler draws (the config's ``imbalance.seed``, the same for every seed). The data order follows the seed
    under every strategy but ``abs_sgd``, whose sampler took a fixed seed of 0 in the committed runs (it follows
    ``seed_everything`` since).
    """
    lines = [
        "| strategy | x DDP (samples/s), mean [range] | accuracy vs DDP (points), mean | per seed | replicas identical |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name in MAIN_JOB_ROWS:
        runs = [job["results"] for job in jobs if name in job["results"]]
        if not runs:
            continue
        speed = [r[name]["summary"]["samples_per_s"] / r["ddp"]["summary"]["samples_per_s"] for r in runs]
        points = [100.0 * (r[name]["summary"]["val_acc"] - r["ddp"]["summary"]["val_acc"]) for r in runs]
        identical = all(r[name]["summary"]["replicas_identical"] for r in runs)
        lines.append(
            f"| `{name}` | {sum(speed) / len(speed):.2f} [{min(speed):.2f}-{max(speed):.2f}]"
            f" | {signed(sum(points) / len(points))}"
            f" | {', '.join(signed(p) for p in points)} | {'yes' if identical else 'NO'} |"
        )
    ddp = [100.0 * job["results"]["ddp"]["summary"]["val_acc"] for job in jobs]
    # DDP's own samples/s: the ratios depend on how the step's compute compares with the straggler's delay.
    ddp_speed = [job["results"]["ddp"]["summary"]["samples_per_s"] for job in jobs]
    lines.append("")
    lines.append(
        f"`benchmarks/results/{files}`: {len(jobs)} seeds, {jobs[0]['devices']} CPU processes per fit, recipe"
        f" `{jobs[0]['recipe']}`; DDP's accuracy {', '.join(f'{a:.2f}' for a in ddp)} %,"
        f" {min(ddp_speed):,.0f}-{max(ddp_speed):,.0f} samples/s."
    )
    return lines


def results_table(imbalance: Json, heterogeneity: Json) -> list[str]:
    """Throughput against DDP and the bound, and accuracy against DDP's, in both benchmarks."""
    lines = [
        "| benchmark | configuration | samples/s x DDP | x bound | accuracy vs DDP (points) |",
        "| --- | --- | --- | --- | --- |",
    ]
    configurations: dict[str, Json] = imbalance["results"]
    for key, label in IMBALANCE_ROWS:
        if key not in configurations:
            continue
        ratios = configurations[key]["ratios"]
        if "{tau}" in label:
            label = label.format(tau=wagma_period(configurations[key]))
        lines.append(
            f"| imbalance | {label} | {ratios['throughput_vs_ddp']:.2f} | {ratio(ratios['throughput_vs_bound'])}"
            f" | {signed(ratios['test_acc_minus_ddp_points']) if key != 'ddp_imbalanced' else 'reference'} |"
        )
    fits: dict[str, Json] = heterogeneity["results"]
    summary: Json = heterogeneity["summary"]
    ddp_acc = 100.0 * fits["ddp"]["median"]["test_acc"]
    abs_acc = 100.0 * fits["abs_sgd"]["median"]["test_acc"]
    bound_acc = 100.0 * fits["no_comm"]["median"]["test_acc"]
    lines += [
        f"| heterogeneity | `ddp` | 1.00 | {summary['ddp_vs_bound']:.2f} | reference |",
        f"| heterogeneity | {abs_sgd_label(heterogeneity)}"
        f" | {summary['abs_vs_ddp_samples_per_s']:.2f} | {summary['abs_vs_bound']:.2f} | {signed(abs_acc - ddp_acc)} |",
        f"| heterogeneity | no communication (the bound) | {1.0 / summary['ddp_vs_bound']:.2f} | 1.00"
        f" | {signed(bound_acc - ddp_acc)} |",
    ]
    settings = imbalance["settings"]
    environment = imbalance["environment"]
    lines += [
        "",
        f"*imbalance* (`benchmarks/results/{IMBALANCE_FILE}`): {environment['ranks']} CPU ranks on"
        f" {environment['cpus']} cores, {environment['model']}, {settings['steps']} steps of"
        f" {settings['batch_size']} per rank, one straggler per step sleeping"
        f" {settings['imbalance']['delay_ms']:.1f} ms, {optimizer_label(settings)}"
        f" ({settings.get('schedule', 'cosine')} schedule), {settings['repeats']} repeat"
        f"{'s, medians' if settings['repeats'] > 1 else ''}.",
        f"*heterogeneity* (`benchmarks/results/{HETEROGENEITY_FILE}`): rank speeds"
        f" {', '.join(f'{s:g}' for s in heterogeneity['speed'])}, the `--model {heterogeneity['model']}` task,"
        f" {optimizer_label(heterogeneity)}, each ratio the median of {heterogeneity['repeats']} repeats' own"
        " (the columns need not multiply); "
        + reached_ddp_loss(summary)
        + (f"; its accuracy is after {heterogeneity['abs_epochs']} epochs, DDP's after one." if
           heterogeneity.get("abs_epochs", 1) != 1 else "; accuracy after the same samples."),
    ]
    return lines


def reached_ddp_loss(summary: Json) -> str:
    """When abs_sgd reached DDP's final training loss: the median repeat's time when every repeat reached it,
    else how many did (a median alone would call a fit that reached it in two repeats of five one that never
    did, or the other way round)."""
    reach = summary["abs_time_to_ddp_final_loss_ratio"]
    repeats = [r.get("abs_time_to_ddp_final_loss_ratio") for r in summary.get("per_repeat", [])]
    reached = [r for r in repeats if r is not None]
    if len(reached) == len(repeats):  # every repeat, or a file from before the per-repeat figures
        return (f"abs_sgd reached DDP's final training loss in {reach:.2f}x DDP's time" if reach is not None
                else "abs_sgd ended above DDP's final training loss")
    if not reached:
        return f"abs_sgd ended above DDP's final training loss in all {len(repeats)} repeats"
    return (f"abs_sgd reached DDP's final training loss in {len(reached)} of {len(repeats)} repeats"
            f" ({min(reached):.2f}-{max(reached):.2f}x DDP's time)")


def wagma_period(entry: Json) -> str:
    """The global period a ``wagma_sgd`` imbalance run used, else ``?``.

    Read from the first run's replica check: its ``global_every`` (the period the workers recorded; ``None``:
    never), in files written before that field from its rule's text (``tau=N``); failing that from the
    configuration's label.
    """
    runs = entry.get("runs") or [{}]
    check = runs[0].get("replica_check") or {}
    if "global_every" in check:
        return "none" if check["global_every"] is None else str(check["global_every"])
    for text in (check.get("rule", ""), entry.get("label", "")):
        found = re.search(r"tau=(\d+)", text)
        if found:
            return found.group(1)
    return "?"


def abs_sgd_label(heterogeneity: Json) -> str:
    """The heterogeneity run's abs_sgd configuration: its options that differ from the strategy's defaults."""
    changed = [f"target_samples={heterogeneity['target_samples']}"] if heterogeneity.get("target_samples") else []
    for key in ("reference_samples", "step_samples"):
        value = heterogeneity.get(key, "global_batch")  # absent: a run from before the benchmark had the option
        if value != "global_batch":
            changed.append(f"{key}={value}")
    if not heterogeneity.get("weight_prediction", True):
        changed.append("weight_prediction=False")
    if heterogeneity.get("staleness_rule", "auto") != "auto":
        changed.append(f"staleness_rule={heterogeneity['staleness_rule']!r}")
    for key, default in ABS_SGD_DEFAULTS.items():
        value = heterogeneity.get(key, ABS_SGD_BEFORE[key])  # absent: a run from before the option
        if value != default:
            changed.append(f"{key}={value!r}")
    adaptive = bool(heterogeneity.get("adaptive", False))
    # delay="auto" resolves to 0 with AdaptiveBatchSize or an Adam-like optimizer, else 1; a run from before
    # the option (absent) had the delay.
    auto = 0 if adaptive or heterogeneity.get("optimizer", "sgd") == "adamw" else 1
    delay = heterogeneity.get("delay", 1)
    if delay not in ("auto", auto):
        changed.append(f"delay={delay}")
    # AdaptiveBatchSize's arrival: "samples" by default; every run from before the option (absent) arrived by count.
    arrival = heterogeneity.get("arrival", "count")
    if adaptive and arrival != "samples":
        changed.append(f"arrival={arrival!r}")
    # overlap_arrival=True by default; it acts on arrivals by samples or by time only, and a run from before the
    # option (absent) waited at every arrival.
    if adaptive and arrival in ("samples", "time") and not heterogeneity.get("overlap_arrival", False):
        changed.append("overlap_arrival=False")
    # AdaptiveBatchSize's windows: window=8 and the first sizes after first_window=min(2, window) rounds by default;
    # a run from before the benchmark's --window (absent) had 8, and one from before --first-window (absent) made
    # its first sizes after a whole window.
    window = heterogeneity.get("window", 8)
    if adaptive and window != 8:
        changed.append(f"window={window}")
    first = (heterogeneity.get("first_window") or min(2, window)) if "first_window" in heterogeneity else window
    if adaptive and first != min(2, window):
        changed.append(f"first_window={first}")
    name = "`abs_sgd` + `AdaptiveBatchSize`" if adaptive else "`abs_sgd`"
    return name + " " + (f"(`{', '.join(changed)}`)" if changed else "(defaults)")


def optimizer_label(run: Json) -> str:
    """A run's optimizer, as its configurations shared it (a heterogeneity file, or an imbalance run's settings)."""
    if run.get("optimizer", "sgd") == "adamw":
        return f"AdamW lr {run['lr']:g}"
    momentum = run.get("momentum", 0.0)
    return f"SGD lr {run['lr']:g}" + (f" momentum {momentum:g}" if momentum else "")


def replace_block(text: str, name: str, lines: Sequence[str]) -> str:
    """``text`` with the lines between ``<!-- name:begin -->`` and ``<!-- name:end -->`` replaced."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    start = text.find(begin)
    stop = text.find(end)
    if start < 0 or stop < 0 or stop < start:
        raise SystemExit(f"results_table.py: README.md has no '{begin}' ... '{end}' block")
    head = text[: start + len(begin)]
    return head + "\n" + "\n".join(lines) + "\n" + text[stop:]


def render(readme: str) -> str:
    """The README with every generated block rewritten from the JSON files."""
    readme = replace_block(readme, "main_job", main_job_table([load(name) for name in MAIN_JOB_FILES]))
    readme = replace_block(readme, "main_job_adamw", main_job_table(
        [load(name) for name in MAIN_JOB_ADAMW_FILES], files="main_job_transformer*.json"))
    return replace_block(readme, "results", results_table(load(IMBALANCE_FILE), load(HETEROGENEITY_FILE)))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="Writes README.md's result tables from benchmarks/results/*.json.")
    parser.add_argument("--readme", type=Path, default=README, help="the file to rewrite (default: README.md)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if the file is out of date")
    args = parser.parse_args(argv)
    current = args.readme.read_text(encoding="utf-8")
    updated = render(current)
    if args.check:
        if updated != current:
            print(f"{args.readme}: the result tables differ from benchmarks/results/*.json;"
                  " run python -m benchmarks.results_table", file=sys.stderr)
            return 1
        return 0
    if updated != current:
        args.readme.write_text(updated, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
