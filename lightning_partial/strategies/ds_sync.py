"""DSSyncStrategy (``"ds_sync"``): divide-and-shuffle synchronisation by group model averaging.

See docs/algorithms.md. Each round the P ranks are split into G groups of
P/G by a permutation drawn from an RNG seeded identically on every rank
(:class:`~lightning_partial.collectives.schedules.ShuffleSchedule`); each group
averages its parameters. Optional periodic global average (``global_every``),
and a final one at the end of fit.

**Decision:** rounds are wait-avoiding with a staleness bound of one round by
default (``mode="solo"``, ``max_staleness=1``): the first arrival activates the
round and a late member's last model is averaged (once), but no rank runs more
than one round ahead of the slowest. DS-Sync's own rule, a group that waits
for all of its members, lets a straggler hold back its group and, through the
shuffling, everybody; unbounded, with no global average ever, the ranks' lag
is a random walk that costs accuracy or diverges. Every round of lag a model
carries into an average costs accuracy under momentum: in the main jobs
(seeds 0-4) a bound of 4 ended 2.0 points below DDP at a constant rate (two
sets), 3.5 at a decaying one and 4.4 under AdamW, a bound of 1 1.1, 1.7 (both
two sets) and 1.3, for 12-14% of the throughput. Measured in docs/algorithms.md#ds-syncs-rounds.
``max_staleness=4`` (or more) buys throughput, ``None`` restores the unbounded
rule; ``mode="sync"`` makes every rank arrive before each group exchange.

**Decision:** ``late="damp"`` by default
(:func:`~lightning_partial.collectives.apply_average`). A bound above one lets
a late rank's model be several rounds old when it is averaged, and with no
periodic global average nothing resets the replicas: the undamped correction
(``late="carry"``) is unstable from a lag of 3, which ``max_staleness=3`` or
more allows, the damped one stable for every lag, the sum of the replicas
still conserved. Analysis and measurements in
docs/algorithms.md#applying-the-average; the regression test is in
``tests/test_group_average.py``.
"""

from __future__ import annotations

from typing import Optional

from typing_extensions import Unpack, override

from lightning_partial.collectives.checks import check_int
from lightning_partial.collectives.schedules import Schedule, ShuffleSchedule
from lightning_partial.strategies.model_averaging import ModelAveragingStrategy
from lightning_partial.strategies.options import AveragingOptions


def default_num_groups(world_size: int) -> int:
    """``ds_sync``'s default G: groups of two (``P / 2``); for an odd ``P``, groups of its smallest divisor
    above one (``P = 9``: three groups of three; a prime: one group of all), since G must divide P."""
    size = next((d for d in range(2, world_size + 1) if world_size % d == 0), 1)
    return world_size // size


class DSSyncStrategy(ModelAveragingStrategy):
    """DS-Sync. ``num_groups`` G (default: groups of two, or of the smallest size that divides an odd P:
    :func:`default_num_groups`); G must divide P (checked at set-up).

    The remaining options are :class:`ModelAveragingStrategy`'s; ``global_every``
    defaults to ``None`` (only the final global average), ``max_staleness`` to 1.
    """

    strategy_name = "ds_sync"
    registry_entries = (("ds_sync", "DS-Sync shuffled group model averaging", {}),)

    def __init__(
        self,
        *,
        num_groups: Optional[int] = None,
        global_every: Optional[int] = None,
        max_staleness: Optional[int] = 1,
        **kwargs: Unpack[AveragingOptions],
    ) -> None:
        check_int("num_groups", num_groups, optional=True)
        self.num_groups = num_groups
        super().__init__(global_every=global_every, max_staleness=max_staleness, **kwargs)

    @override
    def default_schedule(self, world_size: int) -> Schedule:
        groups = self.num_groups if self.num_groups is not None else default_num_groups(world_size)
        return ShuffleSchedule(world_size=world_size, num_groups=groups, seed=self.seed)
