"""WideResNet (WRN-28-10) on CIFAR-10/100, the DS-Sync workload (Wang et al., arXiv:2007.03298).

Usage, from the repository root (defaults: ``conf/cifar_wideresnet.yaml``)::

    python -m recipes.cifar_wideresnet fit                                   # built-in data, 4 CPU processes
    python -m recipes.cifar_wideresnet fit --trainer.strategy ddp  # eager_sgd_majority, wagma_sgd, ds_sync, abs_sgd, ...
    python -m recipes.cifar_wideresnet fit --config my.yaml --imbalance.delay_ms 100
    python -m recipes.cifar_wideresnet fit --print_config                    # every option and its value

CIFAR-100: --data.dataset cifar100. Real data: --data.data_dir <dir with the CIFAR python batches>.
"""

from __future__ import annotations

from recipes.catalog import RECIPES

RECIPE = RECIPES["cifar_wideresnet"]

if __name__ == "__main__":
    RECIPE.run()
