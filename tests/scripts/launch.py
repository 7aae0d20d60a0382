"""``--launch`` for the tests' fit scripts (``fit.py``, ``exact.py``).

``--launch fork`` starts the ranks with Lightning's multiprocessing launcher and
``start_method="fork"``: they inherit the script's imports, where the script
launcher (``popen``, the default) runs the script again for every other rank.
The code after ``trainer.fit`` then runs in the parent only, so each rank writes
its files from :class:`AtFitEnd`. Ours register ``<name>_fork``
(``PartialStrategy.register_strategies``); Lightning's DDP names put ``_fork``
after ``ddp`` (``ddp_fork_find_unused_parameters_true``).

Imports Lightning: ``exact.py`` imports this module only after installing its spy.
"""

from __future__ import annotations

import argparse
from typing import Callable, Optional

import lightning as L
import torch
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.utilities.exceptions import SIGTERMException


def add_launch_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--launch", choices=("popen", "fork"), default="popen",
                        help="how Lightning starts the ranks: the script launcher, or forked ranks")


def fork_twin(name: str) -> str:
    """The registered fork twin of strategy ``name``; ``ValueError`` naming it if there is none."""
    twin = "ddp_fork" + name[3:] if name.startswith("ddp") else name + "_fork"
    if name.startswith(("ddp_spawn", "ddp_fork", "ddp_notebook")) or name.endswith(("_spawn", "_fork")) \
            or twin not in StrategyRegistry:
        raise ValueError(f"--launch fork: strategy {name!r} has no registered fork twin ({twin!r}); "
                         "give a popen registry name or use --launch popen")
    return twin


def registry_name(parser: argparse.ArgumentParser, name: str, fork: bool) -> str:
    """``name``, or its fork twin under ``--launch fork``; a name without one is a usage error."""
    if not fork:
        return name
    try:
        return fork_twin(name)
    except ValueError as error:
        parser.error(str(error))


def release_default_group() -> None:
    """Tears the default group down at the end of a rank's fit."""
    if torch.distributed.is_initialized():
        # Now rather than during interpreter shutdown, where a gloo thread still alive has
        # aborted a DDP run once ("terminate called without an active exception") after it had
        # written its results.
        torch.distributed.destroy_process_group()


class AtFitEnd(L.Callback):
    """Calls ``write(trainer)`` in every rank at the end of the fit (under ``--launch fork`` the code
    after ``trainer.fit`` runs in the parent only), and also when SIGTERM stopped it, after
    ``on_sigterm(trainer)`` (the strategies' launcher runs the ranks' ``on_exception`` then, as
    the script launcher does). List it last: other callbacks' ``on_fit_end`` (a tracker counting
    the final flush round) come first, and no hook after it may use the process group that
    ``write`` releases."""

    def __init__(self, write: Callable[[L.Trainer], None],
                 on_sigterm: Optional[Callable[[L.Trainer], None]] = None) -> None:
        self.write = write
        self.on_sigterm = on_sigterm

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.write(trainer)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if isinstance(exception, SIGTERMException) and self.on_sigterm is not None:
            self.on_sigterm(trainer)
            self.write(trainer)
