"""GroupRotation: choose, switch and log the group schedule of a model-averaging strategy.

Contract: no collective. At ``setup`` (every rank, before the strategy's
engines start at ``on_train_start``) it installs the schedule on the strategy:
one schedule, or several switched at fixed rounds (``switch_at``), so every
rank changes groups at the same round although communication threads run
rounds at different times. After each training batch it reads the strategy's
latest round statistics (``round_stats``) and logs, per optimizer:

* ``groups/group_id``: the index of this rank's group in the round's partition
  (``-1``: a global average);
* ``groups/group_size`` and ``groups/members``: the members as a bit mask
  (``sum(2**m)``: exact up to 2**53, i.e. 53 ranks, and logged only for groups
  of ranks below 53; :attr:`GroupRotation.history` keeps the tuples for any size);
* ``groups/consensus``: the consensus distance ``mean_i ||w_i - mean||^2``, in
  the rounds that measured it (every global round, and every
  ``consensus_every`` rounds).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from lightning.pytorch.callbacks import Callback
from typing_extensions import override

import lightning.pytorch as pl
from lightning_partial.callbacks.step_metrics import PendingStepMetrics
from lightning_partial.collectives.checks import check_int
from lightning_partial.collectives.schedules import Schedule, SwitchingSchedule
from lightning_partial.strategies.options import ScheduleSource

log = logging.getLogger(__name__)

#: ``groups/members`` is logged for groups of ranks below this: the bit mask is a float, exact up to 2**53.
MASK_RANKS = 53


@dataclass(frozen=True)
class GroupRecord:
    """This rank's group in one round."""

    step: int
    round_index: int
    group_id: int
    members: tuple[int, ...]
    consensus: Optional[float]


class GroupRotation(Callback):
    """Selects and logs the groups of ``"wagma_sgd"`` / ``"ds_sync"`` (see the module docstring).

    Args:
        schedule: the schedule to use (a ``Schedule`` for the job's world size, or
            a callable ``world_size -> Schedule``); ``None`` keeps the strategy's.
        switch_at: ``{round: schedule}``: from that round on, use that schedule.
        consensus_every: have the strategy measure the consensus distance every
            ``n`` rounds (besides every global average); ``None`` keeps its setting.
        log: log the metrics through ``LightningModule.log`` (any logger), at the
            batches whose step metrics Lightning writes (``log_every_n_steps``; as
            :class:`~lightning_partial.callbacks.StalenessTracker`'s).
        history: how many rounds' :class:`GroupRecord` to keep in :attr:`history`
            (the oldest are dropped, so a long fit's memory stays flat).

    Attributes:
        history: the latest ``history`` group rounds' records, oldest first.
    """

    def __init__(
        self,
        *,
        schedule: Optional[ScheduleSource] = None,
        switch_at: Optional[Mapping[int, ScheduleSource]] = None,
        consensus_every: Optional[int] = None,
        log: bool = True,
        history: int = 100_000,
    ) -> None:
        if schedule is not None and not (isinstance(schedule, Schedule) or callable(schedule)):
            raise ValueError(f"schedule must be a Schedule or a callable world_size -> Schedule, got {schedule!r}")
        switch_at = dict(switch_at or {})
        for start, s in switch_at.items():
            check_int("a switch_at round", start)
            if not (isinstance(s, Schedule) or callable(s)):
                raise ValueError(f"switch_at[{start}] must be a Schedule or a callable, got {s!r}")
        check_int("consensus_every", consensus_every, optional=True)
        check_int("history", history, minimum=0, owner="GroupRotation")
        self.schedule = schedule
        self.switch_at = switch_at
        self.consensus_every = consensus_every
        if not isinstance(log, bool):
            raise ValueError(f"GroupRotation: log must be a bool, got {log!r}")
        # Not ``self.log``: Lightning sets every callback's ``log`` to the module's at fit start.
        self._log = log
        self.history: deque[GroupRecord] = deque(maxlen=history)
        self._last_round: dict[int, int] = {}
        self._pending = PendingStepMetrics(rank_zero_only=False)

    @staticmethod
    def _model_averaging(trainer: "pl.Trainer") -> Any:
        from lightning_partial.strategies.model_averaging import ModelAveragingStrategy

        strategy = trainer.strategy
        return strategy if isinstance(strategy, ModelAveragingStrategy) else None

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._pending.clear()  # nothing of an earlier fit is logged in this one
        self._last_round.clear()  # a later fit's rounds start again
        strategy = self._model_averaging(trainer)
        if strategy is None:
            if self.schedule is not None or self.switch_at:
                raise ValueError(
                    f"GroupRotation(schedule=...) needs a model-averaging strategy ('wagma_sgd', 'ds_sync'), "
                    f"got {type(trainer.strategy).__name__}"
                )
            return
        if stage != "fit":
            return
        world = trainer.world_size
        if self.schedule is not None or self.switch_at:
            base = self.schedule if self.schedule is not None else strategy.build_schedule(world)
            if self.switch_at:
                pieces = [(0, base)] + sorted(self.switch_at.items())
                built = [p if isinstance(p, Schedule) else p(world) for _, p in pieces]
                combined: ScheduleSource = SwitchingSchedule(
                    starts=tuple(s for s, _ in pieces), schedules=tuple(built)
                )
            else:
                combined = base
            strategy.set_schedule(combined)
            strategy.validate_world(world)  # fails now, with the reason, if it does not suit P
        if self.consensus_every is not None:
            strategy.measure_every = self.consensus_every

    @override
    def on_train_epoch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._pending.clear()  # Lightning drops an epoch's unwritten step metrics: so do we

    @override
    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        stats_by_index = getattr(trainer.strategy, "round_stats", None)
        if not stats_by_index:
            return
        for index, stats in sorted(stats_by_index.items()):
            if stats.group is None or self._last_round.get(index) == stats.round_index:
                continue  # not a group round, or no new round since the last batch (accumulation)
            self._last_round[index] = stats.round_index
            group_id = stats.group_id if stats.group_id is not None else -1
            self.history.append(
                GroupRecord(trainer.global_step, stats.round_index, group_id, stats.group, stats.consensus)
            )
            if not self._log:
                continue
            suffix = "" if index == 0 else f"/opt{index}"
            metrics = {
                f"groups/group_id{suffix}": float(group_id),
                f"groups/group_size{suffix}": float(len(stats.group)),
            }
            if max(stats.group) < MASK_RANKS:  # beyond, the mask is inexact, and from 1024 ranks not a float
                metrics[f"groups/members{suffix}"] = float(sum(2**m for m in stats.group))
            if stats.consensus is not None:
                metrics[f"groups/consensus{suffix}"] = float(stats.consensus)
            self._pending.add(metrics)
        self._pending.log(trainer, pl_module)
