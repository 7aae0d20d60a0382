"""Transformer encoder-decoder for translation, the WAGMA-SGD workload (WMT17 En-De in the paper).

Usage, from the repository root (defaults: ``conf/translation_transformer.yaml``)::

    python -m recipes.translation_transformer fit                                   # built-in data, 4 CPU processes
    python -m recipes.translation_transformer fit --trainer.strategy ddp  # eager_sgd_majority, wagma_sgd, ds_sync, abs_sgd, ...
    python -m recipes.translation_transformer fit --config my.yaml --imbalance.delay_ms 100
    python -m recipes.translation_transformer fit --print_config                    # every option and its value

Real data: --data.data_dir <dir with train.en/train.de/valid.en/valid.de> (format: recipes/data/text.py).
"""

from __future__ import annotations

from recipes.catalog import RECIPES

RECIPE = RECIPES["translation_transformer"]

if __name__ == "__main__":
    RECIPE.run()
