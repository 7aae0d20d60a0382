"""The keyword options that strategies pass on to their base class, typed once.

A strategy's constructor lists its own options and forwards the rest as
``**kwargs: Unpack[...]`` (PEP 692), so each shared option is declared, defaulted
and validated in one place: Lightning's five strategy arguments and the process
group's options by :class:`~lightning_partial.strategies.process_group.ProcessGroupStrategy`,
``collective_timeout`` by :class:`~lightning_partial.strategies.partial.PartialStrategy`,
the model-averaging options by
:class:`~lightning_partial.strategies.model_averaging.ModelAveragingStrategy`.
jsonargparse (``LightningCLI``, ``class_path``/``init_args``) reads these types
for ``--trainer.strategy.<option>``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Callable, Literal, Optional, TypedDict, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision

from lightning_partial.collectives.schedules import Schedule

#: A schedule, or a callable that builds one for the world size.
ScheduleSource = Union[Schedule, Callable[[int], Schedule]]


class ProcessGroupOptions(TypedDict, total=False):
    """Lightning's strategy arguments and the process group's options (``ProcessGroupStrategy``)."""

    accelerator: Optional[Accelerator]
    parallel_devices: Optional[list[torch.device]]
    cluster_environment: Optional[ClusterEnvironment]
    checkpoint_io: Optional[CheckpointIO]
    precision_plugin: Optional[Precision]
    timeout: timedelta
    process_group_backend: Optional[str]
    start_method: Literal["popen", "spawn", "fork"]


class StrategyOptions(ProcessGroupOptions, total=False):
    """What every strategy here forwards to :class:`~lightning_partial.strategies.partial.PartialStrategy`."""

    collective_timeout: timedelta


class AveragingOptions(StrategyOptions, total=False):
    """What WAGMA-SGD and DS-Sync forward to ``ModelAveragingStrategy`` (its docstring has their meaning)."""

    mode: str
    quorum: Optional[int]
    backup_workers: Optional[int]
    normalize: str
    late: str
    stale: str
    order: str
    average_every: int
    measure_every: Optional[int]
    adaptive_scaling: str
    final_sync: float
    finish: str
    seed: int
    schedule: Optional[ScheduleSource]
