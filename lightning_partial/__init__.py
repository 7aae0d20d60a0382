"""lightning_partial: straggler-tolerant data-parallel training for PyTorch Lightning."""

from lightning_partial.collectives import (
    PartialAllreduce,
    PartialAllreduceConfig,
    PartialCollectiveError,
    PartialCollectiveTimeout,
    RoundResult,
    RoundStats,
)

__version__ = "0.1.0"

__all__ = [
    "PartialAllreduce",
    "PartialAllreduceConfig",
    "PartialCollectiveError",
    "PartialCollectiveTimeout",
    "RoundResult",
    "RoundStats",
    "__version__",
]
