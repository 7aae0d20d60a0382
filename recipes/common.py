"""RecipeCLI: the LightningCLI every recipe script runs, and the offline W&B logger the configs use.

What the CLI adds to Lightning's:

* ``conf/<recipe>.yaml`` is the default configuration of every subcommand
  (``--config`` files and flags given after it override it).
* ``--imbalance.*``: a :class:`lightning_partial.callbacks.LoadImbalance`, always
  present (inactive with the default ``delay_ms: 0`` and no ``speed``).
* ``--summary.*``: a :class:`recipes.summary.FitSummary` (per-rank throughput,
  rank 0's final held-out accuracy).
* The data module's derived sizes (classes, feature size, vocabularies) are
  linked to the model's arguments.
* Checks before anything is built: an unknown ``--trainer.strategy``, a missing
  ``--data.data_dir``, a bad ``--data.batch_size`` (and every other option the
  data modules and models check) end the program with one line naming the
  option, exit status 2, before any process is launched.
* The W&B run (``OfflineWandbLogger``) is named ``<recipe>-<strategy>`` unless a
  name is given, and finished at the end of ``fit`` on rank 0.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import lightning_partial  # noqa: F401 - registers eager_sgd, eager_sgd_majority, wagma_sgd, ds_sync (and abs_sgd)
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import WandbLogger
from lightning_partial.callbacks import LoadImbalance

from recipes.errors import RecipeConfigError
from recipes.summary import FitSummary

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
CONF_DIR = ROOT / "conf"
#: The strategies the recipes are written for (any other registered name works too).
STRATEGIES = ("eager_sgd", "eager_sgd_majority", "wagma_sgd", "ds_sync", "abs_sgd", "ddp")
_LIGHTNING_NAMES = ("auto",)  # accepted by the Trainer besides the registry


def registered_strategies() -> list[str]:
    """Names in Lightning's ``StrategyRegistry`` (after ``import lightning_partial``)."""
    from lightning.pytorch.strategies import StrategyRegistry

    return list(StrategyRegistry.available_strategies())


def check_strategy(value: Any) -> None:
    """Fails with a message naming ``--trainer.strategy`` if ``value`` is a name no registry knows."""
    if not isinstance(value, str):
        return  # a configured Strategy (class_path / init_args): Lightning and jsonargparse check it
    registered = registered_strategies()
    if value in registered or value in _LIGHTNING_NAMES:
        return
    if value == "abs_sgd":
        raise RecipeConfigError("trainer.strategy", "abs_sgd is not registered by this version of lightning_partial")
    raise RecipeConfigError(
        "trainer.strategy",
        f"unknown strategy {value!r}; choose one of {', '.join(s for s in STRATEGIES if s in registered)} "
        "(or another name in Lightning's StrategyRegistry, or a Strategy class_path)",
    )


class OfflineWandbLogger(WandbLogger):
    """Lightning's ``WandbLogger``, offline and prompt-free unless asked otherwise (as ``lightning_partial.loggers.wandb_logger``).

    ``wandb`` itself is imported only when the run starts (rank 0). Offline runs
    land in ``<save_dir>/wandb/offline-run-*``; upload one later with
    ``wandb sync <that directory>``.

    Args:
        project: the W&B project.
        save_dir: where the ``wandb/`` run directory goes (created).
        name: the run's name (default: ``<recipe>-<strategy>``, set by the CLI).
        offline: ``None``: offline unless ``WANDB_MODE`` asks for another mode; ``True``/``False``: forced.
        kwargs: passed on to ``WandbLogger`` (``tags``, ``group``, ``log_model``, ...).
    """

    def __init__(self, project: str = "lightning_partial", save_dir: str = "runs", name: Optional[str] = None,
                 offline: Optional[bool] = None, **kwargs: Any) -> None:
        import importlib.util

        from lightning_partial.loggers import INSTALL_HINT

        if importlib.util.find_spec("wandb") is None:
            raise ImportError(INSTALL_HINT)
        if offline is None:
            offline = os.environ.get("WANDB_MODE", "offline") in ("offline", "dryrun")
        if offline:
            os.environ.setdefault("WANDB_MODE", "offline")
        os.environ.setdefault("WANDB_SILENT", "true")
        Path(save_dir).mkdir(parents=True, exist_ok=True)
        super().__init__(project=project, save_dir=save_dir, name=name, offline=offline, **kwargs)


def _quiet_warnings() -> None:
    """Lightning's CPU advice that does not apply to these recipes (built-in data needs no workers)."""
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*The number of training batches.*is smaller than the logging interval.*")
    warnings.filterwarnings("ignore", ".*`isinstance\\(treespec, LeafSpec\\)` is deprecated.*")


