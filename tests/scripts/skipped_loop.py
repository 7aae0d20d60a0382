"""A checkpoint saved mid-fit, then a fit from it with ``limit_train_batches=0``: Lightning's loop skips every hook
with training not done. The strategy must not end that fit at teardown (as it ends one whose training was done):
the fit returns, weights as loaded. Prints one ``RECORD`` JSON line per rank (after the second fit).
``--strategy``: a registered name; ``--out``: a directory for the checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning_partial  # noqa: F401 - registers the strategies
from tests.scripts.two_fits import Tiny


class SaveAt(L.Callback):
    """Saves at the end of the first epoch: mid-fit (the fit has two), at a point every rank reaches at the same
    round (abs_sgd's ranks reach a global step in batches of their own: a save per batch cannot pair)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch == 0:
            trainer.save_checkpoint(self.path)  # every rank calls it, as Lightning requires


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="abs_sgd")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    x = torch.randn(256, 4, generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
    options = dict(strategy=args.strategy, accelerator="cpu", devices=2, max_epochs=2, logger=False,
                   enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    mid = args.out / "mid.ckpt"
    L.Trainer(callbacks=[SaveAt(mid)], **options).fit(Tiny(), loader)
    model = Tiny()
    trainer = L.Trainer(limit_train_batches=0, **options)
    trainer.fit(model, loader, ckpt_path=mid)
    saved = torch.load(mid, weights_only=False)["state_dict"]
    record = {"rank": trainer.global_rank,
              "as_loaded": all(torch.equal(v, saved[f"net.{k}"]) for k, v in model.net.state_dict().items())}
    sys.stdout.write("RECORD " + json.dumps(record) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
