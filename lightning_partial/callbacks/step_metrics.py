"""Per-step metrics a callback logs only at the batches whose step metrics Lightning writes.

``LightningModule.log`` costs 0.6-0.9 ms of CPU a call, and an ``on_step``
metric logged at a batch Lightning does not write reaches no logger. A callback
therefore :meth:`~PendingStepMetrics.add`\\ s its figures at every batch (each
metric's latest value is kept) and calls :meth:`~PendingStepMetrics.log` in
``on_train_batch_end``: at a written batch (:func:`lightning_partial._compat.logs_this_step`)
the kept values go to ``pl_module.log`` and are forgotten, so loggers receive
what logging at every batch would have given them. The callback
:meth:`~PendingStepMetrics.clear`\\ s them at fit start and at every epoch end,
where Lightning drops an epoch's unwritten step metrics.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl

from lightning_partial import _compat


class PendingStepMetrics:
    """Metric name -> its latest value since the last written batch.

    Args:
        log_options: extra keyword arguments of every ``pl_module.log`` call (besides
            ``on_step=True, on_epoch=False, sync_dist=False``: this rank's own view, since a
            reduction would synchronise every step).
    """

    def __init__(self, **log_options: Any) -> None:
        self._options = {"on_step": True, "on_epoch": False, "sync_dist": False, **log_options}
        self._values: dict[str, float] = {}

    def add(self, metrics: Mapping[str, float]) -> None:
        """Keeps ``metrics``, replacing older values of the same names."""
        self._values.update(metrics)

    def clear(self) -> None:
        """Forgets every kept value."""
        self._values.clear()

    def log(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """``on_train_batch_end``: logs and forgets the kept values if Lightning writes this batch."""
        if self._values and _compat.logs_this_step(trainer):
            for name, value in self._values.items():
                pl_module.log(name, value, **self._options)
            self._values.clear()
