"""Image classification data: CIFAR-10/100 python batches, ImageFolder (ImageNet), and built-in class images.

**Built-in images** (``data_dir`` unset): each class has a fixed smooth random
pattern (a 4x4 random field per channel, upsampled to the image size); a sample
is its class pattern under a random contrast, a per-channel brightness offset,
a random translation of up to an eighth of the image, plus Gaussian pixel noise
(``noise``). The label is the class whose pattern was drawn, so the task is
learnable, and ``noise`` sets how hard it is. Samples are pure functions of
``(seed, split, index)``: nothing is stored, every rank sees the same data set.

**CIFAR** (``CIFARDataModule``, ``data_dir`` set): the "python version" archives
as published (``cifar-10-python.tar.gz`` / ``cifar-100-python.tar.gz``, extracted):
``data_dir`` is ``cifar-10-batches-py/`` (``data_batch_1`` .. ``data_batch_5``,
``test_batch``) or ``cifar-100-python/`` (``train``, ``test``), or a directory
containing one of them. Each file is a pickled dict with ``b"data"`` (N x 3072
uint8: the red, green and blue 32x32 planes of each image) and ``b"labels"``
(CIFAR-10) or ``b"fine_labels"`` (CIFAR-100). Read here directly (no checksum,
no download).

**ImageFolder** (``ImageFolderDataModule``, ``data_dir`` set): ``data_dir/train/<class>/*``
and ``data_dir/val/<class>/*`` (any format PIL reads), as the ImageNet
training set and the usual re-arranged validation set; classes are the
sub-directory names of ``train/``, sorted.
"""

from __future__ import annotations

import logging
import os
import pickle
from pathlib import Path
from typing import Any, Literal, Optional

import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import Dataset

from recipes.data.base import BuiltinSamples, RecipeDataModule
from recipes.errors import RecipeConfigError, check_float, check_int, require_file

log = logging.getLogger(__name__)

CIFAR_MEAN = {"cifar10": (0.4914, 0.4822, 0.4465), "cifar100": (0.5071, 0.4865, 0.4409)}
CIFAR_STD = {"cifar10": (0.2470, 0.2435, 0.2616), "cifar100": (0.2673, 0.2564, 0.2762)}
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
_CIFAR_LAYOUT = {
    "cifar10": ("cifar-10-batches-py", [f"data_batch_{i}" for i in range(1, 6)], ["test_batch"], b"labels", 10),
    "cifar100": ("cifar-100-python", ["train"], ["test"], b"fine_labels", 100),
}
_ARCHIVES = {"cifar10": "cifar-10-python.tar.gz", "cifar100": "cifar-100-python.tar.gz"}


