"""FitSummary: per-rank throughput, the loss curve, and the final model's held-out accuracy, without collectives.

Every rank measures its training interval, from its first
``on_train_batch_start`` to ``on_fit_end`` (after the strategy's end of fit:
eager-SGD's final flush, the final model average), so Lightning's start-up is
excluded, and counts its micro-batches and the samples it trained (a batch that
``eager_sgd``'s ``catch_up`` skipped counts as a batch, not as samples:
``skipped_batches``). After the fit, rank 0
evaluates its model (identical on every rank after the strategies' final
round) on the whole validation set, logs ``final/val_acc`` and
``final/val_loss`` to the loggers, and every rank writes
``<out_dir>/rank<R>.json`` when ``out_dir`` is set (read by
``recipes/main_job.py`` and the tests).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.utilities.data import extract_batch_size

log = logging.getLogger(__name__)


def parameter_digest(module: torch.nn.Module) -> float:
    """float64 sum of every parameter: equal on bit-identical replicas, different otherwise (almost surely)."""
    with torch.no_grad():
        return float(sum(p.detach().double().sum().cpu() for p in module.parameters()))


class FitSummary(L.Callback):
    """Records this rank's training figures; evaluates the final model on rank 0 (see the module docstring).

    Args:
        out_dir: where every rank writes ``rank<R>.json``; ``None``: nothing is written.
        evaluate: evaluate rank 0's final model on the validation set after the fit.
        max_eval_batches: evaluate on at most this many validation batches (``None``: all).
    """

    def __init__(self, out_dir: Optional[str] = None, evaluate: bool = True,
                 max_eval_batches: Optional[int] = None) -> None:
        super().__init__()
        if max_eval_batches is not None and (isinstance(max_eval_batches, bool) or max_eval_batches < 1):
            raise ValueError(f"FitSummary: max_eval_batches must be >= 1 or None, got {max_eval_batches!r}")
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.evaluate = evaluate
        self.max_eval_batches = max_eval_batches
        self.t_start: Optional[float] = None
        self.t_end: Optional[float] = None
        self.batches = 0
        self.samples = 0
        self.skipped_batches = 0
        self._skipped_before = 0
        self.losses: list[tuple[float, float]] = []  # (seconds since the first batch, training loss)
        self.result: dict[str, Any] = {}

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self.t_start is None:
            self.t_start = time.perf_counter()
        self._skipped_before = getattr(trainer.strategy, "skipped_steps", 0)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.batches += 1
        if getattr(trainer.strategy, "skipped_steps", 0) != self._skipped_before:
            self.skipped_batches += 1  # catch_up: the batch was not computed, its samples not trained
            return
        self.samples += int(extract_batch_size(batch))
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor) and self.t_start is not None:
            self.losses.append((time.perf_counter() - self.t_start, float(loss.detach())))

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.t_end = time.perf_counter()
        wall = (self.t_end - self.t_start) if self.t_start is not None else 0.0
        strategy = trainer.strategy
        self.result = {
            "rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "strategy": type(strategy).__name__,
            "strategy_name": getattr(strategy, "strategy_name", None),
            "global_step": trainer.global_step,
            "epochs": trainer.current_epoch,
            "batches": self.batches,
            "samples": self.samples,
            "skipped_batches": self.skipped_batches,
            "wall_s": wall,
            "samples_per_s": self.samples / wall if wall > 0 else 0.0,
            "batches_per_s": self.batches / wall if wall > 0 else 0.0,
            "parameter_digest": parameter_digest(pl_module),
            "losses": self.losses,
            "pid": os.getpid(),
        }
        if self.evaluate and trainer.is_global_zero:
            self.result.update(self._evaluate(trainer, pl_module))
            metrics = {"final/val_acc": self.result["val_acc"], "final/val_loss": self.result["val_loss"],
                       "final/samples_per_s_rank0": self.result["samples_per_s"]}
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)
            log.info("final model (rank 0): val_acc %.4f, val_loss %.4f on %d predictions; %.1f samples/s on rank 0",
                     self.result["val_acc"], self.result["val_loss"], self.result["val_count"],
                     self.result["samples_per_s"])
        if self.out_dir is not None:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            path = self.out_dir / f"rank{trainer.global_rank}.json"
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.result))
            tmp.replace(path)  # a reader never sees half a file

    def _evaluate(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        """Rank 0's model on the validation set, on this rank's device, outside Lightning's loops (no collective)."""
        datamodule = trainer.datamodule
        loader = datamodule.val_dataloader() if datamodule is not None else None
        if loader is None or not hasattr(pl_module, "evaluate_batch"):
            return {"val_acc": float("nan"), "val_loss": float("nan"), "val_count": 0}
        device = trainer.strategy.root_device
        was_training, original = pl_module.training, next(pl_module.parameters()).device
        pl_module.to(device).eval()
        loss_sum, correct, count = 0.0, 0, 0
        try:
            for i, batch in enumerate(loader):
                if self.max_eval_batches is not None and i >= self.max_eval_batches:
                    break
                batch = pl_module.transfer_batch_to_device(batch, device, 0)
                batch_loss, batch_correct, batch_count = pl_module.evaluate_batch(batch)
                loss_sum, correct, count = loss_sum + batch_loss, correct + batch_correct, count + batch_count
        finally:
            pl_module.to(original).train(was_training)
        return {"val_acc": correct / max(count, 1), "val_loss": loss_sum / max(count, 1), "val_count": count}
