"""RecipeCLI: the LightningCLI every recipe script runs.

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
  data modules, models, callbacks, strategies and Lightning's ``Trainer`` check) end
  the program with one line naming the option, exit status 2, before any process
  is launched. So do, once the objects are built, what depends on the world size
  (``--trainer.devices`` x ``--trainer.num_nodes``: eager_sgd_majority on one rank,
  wagma_sgd's butterfly on a world that is not a power of two, ``--imbalance.speed``
  with one factor per rank), options that conflict with the strategy (abs_sgd with
  ``--trainer.val_check_interval`` or ``--trainer.accumulate_grad_batches``), and a
  ``--ckpt_path`` that does not exist, is not a checkpoint, or holds engine state
  that the strategy cannot resume (another engine family's). What only the ranks'
  set-up can tell (a data file in the wrong format, found when the data is read)
  ends the same way, before the first batch.
* The W&B run (``lightning_partial.loggers.OfflineWandbLogger``, offline unless
  ``WANDB_MODE`` says otherwise) is named ``<recipe>-<strategy>`` unless a name
  is given, and finished at the end of ``fit`` on rank 0.
"""

from __future__ import annotations

import inspect
import logging
import re
import sys
import typing
import warnings
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import lightning_partial  # noqa: F401 - registers eager_sgd, eager_sgd_majority, eager_sgd_backup, wagma_sgd, ds_sync, abs_sgd
import torch
import typing_extensions
from lightning.pytorch import Trainer
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning_partial.callbacks import LoadImbalance
from lightning_partial.strategies.checkpoint import CHECKPOINT_KEY, CheckpointMismatchError, resume_entry
from lightning_partial.strategies.partial import PartialStrategy

from recipes.errors import RecipeConfigError
from recipes.summary import FitSummary

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
CONF_DIR = ROOT / "conf"
#: The strategies the recipes are written for (any other registered name works too).
STRATEGIES = ("eager_sgd", "eager_sgd_majority", "eager_sgd_backup", "wagma_sgd", "ds_sync", "abs_sgd", "ddp")
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
    raise RecipeConfigError(
        "trainer.strategy",
        f"unknown strategy {value!r}; choose one of {', '.join(s for s in STRATEGIES if s in registered)} "
        "(or another name in Lightning's StrategyRegistry, or a Strategy class_path)",
    )


def _quiet_warnings() -> None:
    """Lightning's CPU advice that does not apply to these recipes (built-in data needs no workers)."""
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*The number of training batches.*is smaller than the logging interval.*")
    warnings.filterwarnings("ignore", ".*`isinstance\\(treespec, LeafSpec\\)` is deprecated.*")


# Which option group a class's own error message belongs to ("LoadImbalance: delay_ms must be ...").
_GROUPS = {"LoadImbalance": "imbalance", "FitSummary": "summary", "wandb": "trainer.logger"}


_TRAINER_ARGS = frozenset(inspect.signature(Trainer.__init__).parameters) - {"self"}
# Lightning names the argument in back quotes: "`num_nodes` must be ...", "`accelerator='tpu9'`".
_BACKQUOTED = re.compile(r"`([A-Za-z_]\w*)(?:=[^`]*)?`")
#: Checkpoint names Lightning resolves itself (not paths).
_CKPT_NAMES = ("last", "best", "hpc", "registry")


def _option_of(message: str) -> str:
    """The CLI option a library error message is about, as well as it can be told (``config`` otherwise)."""
    for prefix, group in _GROUPS.items():
        if message.startswith(prefix):
            field = re.match(r"[A-Za-z_]\w*", message[len(prefix):].lstrip(": "))  # "speed[1] must ...": speed
            return f"{group}.{field.group()}" if field and prefix != "wandb" else group
    for name in _BACKQUOTED.findall(message):  # Lightning's Trainer
        if name in _TRAINER_ARGS:
            return f"trainer.{name}"
    return "config"


_KINDS = (("lightning.pytorch.strategies", "Strategy", "trainer.strategy"),
          ("lightning.pytorch.loggers", "Logger", "trainer.logger"),
          ("lightning.pytorch.callbacks", "Callback", "trainer.callbacks"))


