"""ResNet-18 on CIFAR-10, the ABS-SGD workload (Zhou, Chen, Wu, arXiv:2308.15164).

Usage, from the repository root (defaults: ``conf/cifar_resnet18.yaml``)::

    python recipes/cifar_resnet18.py fit                                   # built-in data, 4 CPU processes
    python recipes/cifar_resnet18.py fit --trainer.strategy ddp  # eager_sgd_majority, wagma_sgd, ds_sync, abs_sgd, ...
    python recipes/cifar_resnet18.py fit --config my.yaml --imbalance.delay_ms 100
    python recipes/cifar_resnet18.py fit --print_config                    # every option and its value

Adaptive micro-batches: --trainer.callbacks+=lightning_partial.callbacks.AdaptiveBatchSize (abs_sgd only).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository root, not recipes/, goes on sys.path
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from recipes.catalog import RECIPES  # noqa: E402

RECIPE = RECIPES["cifar_resnet18"]

if __name__ == "__main__":
    RECIPE.run()
