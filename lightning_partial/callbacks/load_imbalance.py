"""LoadImbalance: reproducible straggler injection for experiments.

Contract:

* **Stragglers** (``delay_ms > 0``, the protocol of the eager-SGD paper): at
  every training batch, in ``on_train_batch_start`` (before the forward pass),
  ``stragglers`` ranks sleep ``delay_ms``. With ``straggle_at="backward"`` the
  sleep comes in ``on_before_backward`` instead (the batch's first backward):
  it is part of the batch's compute, so a batch whose compute a strategy skips
  (eager-SGD's ``catch_up``) does not straggle; every strategy still meets the
  sleep before its step's synchronisation. Which ranks is a pure function of
  ``(seed, counter)`` (:func:`draw_stragglers`), where ``counter`` is
  ``trainer.fit_loop.total_batch_idx``: the index of the batch across epochs,
  identical on every rank and restored by a checkpoint resume. Every rank
  therefore computes the same set without communicating, and a resumed fit
  draws what the uninterrupted fit would have drawn.
* **Persistent slowdown** (``speed``, one factor per rank): a rank with factor
  ``f`` sleeps ``(1/f - 1)`` times the compute it measured since the batch
  started (after any straggler sleep) or since its previous backward, in
  ``on_after_backward``. On CPU the compute is the training thread's CPU
  time (``time.thread_time``), not the wall time: a backward that waits for a
  collective (DDP's gradient allreduce ends inside backward) would otherwise
  count the wait for the slower ranks as compute, the next sleep would be
  longer, the others would wait longer still, and the sleeps would grow
  without bound (seen: a 4-rank DDP fit at speeds 1, 1, 0.5, 0.25 stalled
  after about 20 steps). Not the process's CPU time either: that counts a
  communication thread's work (our engines'), which is not the rank's compute.
  With ``torch.get_num_threads() > 1`` the intra-op threads' share is not
  counted (a warning says so): run one thread per process, as usual for
  several ranks per host. That hook runs inside the optimizer closure, before
  the strategy synchronises gradients, and after every backward (each
  accumulated micro-batch, each ``manual_backward``), so the rank arrives at
  the synchronisation as late as a device ``1/f`` times slower would.
* No collective, ever: nothing is reduced or broadcast, and the logged value
  (``imbalance/delay_ms``, this rank's injected sleep on the batch) uses
  ``sync_dist=False``. Ranks must not synchronise per step because of this
  callback, or it would hide the very imbalance it injects.
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_partial import _compat
from lightning_partial.collectives.checks import check_int, is_finite_number

log = logging.getLogger(__name__)


def draw_stragglers(seed: int, counter: int, world_size: int, stragglers: int) -> list[int]:
    """The ranks that straggle at batch ``counter``: ``stragglers`` distinct ranks in ``0..world_size-1``.

    Depends only on its arguments (not on earlier draws, not on the process's
    hash seed), so every rank, a resumed fit and an offline analysis agree.
    """
    if not 1 <= stragglers <= world_size:
        raise ValueError(f"stragglers must be in 1..world_size ({world_size}), got {stragglers}")
    # A string seed is hashed with SHA-512 by `random`, identically in every process.
    return sorted(random.Random(f"{seed}:{counter}").sample(range(world_size), stragglers))


@dataclass(frozen=True)
class ImbalanceRecord:
    """What this rank injected on one training batch.

    Attributes:
        counter: the batch counter the draw used (``trainer.fit_loop.total_batch_idx``).
        stragglers: the ranks drawn for this batch (empty without ``delay_ms``).
        delay_ms: this rank's straggler sleep (``delay_ms`` if drawn, else 0).
        slowdown_ms: this rank's ``speed`` sleeps on this batch (every backward).
    """

    counter: int
    stragglers: tuple[int, ...]
    delay_ms: float
    slowdown_ms: float

    @property
    def total_ms(self) -> float:
        """Everything this rank slept on this batch."""
        return self.delay_ms + self.slowdown_ms


#: When a drawn straggler sleeps (``LoadImbalance(straggle_at=...)``).
STRAGGLE_AT: tuple[str, ...] = ("batch_start", "backward")


class LoadImbalance(Callback):
    """Injects reproducible stragglers and/or persistent per-rank slowdowns into training.

    Args:
        delay_ms: straggler sleep in milliseconds (0: no stragglers).
        stragglers: how many ranks straggle per batch (``1..world_size``; needed
            only with ``delay_ms > 0``).
        speed: one factor per rank in ``(0, 1]`` (1: full speed); a rank with
            factor ``f`` takes ``1/f`` times its measured forward + backward.
            Its length must equal the world size (checked at set-up).
        seed: seed of the straggler draw (identical on every rank).
        log: log ``imbalance/delay_ms`` per step through ``pl_module.log`` (at the
            batches whose step metrics Lightning writes: ``log_every_n_steps``).
        history: how many per-batch :class:`ImbalanceRecord` to keep in
            :attr:`records` (the oldest are dropped; totals count everything).
        straggle_at: when a drawn rank sleeps: ``"batch_start"`` (default, the
            paper's: before the forward pass, whatever the step does) or
            ``"backward"`` (before the batch's first backward: only batches that
            are computed straggle).

    Attributes:
        records: the latest ``history`` batches' records, oldest first.
        injected_ms: everything this rank slept, in milliseconds.
        last_delay_ms: what this rank slept on the latest batch.
        batches: how many training batches the callback saw.

    On CUDA, a slowed rank (factor < 1) synchronises its device before each
    measurement, so that the measured time is the device's compute rather than
    the host's kernel launches: a host sync on that rank only, never a collective.
    That measurement is wall time: under a strategy whose backward waits for a
    collective on the compute stream (DDP), it includes the wait; use
    ``delay_ms`` or the CPU for persistent heterogeneity with such strategies.
    """

    def __init__(
        self,
        *,
        delay_ms: float = 0.0,
        stragglers: int = 1,
        speed: Optional[Sequence[float]] = None,
        seed: int = 0,
        log: bool = True,
        history: int = 100_000,
        straggle_at: str = "batch_start",
    ) -> None:
        super().__init__()
        if straggle_at not in STRAGGLE_AT:
            raise ValueError(
                f"LoadImbalance: straggle_at must be one of {', '.join(map(repr, STRAGGLE_AT))}, got {straggle_at!r}"
            )
        self.straggle_at = straggle_at
        if not is_finite_number(delay_ms):
            raise ValueError(f"LoadImbalance: delay_ms must be a finite number of milliseconds, got {delay_ms!r}")
        if delay_ms < 0:
            raise ValueError(f"LoadImbalance: delay_ms must be >= 0, got {delay_ms!r}")
        check_int("stragglers", stragglers, minimum=0, owner="LoadImbalance")
        if delay_ms > 0 and stragglers < 1:
            raise ValueError(f"LoadImbalance: stragglers must be >= 1 when delay_ms > 0, got {stragglers}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"LoadImbalance: seed must be an int, got {seed!r}")
        if not isinstance(log, bool):
            raise ValueError(f"LoadImbalance: log must be a bool, got {log!r}")
        check_int("history", history, minimum=0, owner="LoadImbalance")
        factors: Optional[tuple[float, ...]] = None
        if speed is not None:
            try:
                listed = [] if isinstance(speed, (str, bytes)) else list(speed)
            except TypeError:
                listed = []
            if not listed:
                raise ValueError(f"LoadImbalance: speed must be a non-empty sequence of factors, got {speed!r}")
            for i, f in enumerate(listed):
                ok = is_finite_number(f) and 0 < f <= 1
                if not ok:
                    raise ValueError(f"LoadImbalance: speed[{i}] must be in (0, 1] (1 = full speed), got {f!r}")
            factors = tuple(float(f) for f in listed)
        self.delay_ms = float(delay_ms)
        self.stragglers = stragglers
        self.speed = factors
        self.seed = seed
        # Not ``self.log``: Lightning sets every callback's ``log`` to the module's at fit start.
        self._log = log
        self.records: deque[ImbalanceRecord] = deque(maxlen=history)
        self.injected_ms = 0.0
        self.last_delay_ms = 0.0
        self.batches = 0
        # Per-batch state of this rank.
        self._factor = 1.0
        self._sync_cuda = False
        self._mark: Optional[float] = None  # start of the compute not yet scaled by `speed`
        self._counter = 0
        self._drawn: tuple[int, ...] = ()
        self._batch_delay_ms = 0.0
        self._batch_slowdown_ms = 0.0
        self._straggle_pending = False  # drawn on this batch, sleeping at its first backward (straggle_at)

    def stragglers_for(self, counter: int, world_size: int) -> list[int]:
        """The ranks this callback delays at batch ``counter`` in a ``world_size``-rank fit (sorted).

        Empty when ``delay_ms`` is 0. The same on every rank: see :func:`draw_stragglers`.
        """
        if self.delay_ms <= 0:
            return []
        return draw_stragglers(self.seed, counter, world_size, self.stragglers)

    # ---------------------------------------------------------------- hooks
    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        """Checks the options that need the world size; fails before any batch runs."""
        world = trainer.world_size
        if self.delay_ms > 0 and self.stragglers > world:
            raise ValueError(f"LoadImbalance: stragglers ({self.stragglers}) must be <= the world size ({world})")
        if self.speed is not None and len(self.speed) != world:
            raise ValueError(
                f"LoadImbalance: speed needs one factor per rank: got {len(self.speed)} for a world size of {world}"
            )
        self._factor = self.speed[trainer.global_rank] if self.speed is not None else 1.0
        self._sync_cuda = self._factor < 1.0 and pl_module.device.type == "cuda"
        if self._factor < 1.0 and not self._sync_cuda and torch.get_num_threads() > 1:
            log.warning(
                "LoadImbalance: rank %d measures its compute as this thread's CPU time, but torch runs %d "
                "intra-op threads whose share is not counted: the slowdown is smaller than speed=%g asks "
                "(set OMP_NUM_THREADS=1 or torch.set_num_threads(1))",
                trainer.global_rank, torch.get_num_threads(), self._factor,
            )

    @override
    def on_train_batch_start(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int
    ) -> None:
        # total_batch_idx already counts this batch here (the loop marks it ready
        # before this hook), and a resume restores it: identical on all ranks.
        self._counter = trainer.fit_loop.total_batch_idx
        self._drawn = tuple(self.stragglers_for(self._counter, trainer.world_size))
        self._batch_delay_ms = 0.0
        self._batch_slowdown_ms = 0.0
        self._straggle_pending = trainer.global_rank in self._drawn
        if self._straggle_pending and self.straggle_at == "batch_start":
            self._straggle_pending = False
            self._batch_delay_ms = self._sleep_ms(self.delay_ms)
        if self._factor < 1.0:
            # Starts after the straggler sleep: only compute is scaled.
            self._mark = self._now(pl_module)

    @override
    def on_before_backward(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", loss: Any) -> None:
        if not self._straggle_pending:
            return
        self._straggle_pending = False  # once per batch, at its first backward
        started = self._now(pl_module) if self._mark is not None else None
        self._batch_delay_ms = self._sleep_ms(self.delay_ms)
        if started is not None and self._mark is not None:
            self._mark += self._now(pl_module) - started  # the sleep is not compute: `speed` does not scale it

    @override
    def on_after_backward(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self._factor >= 1.0 or self._mark is None:
            return
        compute = self._now(pl_module) - self._mark
        self._batch_slowdown_ms += self._sleep_ms((1.0 / self._factor - 1.0) * compute * 1e3)
        # The next backward of this batch (accumulation, manual) scales only its own compute.
        self._mark = self._now(pl_module)

    @override
    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        record = ImbalanceRecord(
            counter=self._counter,
            stragglers=self._drawn,
            delay_ms=self._batch_delay_ms,
            slowdown_ms=self._batch_slowdown_ms,
        )
        self.records.append(record)
        self.batches += 1
        self.last_delay_ms = record.total_ms
        self.injected_ms += record.total_ms
        self._mark = None
        if self._log and _compat.logs_this_step(trainer):
            # Per rank, per step: reducing it would be a collective on every step. Only where a logger
            # will see it: a call costs 0.6-0.9 ms of CPU, which the step would pay.
            pl_module.log(
                "imbalance/delay_ms", record.total_ms, on_step=True, on_epoch=False, sync_dist=False, batch_size=1
            )

    # -------------------------------------------------------------- helpers
    def _now(self, pl_module: "pl.LightningModule") -> float:
        if self._sync_cuda:
            torch.cuda.synchronize(pl_module.device)  # measure the device's compute, not the launches
            return time.perf_counter()
        # CPU time of this (the training) thread: blocked waits for communication
        # do not count, nor do the sleeps, nor a communication thread's work.
        return time.thread_time()

    @staticmethod
    def _sleep_ms(ms: float) -> float:
        """Sleeps ``ms`` milliseconds (if positive); returns what was requested, the injected amount."""
        if ms <= 0:
            return 0.0
        time.sleep(ms / 1e3)  # the injected imbalance itself
        return ms
