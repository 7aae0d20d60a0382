"""Bad input, catalogued: every entry fails at construction with a ValueError naming the option.

One table across the four strategies, the engines' configurations, the schedules and
the callbacks. Each row: what is built, and a pattern the message must contain (the
option's name; where the option takes names, also one of the allowed values).
Nothing here starts a process or a group: the checks run before any training.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable

import pytest

from lightning_partial import ABSSGDStrategy, DSSyncStrategy, EagerSGDStrategy, WAGMAStrategy
from lightning_partial.callbacks import AdaptiveBatchSize, GroupRotation, LoadImbalance, StalenessTracker
from lightning_partial.collectives import PartialAllreduceConfig
from lightning_partial.collectives.delayed import DelayedConfig
from lightning_partial.collectives.schedules import ButterflySchedule, ShuffleSchedule
from lightning_partial.collectives.staleness import StalenessWeights

CASES: list[tuple[str, Callable[[], Any], str]] = [
    # eager_sgd
    ("eager_sgd unknown mode", lambda: EagerSGDStrategy(mode="fastest"), r"mode.*solo"),
    ("eager_sgd quorum without mode", lambda: EagerSGDStrategy(quorum=3), r"quorum"),
    ("eager_sgd quorum mode without quorum", lambda: EagerSGDStrategy(mode="quorum"), r"quorum"),
    ("eager_sgd quorum 0", lambda: EagerSGDStrategy(mode="quorum", quorum=0), r"quorum"),
    ("eager_sgd unknown late", lambda: EagerSGDStrategy(late="keep"), r"late.*carry"),
    ("eager_sgd unknown normalize", lambda: EagerSGDStrategy(normalize="mean"), r"normalize.*world"),
    ("eager_sgd negative staleness", lambda: EagerSGDStrategy(max_staleness=-1), r"max_staleness"),
    ("eager_sgd float staleness", lambda: EagerSGDStrategy(max_staleness=1.5), r"max_staleness"),
    ("eager_sgd sync_every 0", lambda: EagerSGDStrategy(sync_every=0), r"sync_every"),
    ("eager_sgd bool sync_every", lambda: EagerSGDStrategy(sync_every=True), r"sync_every"),
    ("eager_sgd unknown staleness rule", lambda: EagerSGDStrategy(staleness_rule="linear"), r"staleness_rule.*inverse"),
    ("eager_sgd zero timeout", lambda: EagerSGDStrategy(timeout=timedelta(0)), r"timeout"),
    ("eager_sgd timeout in seconds", lambda: EagerSGDStrategy(timeout=30), r"timeout"),
    ("eager_sgd start method", lambda: EagerSGDStrategy(start_method="fork"), r"start_method"),
    # wagma_sgd / ds_sync
    ("wagma_sgd group size 3", lambda: WAGMAStrategy(group_size=3), r"group_size"),
    ("wagma_sgd group size 0", lambda: WAGMAStrategy(group_size=0), r"group_size"),
    ("wagma_sgd global_every 0", lambda: WAGMAStrategy(global_every=0), r"global_every"),
    ("wagma_sgd unknown stale", lambda: WAGMAStrategy(stale="repeat"), r"stale.*skip"),
    ("wagma_sgd unknown late", lambda: WAGMAStrategy(late="keep"), r"late.*damp"),
    ("wagma_sgd unknown order", lambda: WAGMAStrategy(order="random"), r"order"),
    ("wagma_sgd unknown normalize", lambda: WAGMAStrategy(normalize="world"), r"normalize.*group"),
    ("ds_sync num_groups 0", lambda: DSSyncStrategy(num_groups=0), r"num_groups"),
    ("ds_sync measure_every 0", lambda: DSSyncStrategy(measure_every=0), r"measure_every"),
    ("ds_sync unknown mode", lambda: DSSyncStrategy(mode="all"), r"mode"),
    # abs_sgd
    ("abs_sgd unknown trigger", lambda: ABSSGDStrategy(trigger="steps"), r"trigger.*samples"),
    ("abs_sgd time trigger without interval", lambda: ABSSGDStrategy(trigger="time"), r"interval"),
    ("abs_sgd interval with samples", lambda: ABSSGDStrategy(interval=0.5), r"interval"),
    ("abs_sgd target_samples 0", lambda: ABSSGDStrategy(target_samples=0), r"target_samples"),
    ("abs_sgd reference_samples -4", lambda: ABSSGDStrategy(reference_samples=-4), r"reference_samples"),
    ("abs_sgd unknown staleness rule", lambda: ABSSGDStrategy(staleness_rule="spike"), r"staleness_rule"),
    # engine configurations and schedules
    ("engine config name with slash", lambda: PartialAllreduceConfig(name="a/b"), r"name"),
    ("engine setup_timeout negative", lambda: PartialAllreduceConfig(setup_timeout=timedelta(seconds=-1)),
     r"setup_timeout"),
    ("engine staleness not weights", lambda: PartialAllreduceConfig(staleness="inverse"), r"staleness"),
    ("staleness weights unknown rule", lambda: StalenessWeights(rule="linear"), r"rule"),
    ("delayed config max_epochs without epoch_samples", lambda: DelayedConfig(target_samples=8, max_epochs=2),
     r"epoch_samples"),
    ("butterfly world not a power of the group", lambda: ButterflySchedule(world_size=6, group_size=4),
     r"world_size|group_size"),
    ("shuffle more groups than ranks", lambda: ShuffleSchedule(world_size=4, num_groups=8), r"num_groups"),
    # callbacks
    ("LoadImbalance negative delay", lambda: LoadImbalance(delay_ms=-5), r"delay_ms"),
    ("LoadImbalance speed above 1", lambda: LoadImbalance(speed=[1.0, 2.0]), r"speed"),
    ("LoadImbalance stragglers -1", lambda: LoadImbalance(stragglers=-1), r"stragglers"),
    ("AdaptiveBatchSize window 0", lambda: AdaptiveBatchSize(window=0), r"window"),
    ("GroupRotation consensus_every 0", lambda: GroupRotation(consensus_every=0), r"consensus_every"),
    ("GroupRotation switch_at round 0", lambda: GroupRotation(switch_at={0: ButterflySchedule(world_size=4, group_size=2)}),
     r"switch_at"),
    ("StalenessTracker log not a bool", lambda: StalenessTracker(log="yes"), r"log"),
]


@pytest.mark.parametrize("build, pattern", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_fails_at_construction_naming_the_option(build: Callable[[], Any], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        build()


def test_the_table_is_long_enough() -> None:
    assert len(CASES) >= 25
