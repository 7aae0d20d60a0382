"""lightning_partial: straggler-tolerant data-parallel training for PyTorch Lightning."""

from lightning_partial.collectives import (
    PartialAllreduce,
    PartialAllreduceConfig,
    PartialCollectiveError,
    PartialCollectiveTimeout,
    RoundResult,
    RoundStats,
)

from lightning_partial.strategies import (
    ABSSGDStrategy,
    DSSyncStrategy,
    EagerSGDStrategy,
    WAGMAStrategy,
    register_strategies,
)

__version__ = "0.1.0"

register_strategies()  # eager_sgd(_majority), wagma_sgd, ds_sync, abs_sgd and their spawn variants; idempotent

__all__ = [
    "ABSSGDStrategy",
    "DSSyncStrategy",
    "EagerSGDStrategy",
    "PartialAllreduce",
    "PartialAllreduceConfig",
    "PartialCollectiveError",
    "PartialCollectiveTimeout",
    "RoundResult",
    "RoundStats",
    "WAGMAStrategy",
    "__version__",
]
