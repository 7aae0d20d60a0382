"""ResNet-20/32 on CIFAR-10, the eager-SGD workload (Li et al., PPoPP 2020).

Usage, from the repository root (defaults: ``conf/cifar_resnet.yaml``)::

    python recipes/cifar_resnet.py fit                                   # built-in data, 4 CPU processes
    python recipes/cifar_resnet.py fit --trainer.strategy ddp  # eager_sgd_majority, wagma_sgd, ds_sync, abs_sgd, ...
    python recipes/cifar_resnet.py fit --config my.yaml --imbalance.delay_ms 100
    python recipes/cifar_resnet.py fit --print_config                    # every option and its value

ResNet-32: --model.depth 32. Real data: --data.data_dir <dir with cifar-10-batches-py>.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository root, not recipes/, goes on sys.path
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from recipes.catalog import RECIPES  # noqa: E402

RECIPE = RECIPES["cifar_resnet"]

if __name__ == "__main__":
    RECIPE.run()
