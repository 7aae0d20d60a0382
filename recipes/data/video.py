"""Variable-length videos as per-frame feature sequences (UCF101-style), real or built-in.

**Real format** (``data_dir`` set), one feature file per video, as produced by
running a frame-level CNN (e.g. ResNet-50's pooled features) over each video:

```
data_dir/
  train.csv          # header "video,label"; one row per video
  val.csv
  features/...       # the paths the CSV files name, relative to data_dir
```

* ``video``: path of a NumPy ``.npy`` file, relative to ``data_dir``, holding a
  ``float32``/``float16`` array ``[frames, feature_dim]`` (frames >= 1; the
  feature size is the same for every video).
* ``label``: the class index, an integer in ``0..num_classes-1`` (UCF101's
  ``classInd.txt`` numbers minus one). ``num_classes`` is the largest label + 1.

Sequences longer than ``max_frames`` are subsampled evenly to ``max_frames``.

**Built-in** (``data_dir`` unset): a video of class ``c`` has a random length in
``[min_frames, max_frames]``; its frames are Gaussian noise, and during an
"action" (a random window covering 30-60% of the frames) the class's fixed
feature pattern is added to them. The label depends only on the content, the
position of the action varies, and the length varies: long videos cost more
compute, the inherent imbalance of the LSTM workload.

Batches: ``(features [B, T_max, D] zero-padded, lengths [B] int64, labels [B] int64)``.
"""

from __future__ import annotations

import csv
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from recipes.data.base import BuiltinSamples, RecipeDataModule
from recipes.errors import RecipeConfigError, check_float, check_int, require_file

log = logging.getLogger(__name__)

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def pad_sequences(samples: list[tuple[torch.Tensor, int]]) -> Batch:
    """``collate_fn``: zero-pads ``[T_i, D]`` sequences to ``[B, T_max, D]``; returns them, lengths and labels."""
    lengths = torch.tensor([len(x) for x, _ in samples], dtype=torch.int64)
    features = torch.nn.utils.rnn.pad_sequence([x for x, _ in samples], batch_first=True)
    labels = torch.tensor([y for _, y in samples], dtype=torch.int64)
    return features, lengths, labels


class ActionSequences(BuiltinSamples):
    """Built-in variable-length feature sequences whose label is the action they contain (module docstring)."""

    def __init__(self, num_samples: int, *, num_classes: int, feature_dim: int, min_frames: int, max_frames: int,
                 signal: float = 1.0, seed: int = 0, split: int = 0) -> None:
        super().__init__(num_samples, seed, split)
        self.num_classes, self.feature_dim = num_classes, feature_dim
        self.min_frames, self.max_frames, self.signal = min_frames, max_frames, signal
        g = torch.Generator().manual_seed(seed)
        patterns = torch.randn(num_classes, feature_dim, generator=g)
        self.patterns = patterns / patterns.norm(dim=1, keepdim=True) * feature_dim**0.5

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        g = self.generator(index)
        label = int(torch.randint(self.num_classes, (1,), generator=g))
        frames = int(torch.randint(self.min_frames, self.max_frames + 1, (1,), generator=g))
        x = torch.randn(frames, self.feature_dim, generator=g)
        span = max(1, round(frames * (0.3 + 0.3 * float(torch.rand(1, generator=g)))))
        start = int(torch.randint(0, frames - span + 1, (1,), generator=g))
        x[start : start + span] += self.signal * self.patterns[label]
        return x, label


def read_label_csv(path: Path) -> list[tuple[str, int]]:
    """Rows ``(video path, label)`` of a ``video,label`` CSV; errors name the file and the row."""
    rows: list[tuple[str, int]] = []
    # utf-8-sig: a CSV saved by a spreadsheet starts with a byte-order mark, which would join the first name.
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f, skipinitialspace=True)  # "video, label" too
        if reader.fieldnames is None or not {"video", "label"} <= {name.strip() for name in reader.fieldnames}:
            raise RecipeConfigError("data.data_dir", f"{str(path)!r} must have the header 'video,label', "
                                                     f"got {reader.fieldnames}")
        for line, row in enumerate(reader, start=2):
            try:
                label = int(row["label"])
            except (TypeError, ValueError):
                raise RecipeConfigError("data.data_dir", f"{str(path)!r} line {line}: label must be an integer "
                                                         f"class index, got {row['label']!r}") from None
            if label < 0 or not row["video"]:
                raise RecipeConfigError("data.data_dir", f"{str(path)!r} line {line}: bad row {row}")
            rows.append((row["video"], label))
    if not rows:
        raise RecipeConfigError("data.data_dir", f"{str(path)!r} lists no video")
    return rows


def load_features(path: Path) -> np.ndarray:
    """A ``.npy`` feature array (memory-mapped); an error naming ``data.data_dir`` if the file is not one."""
    with open(path, "rb") as f:
        magic = f.read(6)
    if magic != b"\x93NUMPY":
        raise RecipeConfigError("data.data_dir", f"{str(path)!r} is not a NumPy .npy feature file (it starts with "
                                                 f"{magic!r}, not the .npy magic b'\\x93NUMPY'; save it with numpy.save)")
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as err:
        raise RecipeConfigError("data.data_dir", f"{str(path)!r} is not a NumPy .npy feature file "
                                                 f"({str(err).splitlines()[0][:120]})") from None
    if not isinstance(array, np.ndarray) or not np.issubdtype(array.dtype, np.floating):
        raise RecipeConfigError("data.data_dir", f"{str(path)!r}: expected a float32/float16 [frames, feature_dim] "
                                                 f"array, got {getattr(array, 'dtype', type(array).__name__)}")
    return array


