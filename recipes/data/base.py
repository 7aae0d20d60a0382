"""RecipeDataModule: what every recipe's data module shares (options, loaders, checks)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Optional

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from recipes.errors import RecipeConfigError, check_directory, check_int

log = logging.getLogger(__name__)


def sample_generator(seed: int, index: int) -> torch.Generator:
    """A generator for sample ``index`` of a built-in data set: each sample is a pure function of (seed, index)."""
    return torch.Generator().manual_seed((seed * 1_000_003 + index) & 0x7FFF_FFFF_FFFF_FFFF)


class BuiltinSamples(Dataset):
    """Base of the built-in data sets: ``num_samples`` samples of split ``split``, each drawn by :meth:`generator`."""

    def __init__(self, num_samples: int, seed: int, split: int) -> None:
        self.num_samples, self.seed, self.split = num_samples, seed, split

    def __len__(self) -> int:
        return self.num_samples

    def generator(self, index: int) -> torch.Generator:
        """Sample ``index``'s generator, a pure function of ``(seed, split, index)``; ``IndexError`` past the end."""
        if not 0 <= index < self.num_samples:
            raise IndexError(index)
        return sample_generator(self.seed * 7919 + self.split + 1, index)


class RecipeDataModule(L.LightningDataModule):
    """Base of the recipes' data modules.

    Subclasses implement :meth:`_build` (train and validation sets, real or
    built-in) and may set :attr:`collate_fn`. A subclass lists its own options
    and those whose default it changes, and forwards the rest as ``**kwargs`` to
    ``super().__init__(...)``: jsonargparse follows that call, so the CLI still
    offers (and defaults) every option here.

    Args:
        data_dir: the real data set's directory; ``None``: the built-in data.
        batch_size: per-rank training batch size.
        eval_batch_size: per-rank validation batch size (default: ``batch_size``).
        num_workers: DataLoader worker processes per rank.
        synthetic_train_samples, synthetic_val_samples: built-in data set sizes.
        seed: built-in data's seed.

    Raises:
        RecipeConfigError: a bad option, naming it (``data.batch_size``, ``data.data_dir``, ...).
    """

    #: What a real data directory must hold (for the error message).
    data_dir_hint = ""
    collate_fn: Optional[Callable[[list[Any]], Any]] = None

    def __init__(
        self,
        data_dir: Optional[str] = None,
        batch_size: int = 32,
        eval_batch_size: Optional[int] = None,
        num_workers: int = 0,
        synthetic_train_samples: int = 10_000,
        synthetic_val_samples: int = 1_000,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.data_dir: Optional[Path] = check_directory(data_dir, "data.data_dir", hint=self.data_dir_hint)
        self.batch_size = check_int(batch_size, "data.batch_size", minimum=1)
        self.eval_batch_size = (
            check_int(eval_batch_size, "data.eval_batch_size", minimum=1) if eval_batch_size is not None else batch_size
        )
        self.num_workers = check_int(num_workers, "data.num_workers", minimum=0)
        self.synthetic_train_samples = check_int(synthetic_train_samples, "data.synthetic_train_samples", minimum=1)
        self.synthetic_val_samples = check_int(synthetic_val_samples, "data.synthetic_val_samples", minimum=1)
        self.seed = seed
        self.train_set: Optional[Dataset] = None
        self.val_set: Optional[Dataset] = None

    @property
    def builtin(self) -> bool:
        """True when training on the built-in data (no ``data_dir``)."""
        return self.data_dir is None

    def _lengths(self, shortest: str, low: int, longest: str, high: int) -> tuple[int, int]:
        """Options ``data.<shortest>`` and ``data.<longest>``: integers >= 1, ``low <= high`` for the built-in data
        (which draws lengths between them); returns ``(low, high)``."""
        high = check_int(high, f"data.{longest}", minimum=1)
        low = check_int(low, f"data.{shortest}", minimum=1)
        if self.builtin and low > high:
            raise RecipeConfigError(f"data.{shortest}", f"must be <= data.{longest} ({high}), got {low}")
        return low, high

    def _build(self) -> tuple[Dataset, Dataset]:
        """The training and validation sets."""
        raise NotImplementedError

    def setup(self, stage: str) -> None:
        """Builds the data sets once; checks that every rank gets at least one full batch per epoch."""
        if self.train_set is None:
            self.train_set, self.val_set = self._build()
            log.debug("%s: %d training and %d validation samples (%s)", type(self).__name__, len(self.train_set),
                     len(self.val_set), "built-in" if self.builtin else self.data_dir)
        world = self.trainer.world_size if self.trainer is not None else 1
        per_rank = len(self.train_set) // max(world, 1)
        if stage == "fit" and per_rank < self.batch_size:
            raise RecipeConfigError(
                "data.batch_size",
                f"{self.batch_size} is larger than one rank's share of the training set ({len(self.train_set)} "
                f"samples over {world} ranks = {per_rank}): an epoch would have no batch",
            )

    def train_dataloader(self) -> DataLoader:
        """Shuffled, full batches (Lightning puts a ``DistributedSampler`` in; ``abs_sgd`` an elastic one)."""
        assert self.train_set is not None, "setup() first"
        return DataLoader(
            self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True, num_workers=self.num_workers,
            collate_fn=self.collate_fn, persistent_workers=self.num_workers > 0,
        )

    def val_dataloader(self) -> DataLoader:
        """The validation set in order."""
        assert self.val_set is not None, "setup() first"
        return DataLoader(
            self.val_set, batch_size=self.eval_batch_size, shuffle=False, num_workers=self.num_workers,
            collate_fn=self.collate_fn,
        )
