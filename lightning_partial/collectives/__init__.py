"""The partial-collective engine: pure torch.distributed, no Lightning.

See :class:`PartialAllreduce` for the threads-and-collectives contract.
"""

from lightning_partial.collectives.config import PartialAllreduceConfig
from lightning_partial.collectives.delayed import DelayedAllreduce, DelayedConfig
from lightning_partial.collectives.engine import PartialAllreduce, RoundResult
from lightning_partial.collectives.errors import (
    EngineClosedError,
    PartialCollectiveError,
    PartialCollectiveTimeout,
)
from lightning_partial.collectives.group_average import GroupAverage, apply_average
from lightning_partial.collectives.liveness import Heartbeat
from lightning_partial.collectives.schedules import ButterflySchedule, Schedule, ShuffleSchedule, SwitchingSchedule
from lightning_partial.collectives.stats import RoundStats
from lightning_partial.collectives.store import create_store

__all__ = [
    "ButterflySchedule",
    "DelayedAllreduce",
    "DelayedConfig",
    "GroupAverage",
    "Heartbeat",
    "Schedule",
    "ShuffleSchedule",
    "SwitchingSchedule",
    "apply_average",
    "EngineClosedError",
    "PartialAllreduce",
    "PartialAllreduceConfig",
    "PartialCollectiveError",
    "PartialCollectiveTimeout",
    "RoundResult",
    "RoundStats",
    "create_store",
]
