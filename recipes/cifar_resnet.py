"""ResNet-20/32 on CIFAR-10, the eager-SGD workload (Li et al., PPoPP 2020).

Usage, from the repository root (defaults: ``conf/cifar_resnet.yaml``)::

    python -m recipes.cifar_resnet fit                                   # built-in data, 4 CPU processes
    python -m recipes.cifar_resnet fit --trainer.strategy ddp  # eager_sgd_majority, wagma_sgd, ds_sync, abs_sgd, ...
    python -m recipes.cifar_resnet fit --config my.yaml --imbalance.delay_ms 100
    python -m recipes.cifar_resnet fit --print_config                    # every option and its value

ResNet-32: --model.depth 32. Real data: --data.data_dir <dir with cifar-10-batches-py>.
"""

from __future__ import annotations

from recipes.catalog import RECIPES

RECIPE = RECIPES["cifar_resnet"]

if __name__ == "__main__":
    RECIPE.run()
