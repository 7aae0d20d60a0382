"""LSTM over per-frame features of variable-length videos, UCF101-style (eager-SGD).

Usage, from the repository root (defaults: ``conf/ucf101_lstm.yaml``)::

    python recipes/ucf101_lstm.py fit                                   # built-in data, 4 CPU processes
    python recipes/ucf101_lstm.py fit --trainer.strategy ddp  # eager_sgd_majority, wagma_sgd, ds_sync, abs_sgd, ...
    python recipes/ucf101_lstm.py fit --config my.yaml --imbalance.delay_ms 100
    python recipes/ucf101_lstm.py fit --print_config                    # every option and its value

Real data: --data.data_dir <dir with train.csv, val.csv and .npy feature files> (format: recipes/data/video.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository root, not recipes/, goes on sys.path
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from recipes.catalog import RECIPES  # noqa: E402

RECIPE = RECIPES["ucf101_lstm"]

if __name__ == "__main__":
    RECIPE.run()
