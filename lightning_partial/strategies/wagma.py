"""WAGMAStrategy (``"wagma_sgd"``): wait-avoiding group model averaging over a butterfly schedule.

ALGORITHMS.md section 2. Each step: a local SGD step, then the average of the
model within the round's butterfly group of size S (phases rotating every
round, so ``log_S P`` consecutive rounds mix every rank into every other),
activated by the first rank to arrive; a global average every ``tau`` rounds
and at the end of fit. The contract is :mod:`lightning_partial.strategies.model_averaging`'s.
"""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Literal, Optional

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.strategies import _StrategyRegistry
from lightning.pytorch.plugins.precision import Precision
from typing_extensions import override

import lightning.pytorch as pl
from lightning_partial.collectives.schedules import ButterflySchedule, Schedule
from lightning_partial.strategies.model_averaging import ModelAveragingStrategy, ScheduleSource


def default_group_size(world_size: int) -> int:
    """About sqrt(P), a power of two (the reference: P=64, S=8): 2 for P <= 4, 4 for P = 8 or 16."""
    return 2 ** ((int(math.log2(world_size)) + 1) // 2) if world_size > 1 else 1


class WAGMAStrategy(ModelAveragingStrategy):
    """WAGMA-SGD. ``group_size`` S (a power of two; default about sqrt(P)), ``tau`` = ``global_every`` (10).

    The remaining options are :class:`ModelAveragingStrategy`'s. Checked at
    construction: S a power of two, tau >= 1. Checked at set-up, before any
    training (the world size is known then): P a power of two, S <= P.
    """

    strategy_name = "wagma_sgd"

    def __init__(
        self,
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        *,
        group_size: Optional[int] = None,
        global_every: Optional[int] = 10,
        mode: str = "solo",
        quorum: Optional[int] = None,
        normalize: str = "group",
        late: str = "carry",
        stale: str = "skip",
        max_staleness: Optional[int] = None,
        measure_every: Optional[int] = None,
        seed: int = 0,
        schedule: Optional[ScheduleSource] = None,
        timeout: timedelta = timedelta(minutes=30),
        process_group_backend: Optional[str] = None,
        start_method: Literal["popen", "spawn"] = "popen",
    ) -> None:
        if group_size is not None and (
            isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1
            or group_size & (group_size - 1)
        ):
            raise ValueError(f"group_size must be a power of two >= 1, got {group_size!r}")
        self.group_size = group_size
        super().__init__(
            accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
            mode=mode, quorum=quorum, normalize=normalize, late=late, stale=stale, global_every=global_every,
            max_staleness=max_staleness, measure_every=measure_every, seed=seed, schedule=schedule,
            timeout=timeout, process_group_backend=process_group_backend, start_method=start_method,
        )

    @override
    def default_schedule(self, world_size: int) -> Schedule:
        size = self.group_size if self.group_size is not None else default_group_size(world_size)
        return ButterflySchedule(world_size=world_size, group_size=size)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        for name, start_method in (("wagma_sgd", "popen"), ("wagma_sgd_spawn", "spawn")):
            if name in strategy_registry:  # idempotent
                continue
            strategy_registry.register(
                name, cls, description=f"WAGMA-SGD group model averaging, start_method '{start_method}'",
                start_method=start_method,
            )
