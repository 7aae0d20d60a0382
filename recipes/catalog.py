"""The recipes: which model, which data module, which links, and the strategies of their papers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from recipes.common import RecipeCLI, main
from recipes.data import CIFARDataModule, ImageFolderDataModule, ParallelTextDataModule, VideoFeaturesDataModule
from recipes.modules import (
    CifarResNet,
    CifarResNet18,
    CifarWideResNet,
    ImageNetClassifier,
    TranslationModel,
    VideoClassifier,
)

_CLASSES = (("num_classes", "num_classes"),)


@dataclass(frozen=True)
class Recipe:
    """One workload: ``recipes/<name>.py`` with ``conf/<name>.yaml``."""

    name: str
    model: type
    data: type
    links: tuple[tuple[str, str], ...]
    paper_strategies: tuple[str, ...]
    description: str

    def run(self, args: Optional[list[str]] = None) -> RecipeCLI:
        """Runs the recipe's CLI with ``args`` (default ``sys.argv[1:]``)."""
        return main(self.model, self.data, recipe=self.name, links=self.links, args=args)


RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe("cifar_resnet", CifarResNet, CIFARDataModule, _CLASSES, ("eager_sgd", "eager_sgd_majority"),
               "ResNet-20/32 on CIFAR-10 (eager-SGD)"),
        Recipe("cifar_resnet18", CifarResNet18, CIFARDataModule, _CLASSES, ("abs_sgd",),
               "ResNet-18 on CIFAR-10 (ABS-SGD)"),
        Recipe("imagenet_resnet50", ImageNetClassifier, ImageFolderDataModule, _CLASSES, ("eager_sgd", "wagma_sgd"),
               "ResNet-50 on ImageNet via ImageFolder (eager-SGD, WAGMA-SGD)"),
        Recipe("ucf101_lstm", VideoClassifier, VideoFeaturesDataModule,
               (("num_classes", "num_classes"), ("feature_dim", "feature_dim")), ("eager_sgd",),
               "LSTM over per-frame video features, UCF101-style (eager-SGD)"),
        Recipe("translation_transformer", TranslationModel, ParallelTextDataModule,
               (("src_vocab_size", "src_vocab_size"), ("tgt_vocab_size", "tgt_vocab_size"),
                ("max_positions", "max_positions")), ("wagma_sgd",),
               "Transformer encoder-decoder for translation (WAGMA-SGD)"),
        Recipe("cifar_wideresnet", CifarWideResNet, CIFARDataModule, _CLASSES, ("ds_sync",),
               "WideResNet on CIFAR (DS-Sync)"),
    )
}
