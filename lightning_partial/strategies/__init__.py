"""Lightning strategies over the partial-collective engines."""

from lightning_partial.strategies.abs_sgd import ABSSGDStrategy
from lightning_partial.strategies.ds_sync import DSSyncStrategy
from lightning_partial.strategies.eager_sgd import EagerSGDStrategy
from lightning_partial.strategies.model_averaging import ModelAveragingStrategy
from lightning_partial.strategies.partial import PartialStrategy
from lightning_partial.strategies.wagma import WAGMAStrategy


def register_strategies() -> None:
    """Registers every strategy name with Lightning's ``StrategyRegistry`` (idempotent)."""
    from lightning.pytorch.strategies import StrategyRegistry

    EagerSGDStrategy.register_strategies(StrategyRegistry)
    WAGMAStrategy.register_strategies(StrategyRegistry)
    DSSyncStrategy.register_strategies(StrategyRegistry)
    ABSSGDStrategy.register_strategies(StrategyRegistry)


# Importing the strategies registers them (as `import lightning_partial` does once Lightning is imported).
register_strategies()


__all__ = [
    "ABSSGDStrategy",
    "DSSyncStrategy",
    "EagerSGDStrategy",
    "ModelAveragingStrategy",
    "PartialStrategy",
    "WAGMAStrategy",
    "register_strategies",
]
