"""Two fits in one process: nothing of the first is left behind (issue: leaks across fits).

For each fit, records the port of the engines' store (rank 0 hosts it) and, after the
fit, the threads still alive and whether that store still accepts connections. Prints
one JSON line per fit. ``--strategy``: a registered name; ``--devices``: ranks.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import sys
import threading

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning_partial  # noqa: F401 - registers the strategies


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class StorePort(L.Callback):
    def __init__(self) -> None:
        self.port = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        store = getattr(trainer.strategy, "_store", None)
        if store is not None and self.port is None:
            self.port = store.port


def accepts(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(2.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="eager_sgd")
    parser.add_argument("--devices", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    x = torch.randn(64, 4)
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
    for fit in range(2):
        probe = StorePort()
        trainer = L.Trainer(strategy=args.strategy, accelerator="cpu", devices=args.devices, max_steps=6,
                            callbacks=[probe], logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(Tiny(), loader)
        gc.collect()
        threads = sorted(t.name for t in threading.enumerate() if t.name.startswith("lightning_partial"))
        record = {"fit": fit, "rank": trainer.global_rank, "port": probe.port, "threads": threads,
                  "store_open": accepts(probe.port) if (probe.port and trainer.global_rank == 0) else None}
        # The trainer (and its strategy) stays referenced, as in a user's notebook.
        globals()[f"trainer{fit}"] = trainer
        # One write per line: the ranks share the parent's stdout pipe, and under PYTHONUNBUFFERED
        # print() issues the text and its newline as two writes, which another rank's line can split.
        sys.stdout.write("RECORD " + json.dumps(record) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
