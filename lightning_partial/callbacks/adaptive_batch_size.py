"""AdaptiveBatchSize: per-rank micro-batch sizes from measured throughput (``strategy="abs_sgd"``).

Under ``abs_sgd`` every rank keeps computing micro-batches, so a slow rank
never idles; but a slow rank's full-size micro-batch spans several rounds, and
its gradient, computed on weights several rounds old, is that stale. This
callback sizes each rank's micro-batch to its speed, so that every rank
completes about one micro-batch per round (**Decision**, the paper's aim:
workers finishing their batches together):

    b_i = min(B_i, max(min_batch_size, round(B_i * s_i / max_j s_j)))

where ``B_i`` is rank ``i``'s loader batch size (the fastest rank keeps it;
the strategy agrees on every rank's when its engines start) and ``s_i``
rank ``i``'s samples per round over the rounds since the last update (its share of
the work; every rank is always busy, so that is its throughput). In
synchronous rounds (``abs_sgd(delay=0)``, and its synchronous finish) every
rank contributes one micro-batch per round whatever its speed, so the shares
would only repeat the sizes: when every round of the window is synchronous,
``s_i`` is rank ``i``'s samples per second of its own work (the header's
``busy`` seconds: from each of its deposits' return to the next, waits in
the round excluded), and the ranks split the strategy's step
(``sync_round_samples``, ``R``: DDP's global batch by default) by speed:

    q_i = R * s_i / sum_j s_j

so that every share takes about as long and a round holds about one step:
its allreduce and its wait for the slowest are paid once per step (one
micro-batch per rank and round, the fastest at ``B``, would make rounds of
``B * sum_j s_j / max_j s_j`` samples: under speeds 1, 1, 0.5, 0.25 and
``R = 4B``, 1.45 rounds per step, each waiting for the slowest). A rank
computes its share as several micro-batches and arrives at the round with
the last (the others are held, ``DelayedAllreduce.deposit(arrive=False)``);
when it arrives is the ``arrival`` rule:

* ``"count"``: every rank deposits ``n = max_j
  ceil(q_j / B_j)`` micro-batches, rank ``i``'s of ``b_i = min(B_i,
  max(min_batch_size, round(q_i / n)))``, and arrives with the last: the same count on every
  rank, so the ranks run their batches in lock-step and a per-batch
  collective pairs the same batches (with a count per rank, a rank holding
  a micro-batch would wait in it for a rank waiting in the round, until the
  timeout). What the shared count costs: the rank with the largest share
  relative to its loader batch sets ``n`` (loaders of 64, 64, 8 and 8 at
  equal speeds make ``n = 5``: the 64-sample loaders run five micro-batches
  of about 7); and a per-batch collective's wait for the slowest rank counts
  as work in ``busy`` for the held micro-batches, which slows the adaptation
  (the sizes still settle where the shares balance).
* ``"samples"`` (default, **Decision**: the arrivals about a micro-batch
  apart, where by count they spread by a whole share's noise, and DDP's
  accuracy, where by time the rounds' samples vary; measured in
  docs/staleness.md#arriving-by-samples): the round closes on its samples. Each rank's share is cut
  into micro-batches as under ``"time"`` (below), and each rank counts every
  micro-batch's samples into the round in the engine's store
  (``DelayedAllreduce.count_round_samples``: the count over every rank so
  far) and arrives with the micro-batch that brings the round nearest to
  ``R`` (``abs_sgd``'s ``closes_round``: count ``+`` the other ranks'
  micro-batch sizes, which they are computing, ``+`` half its own ``>= R``;
  the strategy's ``round_fill`` holds every rank's sizes). With the sizes
  fixed every round holds ``R`` to within half the largest micro-batch
  (but each epoch's last, and the first after the sizes are set, whose
  batches were fetched before), and
  a rank whose round runs slow contributes a micro-batch fewer, one that
  runs fast one more, as by time. One ``store.add`` per micro-batch (on
  rank 0's store; bounded by ``collective_timeout``). On 2 cores the
  arrivals spread 16 ms instead of 28 by count, and ``abs_sgd`` ran at 0.77
  of the no-communication bound against 0.73.
* ``"time"``: each rank arrives after about ``T = R / sum_j s_j`` seconds of work (``ABSSGDStrategy.round_seconds``, the
  same on every rank), with the micro-batch whose end is nearest to ``T``.
  Its micro-batches (and ``"samples"``'s) are sized once, from the first measurement of synchronous
  rounds, to about ``1 / slices`` of its share (``b_i = min(B_i,
  max(min_batch_size, round(q_i / m)))``, ``m = max(slices, max_j
  ceil(q_j / B_j))``); ``T`` follows the speeds every window, so a round
  holds about ``R`` samples at the current sizes. The ranks' arrivals then
  spread by about a micro-batch rather than by the noise of a whole share:
  with 4 ranks on 2 cores a share's work varied by 11-15 ms from round to
  round, and the round waited for the slowest of four such draws (arrivals
  19 ms apart on rounds of 64 ms; by time 10 ms apart on rounds of 52 ms,
  0.81 of the no-communication bound against 0.70). The sizes
  stay put because a small micro-batch costs more per sample (what a batch
  costs beyond its samples): re-measured at their own sizes the slow ranks'
  speeds fell, their micro-batches shrank, and fell further, to one sample.
  Under ``"time"`` and ``"samples"`` the ranks run different numbers of micro-batches per round, as under
  ``delay=1``: a collective that every rank issues once per batch
  (``sync_dist`` logging per step, ``all_gather``, a user's ``barrier``)
  cannot pair. So a fit that issues one of the strategy's collectives in a hook
  run at every batch (``training_step``, ``on_train_batch_end``, a callback's)
  in the rounds before the first split (one micro-batch per rank
  each, in lock-step) arrives by count, with a warning; one first issued
  later is refused by the strategy with an error that names the fix
  (``ABSSGDStrategy._before_collective``). What ``"time"`` costs: a round's samples
  vary with the ranks' speeds from round to round (about 340 to 800 for
  ``R = 512`` with 4 ranks on 2 cores), and over 24 seeds under SGD
  momentum the accuracy ended 0.16 points below the count rule's on average,
  with fits 1.0 and 0.9 points below (docs/staleness.md#arriving-by-time);
  ``"samples"`` keeps every round at ``R`` (docs/staleness.md#arriving-by-samples).

Under ``delay=1`` the rules apply to the synchronous finish's rounds, the
only ones split there.

No micro-batch exceeds its rank's loader batch under any rule, and the
``min_batch_size`` floor is paid per micro-batch, so a round can hold more
than ``R``. A
batch that ends an epoch or the fit arrives whatever its count. Without a
step size (``step_samples`` and ``reference_samples`` both ``None``)
synchronous rounds keep one micro-batch per rank, sized by the first rule on
the measured speeds. The per-rank samples and busy seconds travel in every
round's header, so every rank computes the same sizes for every rank at the
same round, with no collective beyond the strategy's one at the start, and
rank 0 can log all of them: ``abs/batch_size`` (this rank's),
``abs/batch_size_rank{i}``, ``abs/micro_batches_rank{i}`` (under ``"samples"`` and ``"time"``: ``m``, the
micro-batches a share was sized for), ``abs/samples_per_round_rank{i}`` and, under
``"time"``, ``abs/round_seconds``. The first sizes come after
``first_window`` rounds (2), later updates every ``window`` rounds (8); the
next batch drawn has the new size (the strategy's
:class:`~lightning_partial.data.ElasticBatchSampler`). A new fit starts over
from the loaders' sizes. **Decision** (a short first window): the rounds
before the first sizes run at the loaders' sizes, one micro-batch per rank
in lock-step, each as slow as the slowest rank. With a first window of 8
rounds the fastest ranks of the heterogeneity benchmark (speeds 1, 1, 0.5,
0.25, 120 steps, AdamW) waited in the rounds 15 % of the fit's time, 13 %
in those first rounds, with most compute emulated as an accelerator's; with
2 rounds 8 % (4 % in the first rounds): 2.52x DDP's samples/s instead of
2.32x, at the same accuracy. On two cores' real compute the wait fell from
19 % to 13 % without a measurable gain in samples/s (the ranks share two
cores, so a waiting rank's CPU goes to the others)
(docs/staleness.md#the-first-window).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from typing import Any, Optional

from lightning.pytorch.callbacks import Callback
from typing_extensions import override

import lightning.pytorch as pl
from lightning_partial.collectives import RoundStats
from lightning_partial.collectives.checks import check_int

log = logging.getLogger(__name__)

#: When a rank arrives at a synchronous round split by speed (see the module docstring).
ARRIVALS: tuple[str, ...] = ("count", "samples", "time")


class AdaptiveBatchSize(Callback):
    """Adapts this rank's micro-batch size to its measured share of the samples (see the module docstring).

    Args:
        window: rounds per measurement and between updates, after the first (>= 1).
        first_window: synchronous rounds measured before the first update (``1 <= first_window <= window``;
            ``None``: ``min(2, window)``). The rounds before it run at the loaders' sizes, one micro-batch per
            rank in lock-step, the fast ranks waiting for the slowest, so the first sizes come as soon as every
            rank's speed has been read: a fit's first micro-batch reports no busy seconds (there is no earlier
            return to count from, which also keeps its one-off costs out), so two rounds are the fewest that
            measure one. Under ``"samples"`` and ``"time"`` the sizes only set how finely a share is cut (a
            round's samples are counted or timed, not taken from them). A per-batch collective must appear in
            these rounds to make the fit arrive by count; one first issued later is refused. Asynchronous rounds
            and results restored from a checkpoint wait for a whole ``window``.
        min_batch_size: the smallest micro-batch (>= 1), unless a rank's loader batch is smaller: no
            micro-batch exceeds its rank's loader batch.
        log: log the sizes to the Lightning loggers.
        history: how many updates to keep in :attr:`history` (the oldest are dropped).
        arrival: in synchronous rounds split by speed, when a rank arrives: ``"samples"`` (default) once the round
            holds about its samples over every rank (counted in the store), ``"count"`` after the same number of
            micro-batches on every rank (lock-step batches: a collective issued once per batch pairs; slower),
            ``"time"`` after about the round's time of work (less accurate). See the module docstring.
        slices: ``"samples"``, ``"time"``: about how many micro-batches a rank's share of a round is cut into
            (>= 1): the finer, the closer the ranks arrive, and the more each round pays per batch.
    """

    def __init__(self, window: int = 8, min_batch_size: int = 1, log: bool = True, history: int = 10_000, *,
                 arrival: str = "samples", slices: int = 4, first_window: Optional[int] = None) -> None:
        check_int("window", window, owner="AdaptiveBatchSize")
        if first_window is None:
            first_window = min(2, window)
        check_int("first_window", first_window, owner="AdaptiveBatchSize")
        if first_window > window:
            raise ValueError(f"AdaptiveBatchSize: first_window must be at most window ({window}), got {first_window}")
        check_int("min_batch_size", min_batch_size, owner="AdaptiveBatchSize")
        check_int("history", history, minimum=0, owner="AdaptiveBatchSize")
        check_int("slices", slices, owner="AdaptiveBatchSize")
        if not isinstance(log, bool):
            raise ValueError(f"AdaptiveBatchSize: log must be a bool, got {log!r}")
        if arrival not in ARRIVALS:
            raise ValueError(f"AdaptiveBatchSize: unknown arrival {arrival!r}: expected one of {', '.join(ARRIVALS)}")
        self.window = window
        self.first_window = first_window
        self.min_batch_size = min_batch_size
        self.arrival = arrival
        self.slices = slices
        # Not ``self.log``: Lightning sets every callback's ``log`` to the module's at fit start.
        self._log = log
        self.sizes: Optional[tuple[int, ...]] = None  # every rank's current size
        #: Every rank's micro-batches per synchronous round (1 each under the asynchronous rule).
        self.micro_batches: Optional[tuple[int, ...]] = None
        # (round, sizes, micro-batches per round, whether the synchronous rule made them) at each update, the
        # latest ``history`` of them.
        self.history: deque[tuple[int, tuple[int, ...], tuple[int, ...], bool]] = deque(maxlen=history)
        # Per round: (samples, busy seconds, synchronous), every rank's.
        self._counts: deque[tuple[tuple[int, ...], tuple[float, ...], bool]] = deque(maxlen=window)
        self._rank = 0
        self._strategy: Any = None
        self._pending_log: Optional[dict[str, float]] = None
        # arrival="samples"|"time": the split's sizes and nominal counts, made once per fit (the module docstring).
        self._timed: Optional[tuple[tuple[int, ...], tuple[int, ...]]] = None
        self._fit_arrival: Optional[str] = None  # this fit's rule, decided at its first split (_decide_arrival)

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        from lightning_partial.strategies.abs_sgd import ABSSGDStrategy

        if stage != "fit":
            return
        strategy = trainer.strategy
        if not isinstance(strategy, ABSSGDStrategy):
            raise ValueError(
                f"AdaptiveBatchSize needs strategy='abs_sgd' (per-rank micro-batches), got {type(strategy).__name__}"
            )
        self._rank = trainer.global_rank
        if self._on_round not in strategy.round_listeners:
            strategy.round_listeners.append(self._on_round)
        self._strategy = strategy

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if getattr(self._strategy, "sampler", None) is None:
            raise RuntimeError("AdaptiveBatchSize: the abs_sgd strategy has no elastic sampler")
        # A new fit measures afresh (the strategy starts it at one micro-batch per round, the loaders' sizes).
        self.sizes = self.micro_batches = self._pending_log = None
        self._timed = self._fit_arrival = None
        self._counts.clear()

    @property
    def bases(self) -> Optional[tuple[int, ...]]:
        """Every rank's loader batch size (they may differ), as the strategy agreed them when its engines
        started: the rules need them all (the same micro-batch count on every rank; the sizes rank 0 logs)."""
        return getattr(self._strategy, "loader_batch_sizes", None)

    @property
    def fit_arrival(self) -> Optional[str]:
        """The rule this fit's synchronous rounds arrive by: ``arrival``, or ``"count"`` when a hook run at every
        batch issues one of the strategy's collectives (decided at the first split; ``None`` before it)."""
        return self._fit_arrival

    @property
    def base(self) -> Optional[int]:
        """This rank's loader batch size."""
        bases = self.bases
        return None if bases is None else bases[self._rank]

    def _on_round(self, index: int, stats: RoundStats) -> None:
        """Strategy's thread (the training loop), for every round applied, in order: the same on every rank."""
        if index != 0 or stats.flush or self.bases is None:
            return
        if len(stats.counts) != len(self.bases):
            return  # a result restored from a checkpoint of another world size: its counts are the old ranks'
        self._counts.append((stats.counts, stats.busy, stats.synchronous))
        # The first update as soon as first_window synchronous rounds with every rank's busy seconds are measured
        # (asynchronous rounds, where a slow rank's micro-batch spans several, and results restored from a
        # checkpoint, which carry no busy seconds, wait for a whole window), then one every window rounds (each
        # update empties the window). The same rounds on every rank, which apply every round in order.
        first = self.sizes is None and self._window_synchronous(len(stats.counts))
        if len(self._counts) < (self.first_window if first else self.window):
            return
        samples = [sum(c[0][i] for c in self._counts) for i in range(len(stats.counts))]
        shares, synchronous = self._shares(samples)
        top = max(shares)
        if top <= 0 or (first and not synchronous):
            return  # (a first window without busy seconds on some rank: a fit's first round alone; measure on)
        round_samples = getattr(self._strategy, "sync_round_samples", None)
        split = synchronous and round_samples is not None
        seconds: Optional[float] = None
        if split:
            sizes, counts = self._split(round_samples, shares)
            if self._fit_arrival == "time":
                # The window's summed speed at the current sizes: a round of T seconds holds about R samples.
                seconds = round_samples / sum(shares)
        else:
            sizes = tuple(
                # The loader's batch wins over the floor: no micro-batch exceeds it (min_batch_size may).
                min(base, max(self.min_batch_size, round(base * s / top))) for base, s in zip(self.bases, shares)
            )
            counts = (1,) * len(sizes)
        fill = sizes if split and self._fit_arrival == "samples" else None
        self.sizes, self.micro_batches = sizes, counts
        self.history.append((stats.round_index, sizes, counts, split))
        strategy = self._strategy
        strategy.sampler.batch_size = sizes[self._rank]  # the current sampler (a reloaded loader has a new one)
        strategy.micro_batches_per_round = counts[self._rank]
        strategy.round_seconds = seconds
        strategy.round_fill = fill
        per_round = [n / len(self._counts) for n in samples]
        self._pending_log = {
            "abs/batch_size": float(sizes[self._rank]),
            **{f"abs/batch_size_rank{i}": float(b) for i, b in enumerate(sizes)},
            **{f"abs/micro_batches_rank{i}": float(n) for i, n in enumerate(counts)},
            **{f"abs/samples_per_round_rank{i}": float(x) for i, x in enumerate(per_round)},
            **({"abs/round_seconds": seconds} if seconds is not None else {}),
        }
        # The next measurement covers the rounds after this update only (the first one's window is shorter).
        self._counts.clear()

    def _split(self, round_samples: int, speeds: list[float]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Synchronous rounds: ``round_samples`` shared by speed, each share as ``n`` micro-batches of at most
        the rank's loader batch; returns every rank's size and ``n``.

        Rank ``i``'s share is ``q_i = R * v_i / sum_j v_j``: every share takes about as long, and the round
        holds about ``R`` (the strategy's step: one allreduce per step, as DDP's). Every rank runs ``n =
        max_j ceil(q_j / B_j)`` micro-batches of ``round(q_i / n)`` samples (``"count"``: the ranks' batches
        stay in lock-step, so a collective that every rank issues once per batch pairs the same batches), or
        about ``n = max(slices, max_j ceil(q_j / B_j))`` of them, which ``"samples"`` and ``"time"`` size once per
        fit (their ranks arrive by the round's samples or time, so the count is nominal): never larger than the loader's batch ``B_i`` (memory).
        """
        if self._fit_arrival is None:
            self._fit_arrival = self._decide_arrival()
        timed = self._fit_arrival != "count"
        if timed and self._timed is not None:
            return self._timed
        assert self.bases is not None
        total = sum(speeds)
        quotas = [round_samples * v / total for v in speeds]
        n = max(1, *(math.ceil(q / base) for q, base in zip(quotas, self.bases)), self.slices if timed else 1)
        sizes = tuple(min(base, max(self.min_batch_size, round(q / n))) for q, base in zip(quotas, self.bases))
        split = (sizes, (n,) * len(sizes))
        if timed:
            self._timed = split
        return split

    def _decide_arrival(self) -> str:
        """The fit's arrival rule, at its first split: ``arrival``, but ``"count"`` when a hook run at every batch
        has issued one of the strategy's collectives (``ABSSGDStrategy.batch_collectives``). The rounds before the
        first split run one micro-batch per rank each, in lock-step, so every rank has seen the same batches
        and decides alike; a per-batch collective first issued after the split is refused by the strategy."""
        if self.arrival != "count" and getattr(self._strategy, "batch_collectives", False):
            if self._rank == 0:
                log.warning(
                    "AdaptiveBatchSize: a hook run at every batch (the training step, on_train_batch_end, ...) issues "
                    "a collective (self.log(..., sync_dist=True), all_gather, a barrier), which pairs only batches "
                    "run in lock-step: the ranks arrive by count "
                    f"in this fit (arrival='count'), which is slower than arrival={self.arrival!r}; log per rank "
                    "(sync_dist=False) or per epoch (on_step=False, on_epoch=True) to arrive by "
                    + ("time" if self.arrival == "time" else "samples")
                )
            return "count"
        return self.arrival

    def _window_synchronous(self, world_size: int) -> bool:
        """Whether every round of the window was synchronous and carries every rank's busy seconds (a result
        restored from a checkpoint carries none): what measures speeds per busy second (:meth:`_shares`)."""
        return all(c[2] and len(c[1]) == world_size for c in self._counts)

    def _shares(self, samples: list[int]) -> tuple[list[float], bool]:
        """Each rank's speed over the window, from its ``samples`` there: samples per round, or samples per
        busy second when every round of the window was synchronous (then also ``True``)."""
        world_size = len(samples)
        if self._window_synchronous(world_size):
            busy = [sum(c[1][i] for c in self._counts) for i in range(world_size)]
            if all(b > 0 for b in busy):
                return [n / b for n, b in zip(samples, busy)], True
        return [float(n) for n in samples], False

    @override
    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._log and self._pending_log is not None and trainer.loggers:
            pl_module.log_dict(self._pending_log, on_step=True, on_epoch=False)
        self._pending_log = None

    @override
    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        strategy = self._strategy
        if strategy is not None and self._on_round in strategy.round_listeners:
            strategy.round_listeners.remove(self._on_round)
