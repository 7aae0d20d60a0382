"""ResNet-50 on ImageNet through ImageFolder, the eager-SGD and WAGMA-SGD workload.

Usage, from the repository root (defaults: ``conf/imagenet_resnet50.yaml``)::

    python recipes/imagenet_resnet50.py fit                                   # built-in data, 4 CPU processes
    python recipes/imagenet_resnet50.py fit --trainer.strategy ddp  # eager_sgd_majority, wagma_sgd, ds_sync, abs_sgd, ...
    python recipes/imagenet_resnet50.py fit --config my.yaml --imbalance.delay_ms 100
    python recipes/imagenet_resnet50.py fit --print_config                    # every option and its value

torchvision's model zoo, weights=None (--model.arch picks another model). Real data: --data.data_dir <dir with train/ and val/>.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository root, not recipes/, goes on sys.path
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from recipes.catalog import RECIPES  # noqa: E402

RECIPE = RECIPES["imagenet_resnet50"]

if __name__ == "__main__":
    RECIPE.run()
