"""Lightning strategies over the partial-collective engine."""

from lightning_partial.strategies.eager_sgd import EagerSGDStrategy


def register_strategies() -> None:
    """Registers every strategy name with Lightning's ``StrategyRegistry`` (idempotent)."""
    from lightning.pytorch.strategies import StrategyRegistry

    EagerSGDStrategy.register_strategies(StrategyRegistry)


__all__ = ["EagerSGDStrategy", "register_strategies"]
