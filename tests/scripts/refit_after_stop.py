"""Two fits of one Trainer: the first stopped by SIGTERM, the second trains (a stop belongs to its own fit).

Rank 1 sends itself SIGTERM in the first fit's batch 3: every rank raises ``SIGTERMException`` at the same step.
The same Trainer then fits one more epoch: Lightning resets its own SIGTERM flag for every run, and so must the
strategy. Prints one ``RECORD`` JSON line per rank: the step each fit ended at, the batches the second trained.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

import lightning as L
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.utils.data import DataLoader, TensorDataset

import lightning_partial  # noqa: F401 - registers the strategies
from tests.scripts.two_fits import Tiny


class Signalled(Tiny):
    """Counts its batches; rank 1 sends itself SIGTERM in batch ``signal_at``."""

    def __init__(self) -> None:
        super().__init__()
        self.signal_at: int | None = 3
        self.batches = 0

    def training_step(self, batch, batch_idx):
        self.batches += 1
        if batch_idx == self.signal_at and self.global_rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return super().training_step(batch, batch_idx)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="eager_sgd")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    x = torch.randn(256, 4, generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
    model = Signalled()
    trainer = L.Trainer(strategy=args.strategy, accelerator="cpu", devices=2, max_epochs=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    record: dict = {}
    try:
        trainer.fit(model, loader)
        record["first"] = None
    except SIGTERMException:
        record["first"] = trainer.global_step
    model.signal_at, model.batches = None, 0
    trainer.fit_loop.max_epochs = 2
    try:
        trainer.fit(model, loader)
        record["second"] = model.batches
    except SIGTERMException:
        record["second"] = f"SIGTERMException after {model.batches} batches"
    record["rank"] = trainer.global_rank
    sys.stdout.write("RECORD " + json.dumps(record) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
