"""``--launch`` for the tests' fit scripts: the registry name of a strategy's fork twin.

``--launch fork`` starts the ranks with Lightning's multiprocessing launcher and
``start_method="fork"``: they inherit the script's imports, where the script
launcher (``popen``) runs the script again for every other rank. Ours register
``<name>_fork`` (``PartialStrategy.register_strategies``); Lightning's DDP names put
``_fork`` after ``ddp`` (``ddp_fork_find_unused_parameters_true``).
"""

from __future__ import annotations


def fork_twin(name: str) -> str:
    """The registered fork twin of strategy ``name``; ``ValueError`` naming it if there is none."""
    from lightning.pytorch.strategies import StrategyRegistry

    twin = "ddp_fork" + name[3:] if name.startswith("ddp") else name + "_fork"
    if name.startswith(("ddp_spawn", "ddp_fork", "ddp_notebook")) or name.endswith(("_spawn", "_fork")) \
            or twin not in StrategyRegistry:
        raise ValueError(f"--launch fork: strategy {name!r} has no registered fork twin ({twin!r}); "
                         "give a popen registry name or use --launch popen")
    return twin
