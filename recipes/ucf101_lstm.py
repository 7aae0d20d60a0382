"""LSTM over per-frame features of variable-length videos, UCF101-style (eager-SGD).

Usage, from the repository root (defaults: ``conf/ucf101_lstm.yaml``)::

    python -m recipes.ucf101_lstm fit                                   # built-in data, 4 CPU processes
    python -m recipes.ucf101_lstm fit --trainer.strategy ddp  # eager_sgd_majority, wagma_sgd, ds_sync, abs_sgd, ...
    python -m recipes.ucf101_lstm fit --config my.yaml --imbalance.delay_ms 100
    python -m recipes.ucf101_lstm fit --print_config                    # every option and its value

Real data: --data.data_dir <dir with train.csv, val.csv and .npy feature files> (format: recipes/data/video.py).
"""

from __future__ import annotations

from recipes.catalog import RECIPES

RECIPE = RECIPES["ucf101_lstm"]

if __name__ == "__main__":
    RECIPE.run()