def check_shape(path: Path, array: np.ndarray, feature_dim: int) -> np.ndarray:
    """``array`` if it is ``[frames >= 1, feature_dim]``; an error naming ``data.data_dir`` and the file otherwise."""
    if array.ndim != 2 or array.shape[0] < 1 or array.shape[1] != feature_dim:
        raise RecipeConfigError("data.data_dir", f"{str(path)!r}: expected a [frames >= 1, {feature_dim}] feature "
                                                 f"array (as the first file of train.csv), got shape {array.shape}")
    return array


class FeatureFiles(Dataset):
    """Per-video ``.npy`` feature files listed in a ``video,label`` CSV (module docstring)."""

    def __init__(self, root: Path, rows: list[tuple[str, int]], feature_dim: int, max_frames: int) -> None:
        self.root, self.rows, self.feature_dim, self.max_frames = root, rows, feature_dim, max_frames

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        name, label = self.rows[index]
        path = self.root / name
        array = check_shape(path, load_features(path), self.feature_dim)
        if array.shape[0] > self.max_frames:
            keep = np.linspace(0, array.shape[0] - 1, self.max_frames).round().astype(np.int64)
            array = array[keep]
        return torch.from_numpy(np.asarray(array, dtype=np.float32).copy()), label


class VideoFeaturesDataModule(RecipeDataModule):
    """UCF101-style per-frame features (``data_dir``, see the module docstring) or built-in action sequences.

    Args:
        max_frames: longest sequence fed to the model (real: longer ones are subsampled;
            built-in: the longest generated).
        min_frames: built-in: the shortest sequence.
        feature_dim: built-in: features per frame (real: read from the files).
        synthetic_classes, signal: built-in data's classes and action strength.
        (the other options, the built-in data set sizes and seed among them: see ``RecipeDataModule``)
    """

    data_dir_hint = "it must hold train.csv and val.csv ('video,label' rows naming .npy feature files)"
    collate_fn = staticmethod(pad_sequences)

    def __init__(self, *, max_frames: int = 64, min_frames: int = 8, feature_dim: int = 64,
                 synthetic_classes: int = 10, synthetic_train_samples: int = 8_000, signal: float = 0.6,
                 **kwargs: Any) -> None:
        super().__init__(synthetic_train_samples=synthetic_train_samples, **kwargs)
        self.min_frames, self.max_frames = self._lengths("min_frames", min_frames, "max_frames", max_frames)
        self.synthetic_classes = check_int(synthetic_classes, "data.synthetic_classes", minimum=2)
        self.signal = check_float(signal, "data.signal", minimum=0.0)
        self._feature_dim = check_int(feature_dim, "data.feature_dim", minimum=1)
        self._rows: dict[str, list[tuple[str, int]]] = {}
        if self.data_dir is not None:
            for split in ("train", "val"):
                self._rows[split] = read_label_csv(require_file(self.data_dir / f"{split}.csv", "data.data_dir",
                                                                f"the {split} label file"))
            first = self.data_dir / self._rows["train"][0][0]
            require_file(first, "data.data_dir", "a feature file named in train.csv")
            array = load_features(first)
            if array.ndim != 2 or array.shape[0] < 1 or array.shape[1] < 1:
                raise RecipeConfigError("data.data_dir", f"{str(first)!r}: expected a [frames >= 1, feature_dim] "
                                                         f"array, got shape {array.shape}")
            self._feature_dim = int(array.shape[1])

    @property
    def num_classes(self) -> int:
        """Classes (linked to ``model.num_classes``): built-in ``synthetic_classes``, real the largest label + 1."""
        if self.builtin:
            return self.synthetic_classes
        return 1 + max(label for rows in self._rows.values() for _, label in rows)

    @property
    def feature_dim(self) -> int:
        """Features per frame (linked to ``model.feature_dim``)."""
        return self._feature_dim

    def _build(self) -> tuple[Dataset, Dataset]:
        if self.data_dir is None:
            common = dict(num_classes=self.synthetic_classes, feature_dim=self._feature_dim,
                          min_frames=self.min_frames, max_frames=self.max_frames, signal=self.signal, seed=self.seed)
            return (ActionSequences(self.synthetic_train_samples, split=0, **common),
                    ActionSequences(self.synthetic_val_samples, split=1, **common))
        for split, rows in self._rows.items():
            missing = [name for name, _ in rows if not (self.data_dir / name).is_file()]
            if missing:
                raise RecipeConfigError("data.data_dir", f"{len(missing)} feature file(s) listed in {split}.csv "
                                                         f"do not exist, e.g. {str(self.data_dir / missing[0])!r}")
            for name, _ in rows:
                # The header only (memory-mapped): a broken file ends every rank here, before the first batch,
                # not the one rank that reads it mid-epoch (whose peers would then see a failed collective).
                check_shape(self.data_dir / name, load_features(self.data_dir / name), self._feature_dim)
        return (FeatureFiles(self.data_dir, self._rows["train"], self._feature_dim, self.max_frames),
                FeatureFiles(self.data_dir, self._rows["val"], self._feature_dim, self.max_frames))
