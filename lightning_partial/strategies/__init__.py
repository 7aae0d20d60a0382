"""Lightning strategies over the partial-collective engines."""

from lightning_partial.strategies.abs_sgd import ABSSGDStrategy
from lightning_partial.strategies.ds_sync import DSSyncStrategy
from lightning_partial.strategies.eager_sgd import EagerSGDStrategy
from lightning_partial.strategies.model_averaging import ModelAveragingStrategy
from lightning_partial.strategies.partial import PartialStrategy
from lightning_partial.strategies.wagma import WAGMAStrategy


#: The shipped strategies, in the order their names are listed (the registry, checkpoint errors).
STRATEGIES: tuple[type[PartialStrategy], ...] = (EagerSGDStrategy, WAGMAStrategy, DSSyncStrategy, ABSSGDStrategy)


def register_strategies() -> None:
    """Registers every strategy name with Lightning's ``StrategyRegistry`` (idempotent)."""
    from lightning.pytorch.strategies import StrategyRegistry

    for cls in STRATEGIES:
        cls.register_strategies(StrategyRegistry)


# Importing the strategies registers them (as `import lightning_partial` does once Lightning is imported).
register_strategies()


__all__ = [
    "ABSSGDStrategy",
    "DSSyncStrategy",
    "EagerSGDStrategy",
    "ModelAveragingStrategy",
    "PartialStrategy",
    "STRATEGIES",
    "WAGMAStrategy",
    "register_strategies",
]