# Which option group a class's own error message belongs to ("LoadImbalance: delay_ms must be ...").
_GROUPS = {"LoadImbalance": "imbalance", "FitSummary": "summary", "wandb": "trainer.logger"}


def _option_of(message: str) -> str:
    """The CLI option a library error message is about, as well as it can be told (``config`` otherwise)."""
    for prefix, group in _GROUPS.items():
        if message.startswith(prefix):
            words = message[len(prefix):].lstrip(": ").split()
            field = words[0] if words else ""
            return f"{group}.{field}" if field.isidentifier() and prefix != "wandb" else group
    return "config"


class RecipeCLI(LightningCLI):
    """The LightningCLI of a recipe (see the module docstring).

    Args:
        model_class, datamodule_class: the recipe's LightningModule and LightningDataModule.
        recipe: the recipe's name: ``conf/<recipe>.yaml`` is its default configuration.
        links: ``(data attribute, model argument)`` pairs, e.g. ``("num_classes", "num_classes")``.
        args: arguments instead of ``sys.argv[1:]`` (tests).
        run: run the subcommand (``False``: only build the objects).
    """

    def __init__(self, model_class: type, datamodule_class: type, *, recipe: str,
                 links: Sequence[tuple[str, str]] = (), args: Optional[Union[list[str], dict]] = None,
                 run: bool = True) -> None:
        self.recipe = recipe
        self.links = tuple(links)
        config = CONF_DIR / f"{recipe}.yaml"
        defaults = {"default_config_files": [str(config)]} if config.is_file() else {}
        parser_kwargs: dict[str, Any] = {"fit": defaults, "validate": defaults, "test": defaults} if run else defaults
        _quiet_warnings()
        super().__init__(
            model_class, datamodule_class, args=args, run=run, parser_kwargs=parser_kwargs,
            save_config_kwargs={"overwrite": True}, seed_everything_default=0,
        )

    # ------------------------------------------------------------ parser
    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.add_lightning_class_args(LoadImbalance, "imbalance")
        parser.add_lightning_class_args(FitSummary, "summary")
        for source, target in self.links:
            parser.link_arguments(f"data.{source}", f"model.{target}", apply_on="instantiate")

    # ------------------------------------------------------------ checks
    def _section(self) -> Any:
        return self.config[self.subcommand] if self.subcommand else self.config

    def _fail(self, error: Exception) -> None:
        """One line on stderr naming the option, exit status 2 (as a command-line usage error)."""
        where = f"recipes/{self.recipe}.py {self.subcommand or ''}".rstrip()
        print(f"{where}: error: {error}", file=sys.stderr)
        raise SystemExit(2)

    def before_instantiate_classes(self) -> None:
        section = self._section()
        try:
            check_strategy(section.trainer.strategy)
        except RecipeConfigError as err:
            self._fail(err)
        self._name_wandb_run(section)

    def instantiate_classes(self) -> None:
        """Builds the objects; a bad option in any of them ends the program with its message."""
        try:
            super().instantiate_classes()
        except RecipeConfigError as err:
            self._fail(err)
        except (ValueError, ImportError) as err:  # e.g. LoadImbalance's, a strategy's or wandb's own checks
            self._fail(RecipeConfigError(_option_of(str(err)), str(err)))

    def _name_wandb_run(self, section: Any) -> None:
        """Names an unnamed ``OfflineWandbLogger`` run ``<recipe>-<strategy>``."""
        strategy = section.trainer.strategy
        if isinstance(strategy, str):
            label = strategy
        else:  # a configured Strategy: its class name
            label = str(getattr(strategy, "class_path", "strategy")).rsplit(".", 1)[-1]
        loggers = section.trainer.logger
        for logger in loggers if isinstance(loggers, list) else [loggers]:
            class_path = getattr(logger, "class_path", None)
            init_args = getattr(logger, "init_args", None)
            if class_path and class_path.endswith("OfflineWandbLogger") and init_args is not None:
                if init_args.get("name") is None:
                    init_args["name"] = f"{self.recipe}-{label}"

    # ------------------------------------------------------------ end of fit
    def after_fit(self) -> None:
        """Finishes rank 0's W&B run now (its files complete), rather than at interpreter exit."""
        if not self.trainer.is_global_zero:
            return
        for logger in self.trainer.loggers:
            if isinstance(logger, WandbLogger) and getattr(logger, "_experiment", None) is not None:
                logger.experiment.finish()
                log.info("W&B run %r finished (under %s)", logger.name, logger.save_dir)


def main(model_class: type, datamodule_class: type, *, recipe: str, links: Sequence[tuple[str, str]] = (),
         args: Optional[list[str]] = None) -> RecipeCLI:
    """Runs a recipe's CLI (its script's entry point)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("lightning_partial").setLevel(logging.WARNING)
    return RecipeCLI(model_class, datamodule_class, recipe=recipe, links=links, args=args)
