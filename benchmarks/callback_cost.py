"""What the logging callbacks cost a training step, in CPU, at several ``log_every_n_steps``.

One process, a tiny model, ``--steps`` batches under a stand-in strategy that
publishes one :class:`~lightning_partial.collectives.RoundStats` per optimizer
step (as the partial strategies do), with ``StalenessTracker`` and
``LoadImbalance`` (no delay) logging to a CSV logger. Reported: CPU
milliseconds (``time.thread_time()``) each callback's ``on_train_batch_end``
took per batch. The callbacks call ``LightningModule.log`` only at the batches
whose metrics Lightning writes, so the cost falls with ``log_every_n_steps``;
at 1 it is what every batch paid before they did.

Usage::

    python -m benchmarks.callback_cost      # ~20 s; writes benchmarks/results/callback_cost.json
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import RESULTS, positive_int

log = logging.getLogger("benchmarks.callback_cost")


def _measure(steps: int, every: int, workdir: Path) -> dict[str, float]:
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.strategies import SingleDeviceStrategy
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_partial.callbacks import LoadImbalance, StalenessTracker
    from lightning_partial.collectives import RoundStats

    class Rounds(SingleDeviceStrategy):
        """One new round per optimizer step, with figures that change from round to round."""

        def __init__(self) -> None:
            super().__init__(device=torch.device("cpu"))
            self.round_stats: dict[int, RoundStats] = {}

        def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
            previous = self.round_stats.get(0)
            r = 0 if previous is None else previous.round_index + 1
            self.round_stats[0] = RoundStats(
                round_index=r, activator=0, initiator=None, synchronous=False, flush=False, fresh=(0,), counts=(1,),
                staleness=(r % 3,), oldest_staleness=(r % 3,), progress=(r + 1,), dropped=(0,), contributions=1,
                divisor=1.0, wait_time=0.001 * (r % 5),
            )
            return super().optimizer_step(optimizer, closure, model, **kwargs)

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    callbacks = {"StalenessTracker": StalenessTracker(), "LoadImbalance": LoadImbalance(delay_ms=0.0)}
    spent = dict.fromkeys(callbacks, 0.0)
    for name, callback in callbacks.items():
        hook = callback.on_train_batch_end

        def timed(*args: Any, _hook: Any = hook, _name: str = name, **kwargs: Any) -> None:
            start = time.thread_time()
            _hook(*args, **kwargs)
            spent[_name] += time.thread_time() - start

        callback.on_train_batch_end = timed  # type: ignore[method-assign]
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(steps * 8, 4, generator=g), torch.randn(steps * 8, 1, generator=g))
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=Rounds(), max_steps=steps,
                        callbacks=list(callbacks.values()), logger=CSVLogger(workdir, name=f"every{every}"),
                        log_every_n_steps=every, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(Tiny(), DataLoader(data, batch_size=8))
    return {name: seconds / steps * 1e3 for name, seconds in spent.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=positive_int, default=500)
    parser.add_argument("--every", default="1,4,50", help="comma-separated log_every_n_steps values")
    parser.add_argument("--out", type=Path, default=RESULTS / "callback_cost.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)
    results = {}
    with tempfile.TemporaryDirectory() as workdir:
        for every in (int(v) for v in args.every.split(",")):
            results[str(every)] = _measure(args.steps, every, Path(workdir))
            log.info("log_every_n_steps=%d: %s", every,
                     ", ".join(f"{k} {v:.3f} ms/batch" for k, v in results[str(every)].items()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"steps": args.steps, "torch": torch.__version__,
                                    "ms_per_batch_by_log_every_n_steps": results}, indent=1))
    log.info("wrote %s", args.out)


if __name__ == "__main__":
    main()