def init_parameters(cls: type) -> set[str]:
    """The keyword arguments ``cls(...)`` takes: the ``__init__`` parameters of every class in its MRO, and the
    keys of the TypedDicts that a ``**kwargs: Unpack[...]`` forwards (the strategies' shared options are declared
    there, e.g. ``WAGMAStrategy``'s ``late``)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None or not inspect.isfunction(init):
            continue
        try:
            hints = typing.get_type_hints(init, include_extras=True)
        except Exception:  # noqa: BLE001 - an annotation that does not resolve here: the plain names still count
            hints = {}
        for param in inspect.signature(init).parameters.values():
            if param.kind is param.VAR_KEYWORD:
                for forwarded in typing_extensions.get_args(hints.get(param.name)):
                    if typing_extensions.is_typeddict(forwarded):
                        names |= forwarded.__required_keys__ | forwarded.__optional_keys__
            elif param.kind is not param.VAR_POSITIONAL:
                names.add(param.name)
    return names - {"self"}


def _union_error(message: str) -> Optional[RecipeConfigError]:
    """jsonargparse's "Does not validate against any of the Union subtypes" for a ``class_path`` object
    (``--trainer.strategy lightning_partial.DSSyncStrategy --trainer.strategy.num_groups 0``) as one line
    naming the init argument: the class's own message, without the dump of every argument."""
    if "Union subtypes" not in message:
        return None
    # Each "- " item of the Errors list, with the more indented lines that continue it (the class's own
    # message follows "Problem with given class_path ...:" on the next line); the lists end at "Given value".
    reasons: list[str] = []
    item: Optional[list[str]] = None
    for line in message.splitlines():
        text = line.strip()
        if text.startswith("- "):
            item = None if text.startswith("- Expected a ") else [text[2:]]
            if item is not None:
                reasons.append("")
        elif item is not None and line.startswith("    ") and text:
            item.append(text)
        else:
            item = None
        if item is not None:
            reasons[-1] = " ".join(item)
    found = re.search(r"class_path='([\w.]+)'", message)
    if not reasons or not found:
        return None
    import importlib

    module, _, name = found.group(1).rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None
    option = "config"
    for where, base, key in _KINDS:
        if isinstance(cls, type) and issubclass(cls, getattr(importlib.import_module(where), base)):
            option = key
            break
    reason = "; ".join(reasons)
    params = init_parameters(cls)
    argument = next((w for w in re.findall(r"[A-Za-z_]\w*", reason) if w in params), None)
    if argument is not None and option != "config":
        option = f"{option}.{argument}"
    return RecipeConfigError(option, f"{name}: {reason}")


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
        subcommand = getattr(self, "subcommand", None) or self.config.get("subcommand")
        where = f"python -m recipes.{self.recipe} {subcommand or ''}".rstrip()  # the command, as argparse names it
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
        except (ValueError, ImportError, TypeError, MisconfigurationException) as err:
            # LoadImbalance's, a strategy's, wandb's or the Trainer's own checks
            self._fail(_union_error(str(err)) or RecipeConfigError(_option_of(str(err)), str(err)))

    def after_instantiate_classes(self) -> None:
        """What needs the built objects, checked before ``fit`` launches any process."""
        if self.subcommand is None:
            return
        try:
            self._check_world()
            self._check_resume()
        except RecipeConfigError as err:
            self._fail(err)

    def _check_world(self) -> None:
        """The strategy's and the callbacks' checks that depend on the number of ranks, on this process."""
        trainer = self.trainer
        devices, nodes = trainer.num_devices, trainer.num_nodes
        world = devices * nodes
        ranks = f"{world} rank(s) (--trainer.devices {devices} x --trainer.num_nodes {nodes})"
        strategy = trainer.strategy
        if isinstance(strategy, PartialStrategy) and self.subcommand == "fit":  # evaluation never uses the engines
            configured = self._section().trainer.strategy
            name = configured if isinstance(configured, str) else type(strategy).__name__
            try:
                strategy.validate_world(world)
            except ValueError as err:
                raise RecipeConfigError("trainer.strategy", f"{name} cannot run on {ranks}: {err}") from None
            try:
                strategy.check_precision()
            except ValueError as err:
                raise RecipeConfigError("trainer.precision", str(err)) from None
            if strategy.strategy_name == "abs_sgd":
                from lightning_partial.strategies.abs_sgd import check_validation_schedule

                try:
                    check_validation_schedule(trainer)
                except ValueError as err:
                    raise RecipeConfigError("trainer.val_check_interval", str(err)) from None
                if trainer.accumulate_grad_batches != 1:
                    raise RecipeConfigError(
                        "trainer.accumulate_grad_batches",
                        f"must be 1 under abs_sgd (it accumulates micro-batches itself), got "
                        f"{trainer.accumulate_grad_batches}",
                    )
        for callback in trainer.callbacks:
            if not isinstance(callback, LoadImbalance):
                continue
            if callback.delay_ms > 0 and callback.stragglers > world:
                raise RecipeConfigError("imbalance.stragglers",
                                        f"must be <= the number of ranks, {ranks}; got {callback.stragglers}")
            if callback.speed is not None and len(callback.speed) != world:
                raise RecipeConfigError("imbalance.speed", f"needs one factor per rank, {ranks}; got "
                                                           f"{len(callback.speed)} factors")

    def _ckpt_file(self) -> Optional[Path]:
        """``--ckpt_path`` as a local file path, or ``None`` (unset, a name Lightning resolves, or a URL)."""
        subcommand = self.config.get("subcommand")  # (called before self.subcommand is set)
        value = self.config[subcommand].get("ckpt_path") if subcommand else None
        if not value or not isinstance(value, (str, Path)):
            return None
        text = str(value)
        if text in _CKPT_NAMES or text.startswith("registry:") or "://" in text:
            return None
        return Path(text).expanduser()

    def _parse_ckpt_path(self) -> None:
        """Lightning's (the model's hyperparameters from the checkpoint), after checking that the file is one."""
        path = self._ckpt_file()
        if path is not None and not path.is_file():
            self._fail(RecipeConfigError(
                "ckpt_path", f"no checkpoint file at {str(path)!r} (a file written by trainer.save_checkpoint or "
                             f"ModelCheckpoint, or one of {', '.join(_CKPT_NAMES)})"))
        try:
            super()._parse_ckpt_path()
        except SystemExit:
            raise
        except Exception as err:  # noqa: BLE001 - torch.load of a file that is not a checkpoint: any error
            given = self.config[self.config.subcommand].get("ckpt_path")
            self._fail(RecipeConfigError("ckpt_path", f"{str(given)!r} cannot be read as a Lightning checkpoint "
                                                      f"({type(err).__name__}: {str(err).splitlines()[0][:200]})"))

    def _check_resume(self) -> None:
        """A checkpoint whose engine state the strategy cannot resume (another family's): refused now."""
        path = self._ckpt_file()
        strategy = self.trainer.strategy
        if path is None or not isinstance(strategy, PartialStrategy) or self.subcommand != "fit":
            return  # (validate / test load the weights only)
        try:  # mmap: the tensors are not read
            entry = torch.load(path, map_location="cpu", weights_only=True, mmap=True).get(CHECKPOINT_KEY)
        except Exception:  # noqa: BLE001 - not readable this way: the strategy's own check at load time decides
            return
        try:
            resume_entry(entry, strategy=strategy.strategy_name, family=strategy.engine_family)
        except CheckpointMismatchError as err:
            raise RecipeConfigError("ckpt_path", f"{str(path)!r}: {err.reason}") from None

    def _run_subcommand(self, subcommand: str) -> None:
        """Runs the subcommand; a bad option found by the ranks' set-up (before the first batch) ends it as above."""
        try:
            super()._run_subcommand(subcommand)
        except RecipeConfigError as err:
            self._fail(err)
        except CheckpointMismatchError as err:
            self._fail(RecipeConfigError("ckpt_path", str(err)))

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
                run = logger.experiment
                name = run.name  # the run's (logger.name is the project's)
                run.finish()
                log.info("W&B run %r finished (under %s)", name, logger.save_dir)


def main(model_class: type, datamodule_class: type, *, recipe: str, links: Sequence[tuple[str, str]] = (),
         args: Optional[list[str]] = None) -> RecipeCLI:
    """Runs a recipe's CLI (its script's entry point)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("lightning_partial").setLevel(logging.WARNING)
    return RecipeCLI(model_class, datamodule_class, recipe=recipe, links=links, args=args)
