"""ResNet-50 on ImageNet through ImageFolder, the eager-SGD and WAGMA-SGD workload.

Usage, from the repository root (defaults: ``conf/imagenet_resnet50.yaml``)::

    python -m recipes.imagenet_resnet50 fit                                   # built-in data, 4 CPU processes
    python -m recipes.imagenet_resnet50 fit --trainer.strategy ddp  # eager_sgd_majority, wagma_sgd, ds_sync, abs_sgd, ...
    python -m recipes.imagenet_resnet50 fit --config my.yaml --imbalance.delay_ms 100
    python -m recipes.imagenet_resnet50 fit --print_config                    # every option and its value

torchvision's model zoo, weights=None (--model.arch picks another model). Real data: --data.data_dir <dir with train/ and val/>.
"""

from __future__ import annotations

from recipes.catalog import RECIPES

RECIPE = RECIPES["imagenet_resnet50"]

if __name__ == "__main__":
    RECIPE.run()
