"""WideResNet (WRN-28-10) on CIFAR-10/100, the DS-Sync workload (Wang et al., arXiv:2007.03298).

Usage, from the repository root (defaults: ``conf/cifar_wideresnet.yaml``)::

    python recipes/cifar_wideresnet.py fit                                   # built-in data, 4 CPU processes
    python recipes/cifar_wideresnet.py fit --trainer.strategy ddp  # eager_sgd_majority, wagma_sgd, ds_sync, abs_sgd, ...
    python recipes/cifar_wideresnet.py fit --config my.yaml --imbalance.delay_ms 100
    python recipes/cifar_wideresnet.py fit --print_config                    # every option and its value

CIFAR-100: --data.dataset cifar100. Real data: --data.data_dir <dir with the CIFAR python batches>.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository root, not recipes/, goes on sys.path
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from recipes.catalog import RECIPES  # noqa: E402

RECIPE = RECIPES["cifar_wideresnet"]

if __name__ == "__main__":
    RECIPE.run()
