"""ResNet-18 on CIFAR-10, the ABS-SGD workload (Zhou, Chen, Wu, arXiv:2308.15164).

Usage, from the repository root (defaults: ``conf/cifar_resnet18.yaml``)::

    python -m recipes.cifar_resnet18 fit                                   # built-in data, 4 CPU processes
    python -m recipes.cifar_resnet18 fit --trainer.strategy ddp  # eager_sgd_majority, wagma_sgd, ds_sync, abs_sgd, ...
    python -m recipes.cifar_resnet18 fit --config my.yaml --imbalance.delay_ms 100
    python -m recipes.cifar_resnet18 fit --print_config                    # every option and its value

Adaptive micro-batches: --trainer.callbacks+=lightning_partial.callbacks.AdaptiveBatchSize (abs_sgd only).
"""

from __future__ import annotations

from recipes.catalog import RECIPES

RECIPE = RECIPES["cifar_resnet18"]

if __name__ == "__main__":
    RECIPE.run()
