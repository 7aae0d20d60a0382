"""The imbalance benchmark's configurations (``--only`` names them; see the package's docstring)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

WORLD = 4  # ranks of every fit


@dataclass(frozen=True)
class Config:
    """One benchmark configuration: which strategy, with or without injected imbalance."""

    name: str
    # "ddp", "eager_sgd", "eager_sgd_majority", "eager_sgd_backup", "wagma_sgd", "ds_sync", "abs_sgd",
    # "post_local_sgd" or "no_comm"
    strategy: str
    imbalanced: bool
    label: str
    # Keyword arguments of a configured strategy object (``EagerSGDStrategy(**options)``);
    # empty: the registry name ``strategy`` as a user would write it.
    options: tuple[tuple[str, Any], ...] = ()
    # Run without --only; the staleness-rule study's configurations run only when named.
    default: bool = True


def _study(name: str, *options: tuple[str, Any], note: str = "") -> Config:
    """A configuration of the staleness-rule study: ``EagerSGDStrategy(**options)`` under imbalance, run only
    when ``--only`` names it, labelled by its options."""
    label = "eager-SGD solo, " + ", ".join(f"{key}={value}" for key, value in options) + note
    return Config(name, "eager_sgd", True, label, tuple(options), default=False)


def _one_group(name: str, label: str, *options: tuple[str, Any], average_every: int = 4) -> Config:
    """A configuration of local steps in one group of every rank: ``WAGMAStrategy(group_size=P,
    global_every=None, average_every=average_every, **options)`` under imbalance, run only when ``--only``
    names it."""
    one_group = (("group_size", WORLD), ("global_every", None), ("average_every", average_every))
    return Config(name, "wagma_sgd", True, label, one_group + tuple(options), default=False)


CONFIGS: dict[str, Config] = {
    c.name: c
    for c in (
        Config("ddp_balanced", "ddp", False, "DDP"),
        Config("eager_sgd_balanced", "eager_sgd", False, "eager-SGD solo"),
        Config("ddp_imbalanced", "ddp", True, "DDP"),
        Config("post_local_sgd_imbalanced", "post_local_sgd", True, "post-local SGD"),
        Config("eager_sgd_imbalanced", "eager_sgd", True, "eager-SGD solo"),
        Config("eager_sgd_majority_imbalanced", "eager_sgd_majority", True, "eager-SGD majority"),
        # The strategy's default bounds staleness at 1 round; the paper's unbounded solo for contrast.
        Config(
            "eager_sgd_unbounded_imbalanced", "eager_sgd", True, "eager-SGD solo, max_staleness=None",
            (("max_staleness", None),),
        ),
        Config(
            "eager_sgd_contrib_imbalanced", "eager_sgd", True, "eager-SGD solo, normalize=contributors",
            (("normalize", "contributors"),),
        ),
        Config("eager_sgd_s2_imbalanced", "eager_sgd", True, "eager-SGD solo, max_staleness=2", (("max_staleness", 2),)),
        _study("eager_sgd_s1_imbalanced", ("max_staleness", 1), note=" (the default, named)"),
        # The staleness-rule study (run when --only names them): the default rule ("auto": "inverse"
        # under momentum) against the paper's "none", at other bounds, and fresh-only rounds.
        _study("eager_sgd_rule_none_imbalanced", ("staleness_rule", "none")),
        _study("eager_sgd_unbounded_none_imbalanced", ("max_staleness", None), ("staleness_rule", "none"),
               note=" (the paper's)"),
        _study("eager_sgd_momentum_imbalanced", ("staleness_rule", "momentum")),
        _study("eager_sgd_unbounded_momentum_imbalanced", ("max_staleness", None), ("staleness_rule", "momentum")),
        _study("eager_sgd_s4_momentum_imbalanced", ("max_staleness", 4), ("staleness_rule", "momentum")),
        _study("eager_sgd_unbounded_inverse_imbalanced", ("max_staleness", None), ("staleness_rule", "inverse")),
        _study("eager_sgd_inverse_imbalanced", ("staleness_rule", "inverse")),
        _study("eager_sgd_s4_inverse_imbalanced", ("max_staleness", 4), ("staleness_rule", "inverse")),
        _study("eager_sgd_s6_inverse_imbalanced", ("max_staleness", 6), ("staleness_rule", "inverse")),
        # Fresh-only rounds: a late gradient is dropped (and counted), the sum divided by the contributors.
        _study(
            "eager_sgd_unbounded_drop_imbalanced",
            ("max_staleness", None), ("late", "drop"), ("normalize", "contributors"), ("staleness_rule", "none"),
        ),
        # Weight prediction (the strategy's default) off, at the default bound and unbounded.
        _study("eager_sgd_no_prediction_imbalanced", ("weight_prediction", False)),
        _study("eager_sgd_unbounded_no_prediction_imbalanced", ("max_staleness", None), ("weight_prediction", False)),
        _study("eager_sgd_s3_imbalanced", ("max_staleness", 3)),
        _study("eager_sgd_s4_imbalanced", ("max_staleness", 4)),
        _study("eager_sgd_unbounded_rule_none_imbalanced", ("max_staleness", None), ("staleness_rule", "none")),
        Config("eager_sgd_backup_no_prediction_imbalanced", "eager_sgd", True,
               "eager-SGD, 1 backup worker, weight_prediction=False",
               (("mode", "quorum"), ("backup_workers", 1), ("weight_prediction", False)), default=False),
        # One backup worker: a round waits for P - 1 arrivals, the last rank's gradient is carried.
        Config("eager_sgd_backup_imbalanced", "eager_sgd_backup", True, "eager-SGD, 1 backup worker", default=False),
        # Overlapped rounds: step r applies round r - 1's result; the round runs during step r. Under
        # momentum the step's delay is re-timed ("auto"); rule "inverse" leaves it as it is.
        _study("eager_sgd_overlap_imbalanced", ("overlap", True)),
        _study("eager_sgd_overlap_inverse_imbalanced", ("overlap", True), ("staleness_rule", "inverse")),
        _study("eager_sgd_overlap_unbounded_imbalanced", ("overlap", True), ("max_staleness", None)),
        _study("eager_sgd_overlap_s4_imbalanced", ("overlap", True), ("max_staleness", 4)),
        Config("eager_sgd_overlap_balanced", "eager_sgd", False, "eager-SGD solo, overlap=True",
               (("overlap", True),), default=False),
        Config("eager_sgd_backup_overlap_imbalanced", "eager_sgd", True, "eager-SGD, 1 backup worker, overlap=True",
               (("mode", "quorum"), ("backup_workers", 1), ("overlap", True)), default=False),
        # Catching up: a rank whose next round ran without it skips that batch (no compute) instead of computing a
        # gradient that would be late, so a straggler's lag stays within one straggle; with a bound above the
        # straggle (D = 2 steps) the fast ranks no longer wait. Fewer samples per round: these fits run until they
        # have trained the samples the others train in --steps (max_steps then bounds rounds at 3 x --steps), so
        # a synchronous finish placed against max_steps would never come: final_sync=0 (and its reference).
        _study("eager_sgd_final_sync0_imbalanced", ("final_sync", 0.0)),
        _study("eager_sgd_catch_up_imbalanced", ("catch_up", True), ("final_sync", 0.0)),
        _study("eager_sgd_catch_up_s2_imbalanced", ("catch_up", True), ("max_staleness", 2), ("final_sync", 0.0)),
        _study("eager_sgd_catch_up_s3_imbalanced", ("catch_up", True), ("max_staleness", 3), ("final_sync", 0.0)),
        _study("eager_sgd_catch_up_s4_imbalanced", ("catch_up", True), ("max_staleness", 4), ("final_sync", 0.0)),
        _study("eager_sgd_catch_up_unbounded_imbalanced", ("catch_up", True), ("max_staleness", None),
               ("final_sync", 0.0)),
        Config("wagma_sgd_imbalanced", "wagma_sgd", True, "WAGMA-SGD (S=2, tau=5)"),
        Config("ds_sync_imbalanced", "ds_sync", True, "DS-Sync (G=2, max_staleness=1)"),
        # Local steps between the rounds (average_every): a rank joins a round every 4th optimizer step, so its
        # communication per sample falls by 4; with one group of all ranks (group_size=P, no periodic global
        # average), local SGD with wait-avoiding global averages; and each strategy's defaults with local steps.
        _one_group("global_local4_imbalanced", "wait-avoiding local SGD (S=P, average_every=4)"),
        _one_group("global_local4_s2_imbalanced", "wait-avoiding local SGD (S=P, average_every=4, max_staleness=2)",
                   ("max_staleness", 2)),
        # What activates the one group's rounds (docs/staleness.md, what activates the rounds of local steps):
        # every rank (mode="sync": a round step waits for the slowest rank's, as post-local SGD's averages do),
        # a rank drawn per round (majority), or 3 of the 4 (quorum 3: backup_workers=1 at 4 ranks).
        _one_group("global_local4_sync_imbalanced",
                   "local SGD with synchronous averages (S=P, average_every=4, mode='sync')", ("mode", "sync")),
        _one_group("global_local4_sync_s1_imbalanced",
                   "local SGD with synchronous averages (S=P, average_every=4, mode='sync', max_staleness=1)",
                   ("mode", "sync"), ("max_staleness", 1)),
        _one_group("global_local4_majority_imbalanced",
                   "local SGD with majority averages (S=P, average_every=4, mode='majority')", ("mode", "majority")),
        _one_group("global_local4_quorum3_imbalanced",
                   "local SGD with quorum averages (S=P, average_every=4, mode='quorum', quorum=3)",
                   ("mode", "quorum"), ("quorum", 3)),
        # The period's curve: quorum 3 every 2nd and every 8th step.
        _one_group("global_local2_quorum3_imbalanced",
                   "local SGD with quorum averages (S=P, average_every=2, mode='quorum', quorum=3)",
                   ("mode", "quorum"), ("quorum", 3), average_every=2),
        _one_group("global_local8_quorum3_imbalanced",
                   "local SGD with quorum averages (S=P, average_every=8, mode='quorum', quorum=3)",
                   ("mode", "quorum"), ("quorum", 3), average_every=8),
        Config("wagma_sgd_local4_imbalanced", "wagma_sgd", True, "WAGMA-SGD (S=2, tau=5), average_every=4",
               (("average_every", 4),), default=False),
        Config("ds_sync_local4_imbalanced", "ds_sync", True, "DS-Sync (G=2, max_staleness=1), average_every=4",
               (("average_every", 4),), default=False),
        # DS-Sync's default bound is 1 round; a bound of 4 for the throughput it gives up.
        Config("ds_sync_s4_imbalanced", "ds_sync", True, "DS-Sync (G=2, max_staleness=4)", (("max_staleness", 4),)),
        # Adaptive scaling (the default with Adam-family optimizers; nothing under SGD) off.
        Config("wagma_sgd_no_scaling_imbalanced", "wagma_sgd", True, "WAGMA-SGD, adaptive_scaling='none'",
               (("adaptive_scaling", "none"),), default=False),
        Config("ds_sync_no_scaling_imbalanced", "ds_sync", True, "DS-Sync, adaptive_scaling='none'",
               (("adaptive_scaling", "none"),), default=False),
        # The global average's period, explicit: 5 (the default) and 10 (a longer period the default had before;
        # the reference code's is 11 in this count): what the more frequent wait costs under stragglers.
        Config("wagma_sgd_global5_imbalanced", "wagma_sgd", True, "WAGMA-SGD (S=2, tau=5)",
               (("global_every", 5),), default=False),
        Config("wagma_sgd_global10_imbalanced", "wagma_sgd", True, "WAGMA-SGD (S=2, tau=10)",
               (("global_every", 10),), default=False),
        # ABS-SGD under the same random stragglers: rounds paced by the fastest rank, each rank contributing the
        # micro-batches it finished (elastic sampling: a straggling rank draws fewer), so no rank waits for a
        # straggler and no lag accumulates. Trains the same samples as the others over whole epochs
        # (--steps x 4 x --batch-size must be a multiple of the data set: --steps 256 with the default batch).
        Config("abs_sgd_imbalanced", "abs_sgd", True, "ABS-SGD (delay auto: 1 under SGD, 0 under AdamW)",
               default=False),
        Config("abs_sgd_delay1_imbalanced", "abs_sgd", True, "ABS-SGD, delay=1", (("delay", 1),), default=False),
        # Fewer rounds: a rank requests one after 2 or 3 micro-batches (384 samples each by default), not each.
        Config("abs_sgd_t768_imbalanced", "abs_sgd", True, "ABS-SGD, target_samples=768",
               (("target_samples", 768),), default=False),
        Config("abs_sgd_t1152_imbalanced", "abs_sgd", True, "ABS-SGD, target_samples=1152",
               (("target_samples", 1152),), default=False),
        Config("abs_sgd_delay1_t768_imbalanced", "abs_sgd", True, "ABS-SGD, delay=1, target_samples=768",
               (("delay", 1), ("target_samples", 768)), default=False),
        # The update rule under these stragglers: weight prediction off, spike compensation off (rule "none").
        Config("abs_sgd_t768_no_prediction_imbalanced", "abs_sgd", True,
               "ABS-SGD, target_samples=768, weight_prediction=False",
               (("target_samples", 768), ("weight_prediction", False)), default=False),
        Config("abs_sgd_t768_rule_none_imbalanced", "abs_sgd", True, "ABS-SGD, target_samples=768, staleness_rule=none",
               (("target_samples", 768), ("staleness_rule", "none")), default=False),
        Config("abs_sgd_t1536_imbalanced", "abs_sgd", True, "ABS-SGD, target_samples=1536",
               (("target_samples", 1536),), default=False),
        Config("no_comm_imbalanced", "no_comm", True, "no communication (bound)"),
    )
}
