"""lightning_partial: straggler-tolerant data-parallel training for PyTorch Lightning.

Importing the package does not import Lightning: the engine
(:mod:`lightning_partial.collectives`) is plain torch.distributed. The strategy
classes are loaded on first access (``lightning_partial.EagerSGDStrategy``), and
their names are registered with Lightning's ``StrategyRegistry`` as soon as
``lightning.pytorch`` is imported, before or after this package
(:mod:`lightning_partial._registration`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lightning_partial import _registration
from lightning_partial.collectives import (
    PartialAllreduce,
    PartialAllreduceConfig,
    PartialCollectiveError,
    PartialCollectiveTimeout,
    RoundResult,
    RoundStats,
)

if TYPE_CHECKING:
    from lightning_partial.strategies import (
        ABSSGDStrategy,
        DSSyncStrategy,
        EagerSGDStrategy,
        WAGMAStrategy,
        register_strategies,
    )

__version__ = "0.1.0"

# Loaded from lightning_partial.strategies on first access (PEP 562): they import Lightning.
_LAZY = ("ABSSGDStrategy", "DSSyncStrategy", "EagerSGDStrategy", "WAGMAStrategy", "register_strategies")


def __getattr__(name: str) -> Any:
    if name == "strategies":  # a submodule: reachable as an attribute after a bare `import lightning_partial`
        return importlib.import_module(f"{__name__}.strategies")
    if name in _LAZY:
        value = getattr(importlib.import_module("lightning_partial.strategies"), name)
        globals()[name] = value  # later accesses skip this function
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


# eager_sgd(_majority, _backup), wagma_sgd, ds_sync, abs_sgd and their spawn variants: now if
# lightning.pytorch is imported, else right after it is; idempotent.
_registration.install()

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
    "register_strategies",
]
