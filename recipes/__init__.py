"""Recipes: the papers' reference workloads as LightningCLI scripts over ``lightning_partial``'s strategies.

Each script (``recipes/<name>.py``) trains one workload and reads its default
configuration from ``conf/<name>.yaml``; the strategy is chosen with
``--trainer.strategy eager_sgd|eager_sgd_majority|wagma_sgd|ds_sync|abs_sgd|ddp``.
Without ``--data.data_dir`` every recipe trains on built-in data that needs no
download. ``recipes/main_job.py`` compares the strategies on one recipe.

This folder is not an installed package: run the scripts from the repository
root (``python -m recipes.cifar_resnet fit`` or ``python -m recipes.cifar_resnet fit``).
"""