# ------------------------------------------------------------------------- built-in images
class ClassImages(BuiltinSamples):
    """Built-in images with class structure (see the module docstring); ``(image [C,H,W] float, label)``."""

    def __init__(self, num_samples: int, *, num_classes: int, image_size: int, channels: int = 3,
                 noise: float = 1.0, seed: int = 0, split: int = 0) -> None:
        super().__init__(num_samples, seed, split)
        self.num_classes, self.image_size, self.noise = num_classes, image_size, noise
        g = torch.Generator().manual_seed(seed)  # the task: the same class patterns for every split
        coarse = torch.randn(num_classes, channels, 4, 4, generator=g)
        patterns = F.interpolate(coarse, size=(image_size, image_size), mode="bilinear", align_corners=False)
        self.patterns = patterns / patterns.flatten(1).std(dim=1).view(-1, 1, 1, 1)
        self.shift = max(1, image_size // 8)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        g = self.generator(index)
        label = int(torch.randint(self.num_classes, (1,), generator=g))
        image = self.patterns[label]
        dy, dx = (int(v) for v in torch.randint(-self.shift, self.shift + 1, (2,), generator=g))
        image = torch.roll(image, shifts=(dy, dx), dims=(1, 2))
        contrast = 0.6 + 0.8 * torch.rand(1, generator=g)
        brightness = 0.3 * torch.randn(image.shape[0], 1, 1, generator=g)
        image = contrast * image + brightness + self.noise * torch.randn(image.shape, generator=g)
        return image, label


# ------------------------------------------------------------------------- CIFAR (python batches)
def find_cifar_dir(data_dir: Path, dataset: str) -> Path:
    """The extracted archive's directory: ``data_dir`` itself or its ``cifar-10-batches-py``/``cifar-100-python``."""
    folder, train_files, _, _, _ = _CIFAR_LAYOUT[dataset]
    for candidate in (data_dir, data_dir / folder):
        if (candidate / train_files[0]).is_file():
            return candidate
    raise RecipeConfigError(
        "data.data_dir",
        f"no {dataset} python batches in {str(data_dir)!r}: expected {folder}/{train_files[0]} (the extracted "
        f"{_ARCHIVES[dataset]}) there or {train_files[0]} directly in it (see also --data.dataset)",
    )


def _check_pickle(path: Path) -> None:
    """A cheap look at a CIFAR batch's first bytes (the files are read at set-up): a pickle starts with an opcode."""
    with open(path, "rb") as f:
        head = f.read(2)
    # Protocol 2+ (the published archives, and any pickle.dump since Python 3) starts with PROTO (0x80);
    # protocols 0 and 1 start with a MARK, an empty dict or a GLOBAL.
    if not head or not (head[0] == 0x80 or head[:1] in (b"(", b"}", b"c", b"]")):
        raise RecipeConfigError("data.data_dir", f"{str(path)!r} is not a CIFAR python batch (not a pickle file; "
                                                 f"it starts with {head!r}): expected the files of the extracted "
                                                 "python version archive, not the binary or MATLAB version")


def read_cifar_file(path: Path, label_key: bytes) -> tuple[torch.Tensor, torch.Tensor]:
    """One pickled batch: images ``[N, 3, 32, 32]`` uint8 and labels ``[N]`` int64."""
    try:
        with open(path, "rb") as f:
            entry = pickle.load(f, encoding="bytes")
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, ImportError, IndexError) as err:
        raise RecipeConfigError(
            "data.data_dir", f"{str(path)!r} is not a CIFAR python batch (not a pickle file: "
                             f"{type(err).__name__}: {str(err)[:120]}); expected the files of the extracted python "
                             "version archive") from None
    try:
        data, labels = entry[b"data"], entry[label_key]
    except (KeyError, TypeError) as err:
        raise RecipeConfigError("data.data_dir", f"{str(path)!r} is not a CIFAR python batch (no {err})") from None
    images = torch.as_tensor(data, dtype=torch.uint8)
    if images.ndim != 2 or images.shape[1] != 3 * 32 * 32 or len(images) != len(labels):
        raise RecipeConfigError(
            "data.data_dir", f"{str(path)!r}: expected N x 3072 image rows and N labels, got {tuple(images.shape)} "
                             f"and {len(labels)} labels")
    return images.view(-1, 3, 32, 32), torch.as_tensor(labels, dtype=torch.int64)


def read_cifar(data_dir: Path, dataset: str, split: Literal["train", "test"]) -> tuple[torch.Tensor, torch.Tensor]:
    """All batches of one split of CIFAR-10 or CIFAR-100 from the python-version files."""
    folder, train_files, test_files, label_key, classes = _CIFAR_LAYOUT[dataset]
    root = find_cifar_dir(data_dir, dataset)
    files = train_files if split == "train" else test_files
    parts = []
    for name in files:
        path = require_file(root / name, "data.data_dir", f"{dataset} {split} batch")
        images, labels = read_cifar_file(path, label_key)
        bad = ((labels < 0) | (labels >= classes)).nonzero().flatten()
        if len(bad):  # else the loss fails mid-fit, on the one rank that draws the sample
            raise RecipeConfigError("data.data_dir", f"{str(path)!r}: {len(bad)} label(s) outside 0..{classes - 1} "
                                                     f"for {dataset}, e.g. {int(labels[bad[0]])} at row {int(bad[0])}")
        parts.append((images, labels))
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


