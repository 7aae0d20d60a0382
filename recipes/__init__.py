"""Recipes: the papers' reference workloads as LightningCLI programs over ``lightning_partial``'s strategies.

Each recipe (``python -m recipes.<name>``) trains one workload and reads its
default configuration from ``conf/<name>.yaml``; the strategy is chosen with
``--trainer.strategy eager_sgd|eager_sgd_majority|wagma_sgd|ds_sync|abs_sgd|ddp``.
Without ``--data.data_dir`` every recipe trains on built-in data that needs no
download. ``python -m recipes.main_job`` compares the strategies on one recipe.

This package is not installed: run it from the repository root
(``python -m recipes.cifar_resnet fit``).
"""
