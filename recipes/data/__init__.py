"""The recipes' data modules: real-format loaders and built-in (learnable, download-free) data."""

from recipes.data.base import RecipeDataModule
from recipes.data.images import CIFARDataModule, ClassImages, ImageFolderDataModule, read_cifar
from recipes.data.text import MappedTokens, ParallelTextDataModule, Vocab
from recipes.data.video import ActionSequences, VideoFeaturesDataModule

__all__ = [
    "ActionSequences",
    "CIFARDataModule",
    "ClassImages",
    "ImageFolderDataModule",
    "MappedTokens",
    "ParallelTextDataModule",
    "RecipeDataModule",
    "VideoFeaturesDataModule",
    "Vocab",
    "read_cifar",
]
