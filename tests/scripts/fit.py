"""A small fit on N CPU processes, launched for real by Lightning (tests run this file).

Each rank writes its final parameters to ``<out>/rank<R>.pt``. ``--straggle-ms``
makes one rank per step, drawn with a shared seed, sleep before its forward
pass (the paper's imbalance protocol, inlined until the LoadImbalance callback lands).
"""

from __future__ import annotations

import argparse
import os
import random
import time
from pathlib import Path

import lightning as L
from lightning.pytorch.utilities.exceptions import SIGTERMException
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning_partial  # noqa: F401 - registers the strategies


class Regressor(L.LightningModule):
    def __init__(self, straggle_ms: float, world: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.straggle_ms = straggle_ms
        self.chooser = random.Random(7)  # same seed on every rank: every rank draws the same straggler
        self.world = world
        self.pid_dir: Path | None = None

    def training_step(self, batch, batch_idx):
        straggler = self.chooser.randrange(self.world)
        if self.straggle_ms and straggler == self.global_rank:
            time.sleep(self.straggle_ms / 1000)  # injected straggler delay
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def on_train_start(self) -> None:
        if self.pid_dir is not None:  # lets a test signal a given rank
            self.pid_dir.mkdir(parents=True, exist_ok=True)
            (self.pid_dir / f"rank{self.global_rank}.pid").write_text(str(os.getpid()))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="eager_sgd", help="a registered name, or 'eager_sgd:<mode>'")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--straggle-ms", type=float, default=0.0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    L.seed_everything(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(2048, 1, generator=g)
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
    model = Regressor(args.straggle_ms, args.devices)
    model.pid_dir = args.out / "pids"
    strategy = args.strategy
    if strategy.startswith("eager_sgd:"):  # a configured instance rather than a registry name
        strategy = lightning_partial.EagerSGDStrategy(mode=strategy.split(":", 1)[1])
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=args.devices,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        trainer.fit(model, loader)
    except SIGTERMException:
        # Every rank is expected here at the same step: the test compares the markers.
        (args.out / f"stopped{trainer.global_rank}").write_text(str(trainer.global_step))
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, args.out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
