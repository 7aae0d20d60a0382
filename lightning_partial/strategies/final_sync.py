"""The synchronous finish: a fit's last rounds wait for every rank, so that it ends on fresh gradients.

A strategy that lets fast ranks go on applies late gradients (``eager_sgd``,
``abs_sgd``) or averages stale models (``wagma_sgd``, ``ds_sync``) at every round. At a
constant learning rate that leaves the final weights further from where DDP's
would settle: the late contributions keep the iterate moving, under momentum
and Adam most of all. ``final_sync=f`` makes the last ``f`` of the fit's
optimizer steps fully synchronous rounds (every rank arrives; the pending late
gradients are applied in the first of them; a model-averaging round is a
global average): the fit ends as DDP's would from where the fast phase left
it. It costs the straggler's wait for those rounds only. ``eager_sgd`` and
``abs_sgd`` keep their weight prediction there (a fresh gradient at the
predicted weights is a look-ahead gradient, as Nesterov's; under AdamW it
measured better than the current weights). The measurement that chose the default
is in ``docs/staleness.md#the-synchronous-finish``.

The rounds are counted against ``trainer.estimated_stepping_batches`` (the
fit's optimizer steps), from each engine's first round by the rounds the fit
still runs (``ConfiguredStrategy._finish_from``), so a resumed fit finishes at
the same rounds; every rank computes the same first synchronous round, the
engine's ``PartialAllreduceConfig.sync_from``. Under a training time limit
(``max_time``) the finish also begins once ``1 - final_sync`` of it has passed,
by rank 0's clock (:mod:`~lightning_partial.strategies.agreed_clock`; the engines'
``request_sync``): whichever of the two comes first, so a fit that the time limit
ends before its steps or epochs still ends on fresh gradients. A fit whose length
Lightning cannot estimate and which has no time limit (an iterable data set
without a length) runs without it, with a warning. ``abs_sgd``'s rounds differ in size, so it
counts its finish in global samples (``max_epochs``) or rounds (``max_steps``);
see :class:`~lightning_partial.strategies.abs_sgd.ABSSGDStrategy`.
"""

from __future__ import annotations

import logging
import math
from typing import Optional

from lightning_partial.collectives.checks import is_finite_number

log = logging.getLogger(__name__)


def check_final_sync(value: object, *, owner: str) -> float:
    """``value`` as a float in ``[0, 1)``; raises ``ValueError`` naming ``final_sync`` otherwise."""
    if not is_finite_number(value) or not 0.0 <= value < 1.0:
        raise ValueError(
            f"{owner}: final_sync must be a fraction of the fit's optimizer steps in [0, 1) (0: off), got {value!r}"
        )
    return float(value)


def first_sync_round(final_sync: float, total_steps: object, *, owner: str, rank: int = 0,
                     unit: str = "optimizer steps", by_time: bool = False) -> Optional[int]:
    """Where the synchronous finish starts in a fit of ``total_steps`` (of ``unit``), or ``None``.

    The last ``ceil(final_sync * total_steps)`` are synchronous (at least one when
    ``final_sync > 0``). ``None`` when it is off, or when ``total_steps`` is not
    a finite count (Lightning's estimate of an unbounded fit), with a warning on rank 0 (an
    info line where a training time limit starts the finish instead: ``by_time``).
    ``abs_sgd`` counts its fit in global samples or in rounds (``unit``).
    """
    if final_sync <= 0.0:
        return None
    if not is_finite_number(total_steps) or total_steps < 1:
        if rank == 0 and by_time:
            log.info("%s: the fit's length in %s is not known (%r): its synchronous finish (final_sync=%s) "
                     "begins by the training time limit", owner, unit, total_steps, final_sync)
        elif rank == 0:
            log.warning("%s: final_sync=%s needs the fit's length in %s, which is %r (set max_steps or "
                        "max_epochs): the fit runs without its synchronous finish",
                        owner, final_sync, unit, total_steps)
        return None
    total = int(total_steps)
    return max(total - math.ceil(final_sync * total), 0)