class TensorImages(Dataset):
    """uint8 images ``[N, C, H, W]`` with labels; normalised, with CIFAR's crop-and-flip augmentation if asked."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...],
                 augment: bool = False) -> None:
        self.images, self.labels, self.augment = images, labels, augment
        self.mean = torch.tensor(mean).view(-1, 1, 1)
        self.std = torch.tensor(std).view(-1, 1, 1)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = (self.images[index].float() / 255.0 - self.mean) / self.std
        if self.augment:  # pad 4, random 32x32 crop, random horizontal flip
            h, w = image.shape[1:]
            padded = F.pad(image, (4, 4, 4, 4))
            y, x = (int(v) for v in torch.randint(0, 9, (2,)))
            image = padded[:, y : y + h, x : x + w]
            if torch.rand(()) < 0.5:
                image = image.flip(2)
        return image, int(self.labels[index])


# ------------------------------------------------------------------------- data modules
#: What torchvision's ImageFolder reads (``torchvision.datasets.folder.IMG_EXTENSIONS``).
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def _has_image(folder: Path) -> bool:
    """Whether ``folder`` holds a file ImageFolder would read (stops at the first one)."""
    with os.scandir(folder) as entries:
        return any(e.name.lower().endswith(IMAGE_EXTENSIONS) for e in entries if e.is_file())


class ImageDataModule(RecipeDataModule):
    """Base of the image data modules: the built-in images and their options.

    Args:
        image_size: built-in images' side (real CIFAR is 32; ImageFolder crops to it).
        synthetic_classes: built-in data's number of classes.
        noise: built-in images' pixel noise (standard deviation; patterns have unit deviation).
        (the other options, the built-in data set sizes and seed among them: see ``RecipeDataModule``)
    """

    def __init__(self, *, batch_size: int = 128, image_size: int = 32, synthetic_classes: int = 10,
                 synthetic_val_samples: int = 2_000, noise: float = 1.0, **kwargs: Any) -> None:
        super().__init__(batch_size=batch_size, synthetic_val_samples=synthetic_val_samples, **kwargs)
        self.image_size = check_int(image_size, "data.image_size", minimum=8)
        self.synthetic_classes = check_int(synthetic_classes, "data.synthetic_classes", minimum=2)
        self.noise = check_float(noise, "data.noise", minimum=0.0)

    @property
    def num_classes(self) -> int:
        """Classes of the data set (linked to ``model.num_classes`` by the CLI)."""
        return self.synthetic_classes if self.builtin else self._real_num_classes()

    def _real_num_classes(self) -> int:
        raise NotImplementedError

    def _builtin(self) -> tuple[Dataset, Dataset]:
        common: dict[str, Any] = dict(num_classes=self.synthetic_classes, image_size=self.image_size,
                                      noise=self.noise, seed=self.seed)
        return (ClassImages(self.synthetic_train_samples, split=0, **common),
                ClassImages(self.synthetic_val_samples, split=1, **common))


class CIFARDataModule(ImageDataModule):
    """CIFAR-10/100 from the python batches (``data_dir``), or built-in images.

    Args:
        dataset: ``"cifar10"`` or ``"cifar100"`` (real data).
        augment: CIFAR's pad-4 random crop and horizontal flip on the training set (real data).
        (the other options: see ``ImageDataModule``)
    """

    data_dir_hint = "it must hold the extracted CIFAR python batches (cifar-10-batches-py/ or cifar-100-python/)"

    def __init__(self, *, dataset: Literal["cifar10", "cifar100"] = "cifar10", augment: bool = True,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if dataset not in _CIFAR_LAYOUT:
            raise RecipeConfigError("data.dataset", f"must be cifar10 or cifar100, got {dataset!r}")
        self.dataset = dataset
        self.augment = augment
        # Options of the other kind of data: refused where the user asked for something else than what would
        # train (CIFAR-100 without its files), said where a shared configuration sets it (main_job.yaml's
        # image_size, run on the real files).
        if self.data_dir is None and dataset != "cifar10":
            raise RecipeConfigError("data.dataset", f"{dataset!r} selects the real files' layout, and no "
                                                    "data.data_dir is given: the built-in images have "
                                                    f"data.synthetic_classes classes ({self.synthetic_classes}). Give "
                                                    "data.data_dir, or set data.synthetic_classes instead")
        if self.data_dir is not None and self.image_size != 32:
            rank_zero_warn(f"--data.image_size {self.image_size} sizes the built-in images and is not used with "
                           "data.data_dir: CIFAR's images are 32 x 32")
        if self.data_dir is not None:  # fail now, naming the option, rather than in setup
            root = find_cifar_dir(self.data_dir, dataset)
            _, train_files, test_files, _, _ = _CIFAR_LAYOUT[dataset]
            for name in train_files + test_files:
                require_file(root / name, "data.data_dir", f"{dataset} batch {name!r}")
            _check_pickle(root / train_files[0])

    def _real_num_classes(self) -> int:
        return _CIFAR_LAYOUT[self.dataset][4]

    def _build(self) -> tuple[Dataset, Dataset]:
        if self.data_dir is None:
            return self._builtin()
        mean, std = CIFAR_MEAN[self.dataset], CIFAR_STD[self.dataset]
        train = TensorImages(*read_cifar(self.data_dir, self.dataset, "train"), mean, std, augment=self.augment)
        val = TensorImages(*read_cifar(self.data_dir, self.dataset, "test"), mean, std, augment=False)
        return train, val


class ImageFolderDataModule(ImageDataModule):
    """ImageNet-style ``train/<class>/`` and ``val/<class>/`` image folders (``data_dir``), or built-in images.

    Args:
        image_size: the crop side (224 for ImageNet); training: random-resized crop and
            horizontal flip; validation: resize to ``image_size / 0.875`` and centre crop.
        (the other options: see ``ImageDataModule``)
    """

    data_dir_hint = "it must hold train/<class>/ and val/<class>/ image folders"

    def __init__(self, *, batch_size: int = 32, image_size: int = 224, synthetic_val_samples: int = 1_000,
                 **kwargs: Any) -> None:
        super().__init__(batch_size=batch_size, image_size=image_size, synthetic_val_samples=synthetic_val_samples,
                         **kwargs)
        self._classes: Optional[list[str]] = None
        if self.data_dir is not None:
            self._classes = self._class_names()

    def _class_names(self) -> list[str]:
        assert self.data_dir is not None
        names: dict[str, list[str]] = {}
        for split in ("train", "val"):
            folder = self.data_dir / split
            if not folder.is_dir():
                raise RecipeConfigError("data.data_dir", f"no {split}/ folder in {str(self.data_dir)!r}: "
                                                         f"{self.data_dir_hint}")
            names[split] = sorted(p.name for p in folder.iterdir() if p.is_dir())
            if not names[split]:
                raise RecipeConfigError("data.data_dir", f"{str(folder)!r} has no class sub-folder")
            for name in names[split]:
                if not _has_image(folder / name):
                    raise RecipeConfigError(
                        "data.data_dir", f"{str(folder / name)!r} holds no image file (extensions "
                                         f"{', '.join(IMAGE_EXTENSIONS)}): {self.data_dir_hint}")
        if names["train"] != names["val"]:
            missing = sorted(set(names["train"]) ^ set(names["val"]))
            raise RecipeConfigError("data.data_dir", f"train/ and val/ have different classes: {missing[:5]}")
        return names["train"]

    def _real_num_classes(self) -> int:
        assert self._classes is not None
        return len(self._classes)

    def _build(self) -> tuple[Dataset, Dataset]:
        if self.data_dir is None:
            return self._builtin()
        from torchvision import datasets, transforms

        normalize = transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)
        train_tf = transforms.Compose([
            transforms.RandomResizedCrop(self.image_size), transforms.RandomHorizontalFlip(),
            transforms.ToTensor(), normalize,
        ])
        val_tf = transforms.Compose([
            transforms.Resize(round(self.image_size / 0.875)), transforms.CenterCrop(self.image_size),
            transforms.ToTensor(), normalize,
        ])
        train = datasets.ImageFolder(str(self.data_dir / "train"), transform=train_tf)
        val = datasets.ImageFolder(str(self.data_dir / "val"), transform=val_tf)
        if len(train) == 0 or len(val) == 0:
            raise RecipeConfigError("data.data_dir", f"no image in {str(self.data_dir)!r}/train or /val")
        return train, val
