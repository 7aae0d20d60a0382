"""Transformer encoder-decoder for translation, the WAGMA-SGD workload (WMT17 En-De in the paper).

Usage, from the repository root (defaults: ``conf/translation_transformer.yaml``)::

    python recipes/translation_transformer.py fit                                   # built-in data, 4 CPU processes
    python recipes/translation_transformer.py fit --trainer.strategy ddp  # eager_sgd_majority, wagma_sgd, ds_sync, abs_sgd, ...
    python recipes/translation_transformer.py fit --config my.yaml --imbalance.delay_ms 100
    python recipes/translation_transformer.py fit --print_config                    # every option and its value

Real data: --data.data_dir <dir with train.en/train.de/valid.en/valid.de> (format: recipes/data/text.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository root, not recipes/, goes on sys.path
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from recipes.catalog import RECIPES  # noqa: E402

RECIPE = RECIPES["translation_transformer"]

if __name__ == "__main__":
    RECIPE.run()
