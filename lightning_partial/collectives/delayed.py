"""DelayedAllreduce: ABS-SGD's delayed, sample-weighted allreduce with adaptive per-rank batches.

ABS-SGD leaves open what starts a round and how epochs end; the rules fixed
here (**Decisions**; the semantics in docs/algorithms.md, abs_sgd):

* **Contributions.** The caller deposits every micro-batch it completes: its
  mean gradient and its number of samples ``b``. The engine accumulates
  ``b * gradient`` and ``b`` per rank. A round takes everything a rank
  accumulated when its communication thread snapshots the round (so a fast
  rank contributes more samples, and no rank ever waits to contribute), sums
  gradients and samples over all ranks (the samples travel in the round
  header) and returns ``sum_i G_i / sum_i b_i``: the sample-weighted mean.
  With ``reference_samples=B`` it returns ``sum_i G_i / B`` instead: the
  linear scaling rule applied per round, for rounds whose size the speeds
  decide (see :class:`DelayedConfig`).
* **What starts a round** (``trigger``). ``"samples"`` (default): a rank that
  has accumulated ``target_samples`` samples since its last contribution
  requests the next round. ``"time"``: a rank whose last contribution is
  ``interval`` seconds old (and that has something to contribute) requests
  it. A request takes effect once this rank's previous round has completed:
  its communication thread then activates the next round for every rank
  (through the store, as eager-SGD's solo mode). Hence the fastest rank paces
  the rounds, at most one round is in flight per rank, and the allreduce of
  round ``r`` overlaps the micro-batches that will go into round ``r + 1``.
* **Delay.** The result of round ``r`` is handed to the caller at its first
  micro-batch boundary after round ``r + 1`` started on this rank: exactly one
  round late. The micro-batch that requests round ``r + 1`` waits until the
  round has started (which needs round ``r`` complete on this rank), so the
  requesting rank applies ``r``'s result before computing round ``r + 2``'s
  micro-batches: their gradients lack only round ``r + 1``'s update (staleness
  one, as the paper's delayed synchronous SGD). That wait is the only one:
  for the previous allreduce, which overlapped a whole round of micro-batches.
  Every rank applies every result once, in round order, so the replicas stay
  bit-identical. A round that carried a stop (``request_stop``) is handed at
  the next micro-batch boundary: no round follows it.
* **Agreement.** Every rank sees every round's header, so every rank counts
  the same global samples and rounds: the round after which the samples
  reach ``k * epoch_samples`` ends epoch ``k``; the round that reaches
  ``max_epochs`` epochs or ``max_rounds`` rounds, or the first that carries a
  finish request (``request_finish``: a time limit), is final (no rank
  requests another). :meth:`pause`, :meth:`known_round` and :meth:`drain` let the
  caller's side agree on a round after which nothing is in flight (a
  checkpoint; the end of fit), and :meth:`finish` runs the final,
  synchronous round after it: nothing pending is lost.
* **The synchronous finish** (``sync_from``, ``sync_from_samples``). From a
  round on, every round is synchronous: no rank activates it; each rank's
  every micro-batch *arrives* at it (as a synchronous round of
  ``PartialAllreduce``), and :meth:`deposit` waits for that round and hands
  its result at once, with the one before it. The first such round is
  ``sync_from``, or the round after the one whose global samples reach
  ``sync_from_samples`` (known from the headers: the same round on every
  rank); whichever comes first. Its micro-batches were computed before the
  last asynchronous round was applied (one round late, as before); from the
  next round on every gradient is fresh (:attr:`DelayedAllreduce.fresh_from`),
  and the ranks run in lock-step, the slowest pacing: DDP's rounds, summed by
  samples. With ``sync_from=0`` (``abs_sgd``'s ``delay=0``) no asynchronous
  round comes first: every round is fresh from round 0. A micro-batch
  deposited with ``arrive=False`` in a synchronous round joins this rank's
  next contribution without arriving: a rank whose share of a round is
  several micro-batches (``AdaptiveBatchSize``) arrives once, with all of
  them, and the round's allreduce is paid once; :meth:`count_round_samples`
  counts a rank's micro-batches into the round in the store before it
  deposits them, so that a caller can arrive once the round holds enough
  over every rank. An arrival with ``wait=False`` goes on once the round is
  taken: the caller's next micro-batch, computed while the round completes,
  goes into the next round, and the deposit that carries it does not arrive
  but waits for the round and hands it (so a rank arrives at a round only once
  every round before it was handed); :meth:`progress` counts the round once
  it is handed, so that every rank learns of an epoch's or the fit's end at
  the same batch relative to its rounds. At the switch, a rank
  whose micro-batch spanned the last asynchronous rounds may deposit next
  into the first synchronous round before it was handed the rounds before
  the last asynchronous one, which the other ranks were handed at their
  own micro-batch boundaries (and may act on collectively there, as a
  checkpoint's save): that micro-batch is held as with ``arrive=False``,
  and those rounds are handed at once; the rank arrives with its next one
  (or :meth:`DelayedAllreduce.arrive`). So every rank arrives at the first
  synchronous round after the same rounds were handed to it, and no rank
  waits in it for a caller that waits for it. Epochs: a caller that learns
  of an epoch's end at a batch start arrives with that batch (the epoch's
  last); one whose batch began before the epoch's last round completed
  says so (``deposit(epoch=e)``), and a synchronous round after that epoch's
  end is not arrived at in it: its next batch, the epoch's last, arrives,
  as every other rank's last does.

Threads and collectives: the caller's thread calls :meth:`deposit` after each
micro-batch and applies what it returns; it issues no collective (it only
sets its own store key to wake its communication thread). The communication
thread runs the rounds: activation through the store, then the data
allreduce on the data group with the int64 header (samples per rank) in it,
or beside it on the gloo header group (see ``PartialAllreduce``).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Literal, Optional, cast

import torch.distributed as dist

from lightning_partial.collectives.checks import check_int, is_finite_number
from lightning_partial.collectives.config import EngineBounds, PartialAllreduceConfig
from lightning_partial.collectives.engine import PartialAllreduce, Tensors
from lightning_partial.collectives.errors import EngineClosedError, PartialCollectiveTimeout
from lightning_partial.collectives.results import RoundResult
from lightning_partial.collectives.rounds import Deposit
from lightning_partial.collectives.stats import RoundStats

logger = logging.getLogger(__name__)

Trigger = Literal["samples", "time"]
TRIGGERS: tuple[str, ...] = ("samples", "time")


@dataclass(frozen=True, kw_only=True)
class DelayedConfig(EngineBounds):
    """What starts a round of a :class:`DelayedAllreduce`, and when training ends.

    Args:
        trigger: ``"samples"`` or ``"time"`` (see the module docstring).
        target_samples: ``"samples"``: the samples a rank accumulates before it
            requests a round (the fastest rank reaches it first).
        interval: ``"time"``: seconds between a rank's contributions.
        reference_samples: ``None`` (default): a round returns the sample-weighted
            mean ``sum_i G_i / sum_i b_i`` (docs/algorithms.md, abs_sgd), so a round that
            took more samples steps no farther. ``B``: it returns ``sum_i G_i / B``,
            the mean scaled by ``round samples / B``: the linear scaling rule
            (Goyal et al., 2017) per round, so the progress per sample does not
            fall as the rounds grow. ``B`` is the global batch the learning rate
            was tuned for (under DDP: world size x batch size).
        epoch_samples: global samples of one epoch (the dataset's size); ``None``: no epochs.
        max_epochs: the round that completes this many epochs is final (needs ``epoch_samples``).
        max_rounds: the round with index ``max_rounds - 1`` is final.
        sync_from: every round from this index on is synchronous (the synchronous finish).
        sync_from_samples: every round after the one whose global samples reach this
            many is synchronous (counted from the first round, as ``epoch_samples``).
        timeout: bound on every blocking wait that includes other ranks' compute.
        collective_timeout: bound on an activated round's collectives (see
            :class:`PartialAllreduceConfig`).
        setup_timeout: bound on ``start()``'s rendezvous; ``None``: ``timeout``
            (see :class:`PartialAllreduceConfig`).
        name: prefix of the engine's store keys and process groups.
    """

    trigger: Trigger = "samples"
    target_samples: Optional[int] = None
    interval: Optional[float] = None
    reference_samples: Optional[int] = None
    epoch_samples: Optional[int] = None
    max_epochs: Optional[int] = None
    max_rounds: Optional[int] = None
    sync_from: Optional[int] = None
    sync_from_samples: Optional[int] = None
    name: str = "abs_sgd"

    def __post_init__(self) -> None:
        if self.trigger not in TRIGGERS:
            raise ValueError(f"unknown trigger {self.trigger!r}: expected one of {', '.join(TRIGGERS)}")
        if self.trigger == "samples":
            check_int("target_samples", self.target_samples)
            if self.interval is not None:
                raise ValueError("interval is only meaningful with trigger='time'")
        else:
            if not is_finite_number(self.interval) or not self.interval > 0:
                raise ValueError(f"trigger='time' needs interval > 0 (seconds, finite), got {self.interval!r}")
            if self.target_samples is not None:
                raise ValueError("target_samples is only meaningful with trigger='samples' (trigger='time' starts a "
                                 f"round every interval seconds), got target_samples={self.target_samples!r}")
        check_int("reference_samples", self.reference_samples, optional=True)
        check_int("epoch_samples", self.epoch_samples, optional=True)
        check_int("max_epochs", self.max_epochs, optional=True)
        check_int("max_rounds", self.max_rounds, optional=True)
        check_int("sync_from", self.sync_from, minimum=0, optional=True)
        check_int("sync_from_samples", self.sync_from_samples, minimum=0, optional=True)
        if self.max_epochs is not None and self.epoch_samples is None:
            raise ValueError("max_epochs needs epoch_samples (the global samples of one epoch)")
        # The engine's own checks (timeout, collective_timeout, setup_timeout, name).
        self.partial_config()

    def partial_config(self) -> PartialAllreduceConfig:
        """The underlying rounds: solo activation, carried contributions, divided by the samples."""
        return PartialAllreduceConfig(
            mode="solo", late="carry", normalize="contributors", timeout=self.timeout,
            collective_timeout=self.collective_timeout, setup_timeout=self.setup_timeout, name=self.name,
        )


@dataclass
class SampleDeposit(Deposit):
    """Micro-batches waiting in this rank's send buffer: the sum of ``samples`` samples' gradients."""

    samples: int = 0
    first_step: Optional[int] = None  # the round that took the oldest micro-batch in it
    busy: float = 0.0  # seconds the caller worked on these micro-batches (from each deposit's return to the next)


@dataclass(frozen=True)
class RoundProgress:
    """The epochs and the fit's end as the completed rounds on this rank say (the same on every rank per round).

    ``final_round``: the fit's last round once it has completed; ``epochs_completed``: the epochs the
    global samples make up; ``epoch_end_rounds``: per epoch completed in this run (0-based), the round that
    completed it; ``sync_from``: the first synchronous round, once known (every rank applies a synchronous
    round's result in the batch that arrives at it).
    """

    final_round: Optional[int]
    epochs_completed: int
    epoch_end_rounds: dict[int, int]
    sync_from: Optional[int]

    def is_synchronous(self, round_index: int) -> bool:
        return self.sync_from is not None and round_index >= self.sync_from


class DelayedAllreduce(PartialAllreduce):
    """Delayed sample-weighted allreduce (see the module docstring for the rules).

    Built on :class:`PartialAllreduce`'s rounds through its documented protected
    API and round hooks: it activates rounds itself (:meth:`_await_activation`,
    :meth:`_after_round`), describes its deposits by their samples, and ends with
    :meth:`finish` at a round every rank agreed on (which runs the base class's
    final round, :meth:`_flush`); ``flush()``, which ends at the caller's next
    step, has no meaning here and raises.

    Example::

        engine = DelayedAllreduce(DelayedConfig(target_samples=32), store=store, rank=rank,
                                  world_size=P, like=[p.grad for p in params]).start()
        for batch in loader:                      # however many this rank manages
            loss(batch).backward()
            for result in engine.deposit([p.grad for p in params], samples=len(batch)):
                set_grads(result.tensors); optimizer.step()
        engine.pause(); R = max over ranks of engine.known_round(); engine.drain(R)
        for result in engine.finish(R):
            set_grads(result.tensors); optimizer.step()
        engine.close()
    """

    _SKIPPABLE = False  # no skip(): its rounds are paced by samples, not by steps
    _REQUESTS_SYNC = False  # its finish: sync_from, sync_from_samples (and its own bookkeeping of both)

    @property
    def sync_from(self) -> Optional[int]:
        """The first synchronous round in force: ``config.sync_from``, or the round after the one whose global
        samples reached ``sync_from_samples``, once known; ``None`` before."""
        with self._cond:
            return self._sync_from

    def __init__(
        self,
        config: DelayedConfig,
        *,
        store: dist.Store,
        rank: int,
        world_size: int,
        like: Tensors,
        backend: Optional[str] = None,
    ) -> None:
        if not isinstance(config, DelayedConfig):
            raise ValueError(f"config must be a DelayedConfig, got {type(config).__name__}")
        self.delayed = config  # before the base class: its hooks (_divisor) read it
        super().__init__(config.partial_config(), store=store, rank=rank, world_size=world_size, like=like,
                         backend=backend)
        # Guarded by self._cond, like the base class's state.
        self._requested = False  # this rank's caller wants the next round
        self._paused = False
        self._final_round: Optional[int] = None
        # Per epoch completed in this run (0-based), the round whose global samples completed it.
        self._epoch_end_rounds: dict[int, int] = {}
        self._completed = -1  # the last round whose result is published and whose follow-up is decided
        self._handed = -1  # the last round handed to the caller
        self.deposit_round = -1  # the round that takes the latest deposit (for tests and stats)
        self._global_samples = 0
        self._contributed_at = time.monotonic()
        # When the caller's last deposit() returned (caller's thread only): the time until its next
        # deposit is the work behind that micro-batch, whatever the engine made it wait before.
        self._returned_at: Optional[float] = None
        # Seconds the caller was blocked in deposit() and drain() since the last result it was handed
        # (caller's thread only): the next result handed carries them as its stats' wait_time.
        self._blocked = 0.0
        self._restored: list[RoundResult] = []  # unapplied results from a checkpoint, handed first
        # The first synchronous round (the finish): set by the communication thread once the
        # global samples reach sync_from_samples, never moved later.
        self._sync_from: Optional[int] = config.sync_from
        if config.sync_from_samples == 0:
            self._sync_from = 0
        # Whether this rank's caller counts synchronous rounds' samples in the store (count_round_samples):
        # rank 0 then deletes each synchronous round's count once the round completed.
        self._counting = False
        self._counted_from = 0  # the first round this rank counted into
        self._discarded_through = -1  # rank 0: the last round whose count it discarded (communication thread)
        # The last synchronous round this rank arrived at without waiting (deposit(wait=False)): handed at its
        # next deposit, and hidden from progress() until then. The global samples before the latest completed
        # round: what progress() reports while that round is hidden.
        self._overlapped = -1
        self._samples_before_last = 0
        # Held while deciding to activate and activating: after pause() returns, this
        # rank activates nothing.
        self._activation_lock = threading.Lock()

    # ------------------------------------------------------------------ API
    @property
    def global_samples(self) -> int:
        """Samples summed by the rounds completed on this rank (the same on every rank per round)."""
        with self._cond:
            return self._global_samples

    def progress(self) -> "RoundProgress":
        """What the completed rounds say about the epochs and the fit's end, read at once (one lock).

        A round this rank arrived at without waiting (``deposit(wait=False)``) counts only once it has been handed:
        whether it has completed by this rank's next batch start differs from rank to rank, while every rank that
        went on from it is handed it in that batch's deposit. So every rank learns that the round ended an epoch
        or the fit at the same batch relative to its rounds (the batch after the one that handed it), as every rank
        does without overlap (the batch after the one that arrived at it)."""
        n = self.delayed.epoch_samples
        with self._cond:
            hidden = self._outstanding_overlap()
            if hidden is not None and self._completed >= hidden:
                # It is the latest completed round: none after it completes before this rank arrives again.
                samples = self._samples_before_last
                final = self._final_round if self._final_round is not None and self._final_round < hidden else None
                ends = {e: r for e, r in self._epoch_end_rounds.items() if r < hidden}
            else:
                samples, final, ends = self._global_samples, self._final_round, dict(self._epoch_end_rounds)
            return RoundProgress(
                final_round=final,
                epochs_completed=samples // n if n else 0,
                epoch_end_rounds=ends,
                sync_from=self._sync_from,
            )

    @property
    def fresh_from(self) -> Optional[int]:
        """The first round whose every contribution is fresh (the synchronous finish's second), once known.

        From it on, each rank computed its micro-batch after applying every earlier
        round's result (the same on every rank: the rounds run in lock-step). Round 0
        when every round is synchronous (``sync_from=0``): no asynchronous round came first.
        """
        with self._cond:
            if self._sync_from is None:
                return None
            return 0 if self._sync_from == 0 else self._sync_from + 1

    def is_fresh(self, round_index: int) -> bool:
        """Whether every contribution to round ``round_index`` was computed on the weights it is applied to."""
        fresh_from = self.fresh_from
        return fresh_from is not None and round_index >= fresh_from

    @property
    def final_round(self) -> Optional[int]:
        """The final round, once it has completed on this rank."""
        with self._cond:
            return self._final_round

    def deposit(self, tensors: Tensors, samples: int, *, arrive: bool = True,
                epoch: Optional[int] = None, wait: bool = True) -> list[RoundResult]:
        """Adds a micro-batch (its *mean* gradient over ``samples`` samples); returns the results now due.

        A result is due once the round after it has started on this rank; they
        come in round order, and each exactly once. Blocks only when this
        micro-batch requests the next round: until that round has started here,
        i.e. until the previous round has completed (bounded by the timeout).
        In the synchronous finish every micro-batch arrives at the next round,
        and blocks until that round has completed: its result is due at once;
        unless ``arrive`` is false: the micro-batch then joins this rank's next
        contribution and the call returns at once, with no round (a later
        deposit arrives with both; the end of fit's round takes what is left).
        The first synchronous deposit of a rank not yet handed every round
        before the last asynchronous one is held the same way, whatever
        ``arrive`` says, and returns those rounds (see the module docstring;
        :attr:`holding` tells, :meth:`arrive` arrives without a new micro-batch).
        ``epoch``: the caller's epoch (0-based, as the rounds count them), given
        from a batch that does not end it: once the completed rounds have
        ended that epoch (asked, in a synchronous round, once the round
        before it completed), the micro-batch is held too, so that the caller's
        next batch, which ends the epoch, is the one that arrives (as on the
        ranks that saw the epoch end before their batch began; see the module
        docstring).
        ``arrive`` has no effect on an asynchronous round (its trigger decides).
        ``wait=False`` (an arriving deposit in a synchronous round): the call returns once this rank's
        communication thread has taken the round, without its result, so that the caller computes its next
        micro-batch while the round completes (that micro-batch, computed without the round's update, goes
        into the next round); the next deposit does not arrive (held, as with ``arrive=False``), waits for
        the round and returns its result; until then :meth:`progress` leaves the round out. Not once a stop or
        the final round is known (:meth:`_may_overlap`): the arrival waits then, as with ``wait=True``.
        The time since the previous call returned is this micro-batch's work,
        reported per rank in the round's ``RoundStats.busy``.
        """
        arrived = time.monotonic()
        busy = 0.0 if self._returned_at is None else arrived - self._returned_at
        try:
            return self._deposit(tensors, samples, busy, arrive=arrive, epoch=epoch, wait=wait)
        finally:
            self._returned_at = time.monotonic()

    def _deposit(self, tensors: Tensors, samples: int, busy: float, *, arrive: bool = True,
                 epoch: Optional[int] = None, wait: bool = True) -> list[RoundResult]:
        """:meth:`deposit`, with the seconds of work behind the micro-batch (0.0 for the first)."""
        self._check_running("deposit")
        check_int("samples", samples, owner=f"rank {self.rank}")
        check_int("epoch", epoch, minimum=0, optional=True, owner=f"rank {self.rank}")
        grads = self._as_list(tensors)
        with self._cond:
            q = self._snapshotted + 1
            # From a batch that may not end its epoch, a synchronous round is decided on only once the round
            # before it completed: whether that round ended the epoch is known then (with sync_from given,
            # round q is known synchronous while q - 1 is in flight). Arriving would wait for it anyway.
            settle = (epoch is not None and arrive and self.delayed.epoch_samples is not None
                      and self._known_sync(q) and self._final_round is None and self._completed < q - 1
                      and not self._behind(q))  # held anyway otherwise
        if settle:
            self._caller_wait(
                lambda: self._raise_if_failed(q - 1) or self._completed >= q - 1 or self._stop_round is not None
                or self._closing,
                q - 1,
                f"round {q - 1} did not complete (is a rank dead or stalled?)",
            )
        self.layout.check(grads, rank=self.rank, round_index=q)
        flats = self.layout.flatten(grads)
        for f in flats:
            f.mul_(samples)  # a sum over the micro-batch's samples
        wake: Optional[int] = None
        with self._cond:
            self._raise_if_failed(q)
            q = self._snapshotted + 1
            deposits = self._deposits()
            if deposits:
                d = deposits[0]
                for acc, f in zip(d.flats, flats):
                    acc.add_(f)
                self.layout.recycle(flats)
                d.samples += samples
                d.busy += busy
                d.step = q
            else:
                d = SampleDeposit(flats, q, samples=samples, first_step=q, busy=busy)
                self._pending.append(d)
            self._record_ready(d)
            self.deposit_round = q
            # After the final round nothing arrives: what comes now waits for finish()'s round.
            synchronous = self._known_sync(q) and self._final_round is None
            # Stays in the send buffer for this rank's next arrival: asked for, or this rank is behind
            # (:meth:`_behind`; the rounds before q - 1 are handed now, round q - 1 with q as always).
            behind = synchronous and self._behind(q)
            # A round this rank arrived at without waiting, not handed yet (whatever round this micro-batch
            # goes into): this deposit hands it and does not arrive, so that every round before the one a rank
            # arrives at was handed to its caller (and acted on: a step checkpoint's save) before it arrives.
            overlapped = self._outstanding_overlap()
            held = synchronous and (not arrive or behind or overlapped is not None or self._epoch_ended(epoch))
            if behind and arrive:
                logger.debug("rank %d: holds its arrival at synchronous round %d until rounds %d-%d are applied",
                             self.rank, q, self._handed + 1, q - 2)
            go_on = synchronous and not held and not wait and self._may_overlap(q)
            if go_on:
                self._overlapped = q
            if synchronous and not held:
                self._mark_arrival(q)
            pending = sum(p.samples for p in deposits)  # the send buffer itself: d is in it
            triggered = False
            if not synchronous and not self._requested and self._trigger_met(pending):
                self._requested = True
                triggered = not self._paused
                if not self._paused and self._waiting_round is not None:
                    wake = self._waiting_round
        if wake is not None:
            assert self._control is not None
            self._control.wake(wake)  # the communication thread activates the round for everybody
        if go_on:
            return self._await_taken(q)
        if synchronous and not held:
            return self._await_synchronous(q)
        if overlapped is not None:
            return self._await_synchronous(overlapped)
        if triggered:
            # This micro-batch completes round q on this rank: wait until the round has
            # started here (its communication thread snapshots it once round q - 1 has
            # completed), so that round q - 1's result is applied now, exactly one round
            # late. The only wait of a rank: for the previous allreduce, which overlapped
            # the micro-batches of round q.
            self._caller_wait(
                lambda: self._raise_if_failed(q) or self._snapshotted >= q or self._final_round is not None
                or self._paused or self._closing or self._known_sync(q) or self._stop_round is not None,
                q,
                f"round {q - 1} did not complete (is a rank dead or stalled?)",
            )
        with self._cond:
            # Every round before the last one taken here has completed: round s is taken only
            # after round s - 1 completed on this rank. Round r is handed at the first micro-batch
            # boundary after round r + 1 started on this rank; a round that carried a stop (no
            # round follows it) at once, so that every rank applies it and stops there.
            limit = self._snapshotted - 1 if self._stop_round is None else self._stop_round
        return self._take_due(limit=limit)

    def count_round_samples(self, samples: int) -> Optional[int]:
        """Caller's thread, before depositing a micro-batch of ``samples`` samples: where the round it goes
        into is synchronous, adds them to that round's count in the store and returns the count: the samples
        every rank has counted for the round so far, this micro-batch's included. ``None`` where the round is
        asynchronous (it takes what each rank holds when it starts) or the fit's rounds are over.

        A synchronous round's arrival by samples (``AdaptiveBatchSize(arrival="samples")``) reads it: every
        rank counts each micro-batch before it deposits it (arriving or held), so a round's count is complete
        once every rank has arrived. One ``store.add`` on the caller's store client, bounded by
        ``collective_timeout`` (a frozen store host fails with the rank and the round named); rank 0's
        communication thread deletes the count once the round completed.
        """
        self._check_running("count_round_samples")
        check_int("samples", samples, owner=f"rank {self.rank}")
        with self._cond:
            q = self._snapshotted + 1
            self._raise_if_failed(q)
            if not self._known_sync(q) or self._final_round is not None:
                return None
            if not self._counting:
                self._counting, self._counted_from = True, q
            control = self._control
        if control is None:
            raise EngineClosedError("close() was called while counting a round's samples", rank=self.rank,
                                    round_index=q)
        return control.count_samples(q, samples)

    def work_since_arrival(self) -> float:
        """Caller's thread: seconds of work behind what this rank would contribute if it arrived now: the
        micro-batches it holds (their ``busy``, as the round's header will report it) and the time since its
        last :meth:`deposit` returned (the micro-batch just computed). Waits in the engine and pauses are not
        work. A synchronous round's arrival by time (``AdaptiveBatchSize(arrival="time")``) reads it."""
        now = time.monotonic()
        with self._cond:
            held = sum(d.busy for d in self._deposits())
        return held + (0.0 if self._returned_at is None else now - self._returned_at)

    @property
    def holding(self) -> bool:
        """Whether this rank holds micro-batches for a synchronous round it has not arrived at (caller's thread).

        Deposited with ``arrive=False``, or held by the engine at the switch to the synchronous
        finish (see :meth:`deposit`); :meth:`arrive` arrives with them.
        """
        with self._cond:
            return self._held_round() is not None

    def arrive(self) -> list[RoundResult]:
        """Arrives at the synchronous round with what this rank holds, without a new micro-batch (caller's thread).

        Blocks until the round has completed (bounded by the timeout), and returns the results
        then due, as an arriving :meth:`deposit` does. Nothing to do (returns ``[]``) unless
        :attr:`holding`. For a caller that must not end a batch with a micro-batch held: the
        last batch of an epoch, before collective epoch-end work.
        """
        self._check_running("arrive")
        with self._cond:
            q = self._held_round()
            if q is None:
                return []
            self._mark_arrival(q)
        try:
            return self._await_synchronous(q)
        finally:
            self._returned_at = time.monotonic()  # the wait is no micro-batch's work (as in deposit())

    def restart_work_clock(self) -> None:
        """Caller's thread: the next micro-batch's work (its ``busy``) is counted from now, not from the last
        :meth:`deposit`'s return: what the caller did in between (an epoch's end: validation, its hooks, a new
        loader's start) is no micro-batch's work, and would read as a slow rank."""
        if self._returned_at is not None:
            self._returned_at = time.monotonic()

    def pause(self) -> None:
        """This rank activates no round until :meth:`resume` (caller's thread; returns once it holds)."""
        with self._activation_lock:
            with self._cond:
                self._paused = True

    def resume(self) -> None:
        """Lifts :meth:`pause`; a request made meanwhile takes effect now (caller's thread).

        The next micro-batch's work is counted from here: what the caller did while
        paused (agreeing on a round, saving a checkpoint) is not a micro-batch's work.
        """
        self.restart_work_clock()
        wake: Optional[int] = None
        with self._activation_lock:
            with self._cond:
                self._paused = False
                if self._requested and self._waiting_round is not None:
                    wake = self._waiting_round
        if wake is not None:
            assert self._control is not None
            self._control.wake(wake)

    @property
    def started_round(self) -> int:
        """The last round this rank's communication thread has taken (started here); -1 before any."""
        with self._cond:
            return self._snapshotted

    def begin_with_samples(self, global_samples: int) -> None:
        """Before :meth:`start`, instead of :meth:`load_state_dict`: the global samples already trained (a fit
        resumed without engine state at an epoch's start: ``epoch * epoch_samples``), from which the epochs and
        the synchronous finish are counted. Every rank gives the same number."""
        if self._state != "new":
            raise RuntimeError(f"rank {self.rank}: begin_with_samples() must come before start()")
        if isinstance(global_samples, bool) or not isinstance(global_samples, int) or global_samples < 0:
            raise ValueError(f"rank {self.rank}: begin_with_samples() takes a count >= 0, got {global_samples!r}")
        self._global_samples = global_samples

    def handed_round(self) -> int:
        """The last round whose result this rank's caller was handed (-1 before any; a resumed fit's restored
        results count as not handed until a deposit hands them)."""
        with self._cond:
            return self._handed_through()

    def _handed_through(self) -> int:
        """Under ``self._cond``: :meth:`handed_round`."""
        return self._restored[0].round_index - 1 if self._restored else self._handed

    def known_round(self) -> int:
        """The last round activated as far as this rank can tell (after every rank paused)."""
        assert self._control is not None
        with self._cond:
            last = self._snapshotted
        # Round last + 1 may be activated (its key set) without our thread having taken it yet;
        # last + 2 cannot be: activating it needs last + 1 completed, with our thread in it.
        activated = self._control.is_activated(last + 1)
        with self._cond:
            # Meanwhile our thread may have taken round last + 1, run it and deleted its key
            # (ControlPlane.collect): the store then says "not activated" of a round that ran.
            now = self._snapshotted
        return max(now, last + 1 if activated else last)

    def drain(self, round_index: int) -> None:
        """Blocks until round ``round_index`` has completed on this rank (bounded by the timeout).

        A round that carried a stop ends the rounds (no round follows it): draining it, or a round after
        it, returns once it is published. Raises :class:`EngineClosedError` if :meth:`close` is called
        meanwhile, as the other waits for a round's completion do.
        """
        def done() -> bool:
            self._raise_if_failed(round_index)
            # The communication thread returns right after publishing a stop round: _completed never reaches it.
            if self._completed >= round_index or (self._stop_round is not None and self._stop_round <= round_index):
                return True
            if self._closing:
                raise EngineClosedError(f"close() was called while draining round {round_index}", rank=self.rank,
                                        round_index=round_index)
            return False

        self._caller_wait(
            done, round_index, f"round {round_index} did not complete while draining (is a rank dead or stalled?)"
        )

    def results_through_stop(self) -> list[RoundResult]:
        """After :meth:`pause` and :meth:`drain` of the agreed last round: if a round that carried a stop has
        completed, every result not handed yet up to it, in order; else nothing.

        Each rank applies the rounds in batches of its own, so at the end of a fit (a ``should_stop`` at an
        epoch end) one rank may have applied the stop round and another not, or none of them (it was in
        flight). After the drain every rank has published the same rounds, the stop round among them if
        there is one: handing the rest up to it leaves every rank at the stop, with no round after it.
        """
        with self._cond:
            stop = self._stop_round
        return [] if stop is None else self._take_due(limit=stop)

    def finish(self, round_index: int) -> list[RoundResult]:
        """The final synchronous round ``round_index + 1``; returns every result not yet handed, in order.

        Every rank calls it with the same ``round_index``, after :meth:`pause` and
        :meth:`drain` of that round. Afterwards nothing is pending anywhere.
        """
        with self._cond:
            if self._snapshotted != round_index or self._completed != round_index:
                raise RuntimeError(
                    f"rank {self.rank}: finish({round_index}) after round {self._completed} completed and round "
                    f"{self._snapshotted} was taken: pause() and drain({round_index}) first"
                )
        self._check_running("flush")
        last = self._flush(None, step=round_index + 1)
        with self._cond:
            self._global_samples += int(last.stats.contributions)  # _after_round does not run for the flush
            # Every rank starts counting at the same round (the split's sizes come with a round's result, the same
            # on every rank); one before it, to be safe.
            first = max(self._discarded_through + 1, self._counted_from - 1)
            counts = range(first, round_index + 2) if self._counting and self.rank == 0 else None
        if counts and self._control is not None:
            # The rounds' counts no _after_round discarded (the flush's, one counted past the last): nothing counts
            # any more. (No finish follows a round that carried a stop: its count stays with the fit's store.)
            self._control.delete_samples(counts)
        due = self._take_due(limit=round_index)
        return due + [last]

    def flush(self, tensors: Optional[Tensors] = None) -> RoundResult:
        """Not available: a :class:`DelayedAllreduce` ends with :meth:`finish` at an agreed round."""
        raise RuntimeError(f"rank {self.rank}: DelayedAllreduce ends with finish(), not flush()")

    # ------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """Round counter, pending samples and gradient sums, unapplied results, global samples.

        Take it after :meth:`pause` and :meth:`drain` (nothing in flight). On CUDA the
        unapplied results were written on the engine's side stream: each is read only
        after its round's completion event (bounded by the timeout), never half-written.
        """
        self._await_published(self._handed, "for a checkpoint")
        state = super().state_dict()
        with self._cond:
            deposits = self._deposits()
            state["step"] = self._snapshotted + 1
            state["pending_samples"] = [d.samples for d in deposits]
            state["pending_first"] = [d.first_step for d in deposits]
            state["unapplied"] = [
                {"round": x.round_index, "flats": [f.detach().clone().cpu() for f in self.layout.data(x.buffers)],
                 "counts": list(x.stats.counts), "divisor": x.stats.divisor,
                 # What the strategy and the callbacks act on as the round is applied (rank 0's clock
                 # decisions: time-based saves; AdaptiveBatchSize's measurements): the same on every rank.
                 "announced": x.stats.announced, "synchronous": x.stats.synchronous, "busy": list(x.stats.busy)}
                for x in self._published(self._handed) + self._restored
            ]
            state["global_samples"] = self._global_samples
            # Where the epochs ended and the finish began: a resumed fit decides its epoch-end arrivals
            # (abs_sgd) and its first fresh round from them as the fit that saved it did.
            state["epoch_end_rounds"] = dict(self._epoch_end_rounds)
            state["sync_from"] = self._sync_from
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        known = list(zip(state.get("pending_samples", []), state.get("pending_first", [])))
        self._pending = [
            SampleDeposit(d.flats, d.step, samples=int(known[i][0]), first_step=known[i][1]) if i < len(known)
            else SampleDeposit(d.flats, d.step)
            for i, d in enumerate(self._pending)
        ]
        self._global_samples = int(state.get("global_samples", 0))
        self._handed = self._completed = self.step - 1
        self._epoch_end_rounds = {int(e): int(r) for e, r in state.get("epoch_end_rounds", {}).items()}
        if self.step > 0 and self._ends_fit(self.step - 1):
            # Saved after the final round (a save at the last batch's start, or at the end of fit): by this
            # fit's own limits it is still the final one, and no round follows it but the finish's (a resumed
            # fit with a later limit goes on). A finish request (a time limit) is the new fit's to make again.
            self._final_round = self.step - 1
        restored = []
        for item in sorted(state.get("unapplied", []), key=lambda u: u["round"]):
            flats = self.layout.from_data(item["flats"])
            counts = tuple(int(c) for c in item["counts"])
            stats = RoundStats(
                round_index=int(item["round"]), activator=-1, initiator=None,
                synchronous=bool(item.get("synchronous", False)), flush=False, announced=int(item.get("announced", 0)),
                busy=tuple(float(b) for b in item.get("busy", ())),
                fresh=(), counts=counts, staleness=tuple(None for _ in counts),
                oldest_staleness=tuple(None for _ in counts), progress=(), dropped=(),
                # The saved result was divided when it was computed: its divisor is recorded, not recomputed.
                contributions=sum(counts), divisor=float(item.get("divisor", self._divisor(sum(counts)))),
            )
            restored.append(RoundResult(round_index=int(item["round"]), tensors=self.layout.unflatten(flats),
                                        stats=stats, buffers=flats, layout=self.layout))
        self._restored = restored
        if self._sync_from == 0 and self._resumes_a_delayed_fit(state, restored):
            # Synchronous throughout, resumed with what a delayed fit left pending or unapplied: the
            # resumed round holds gradients computed before those results are applied, fresh from the next.
            self._sync_from = self.step
        threshold = self.delayed.sync_from_samples
        if threshold is not None and self._global_samples >= threshold:
            # Saved in the finish (or right at its start): it goes on from the next round. The
            # threshold, not a saved round, decides: a resumed fit may end later or earlier. Where the
            # saved fit's finish had begun already, it began there: its rounds since were lock-step, so the
            # resumed round is fresh as it would have been (a checkpoint saves nothing unapplied then).
            saved = state.get("sync_from")
            began = saved if isinstance(saved, int) and 0 < saved < self.step else self.step
            self._sync_from = began if self._sync_from is None else min(self._sync_from, began)

    def _ends_fit(self, r: int) -> bool:
        """Under ``self._cond`` (or before start): round ``r``, with the global samples counted to its end, is the
        fit's last by ``max_rounds`` or ``max_epochs`` (a finish request aside)."""
        d = self.delayed
        return (d.max_rounds is not None and r + 1 >= d.max_rounds) or (
            d.max_epochs is not None and d.epoch_samples is not None
            and self._global_samples >= d.max_epochs * d.epoch_samples)

    def _resumes_a_delayed_fit(self, state: dict[str, Any], restored: list[RoundResult]) -> bool:
        """Whether ``state`` comes from a fit whose latest rounds were delayed (not lock-step): decided from what
        every rank's state says alike (where that fit's finish began), so that every rank decides the same
        however a new world size dealt out the send buffers. Such a fit's first resumed round is taken as one
        round late even where no rank held anything (rare: rank 0's last result is almost always still to be
        applied at a save): one round's staleness rule, the same on every rank. A checkpoint from before that
        was saved: from this rank's own restored results and send buffer, as then."""
        if "sync_from" not in state:
            return bool(restored or any(d.samples for d in self._deposits()))
        began = state["sync_from"]
        return began is None or began >= self.step

    def _divisor(self, total: int) -> float:
        """The round's samples, or ``reference_samples`` when set (communication thread; restore)."""
        if self.delayed.reference_samples is not None:
            return float(self.delayed.reference_samples)
        return super()._divisor(total)

    # ------------------------------------------------------ caller's thread
    def _deposits(self) -> list[SampleDeposit]:
        """Under ``self._cond``: the send buffer (deposit() and load_state_dict() only put SampleDeposits there)."""
        return cast(list[SampleDeposit], self._pending)

    def _synchronous_round_reached(self, q: int, through: int, waiting: str) -> bool:
        """Under ``self._cond``: ``through`` (the last round completed, or taken) has reached round ``q``, or a stop
        ended the rounds; raises if failed, or if closed while ``waiting`` (named in the error)."""
        self._raise_if_failed(q)
        if self._closing:
            raise EngineClosedError(f"close() was called while {waiting}", rank=self.rank, round_index=q)
        return through >= q or self._stop_round is not None

    def _held_round(self) -> Optional[int]:
        """Under ``self._cond``: the synchronous round this rank holds micro-batches for, not arrived at yet."""
        q = self._snapshotted + 1
        return q if self._pending and self._known_sync(q) and self._final_round is None else None

    def _mark_arrival(self, q: int) -> None:
        """Under ``self._cond``: this rank arrives at synchronous round ``q`` with its send buffer."""
        self._step = q + 1  # the arrival the communication thread waits for (RoundRunner)
        self._cond.notify_all()

    def _behind(self, q: int) -> bool:
        """Under ``self._cond``: arriving at synchronous round ``q`` now would come before this rank's caller was
        handed every round before ``q - 1``.

        Only at the switch to the synchronous finish: a rank whose micro-batch spanned the last
        asynchronous rounds deposits next into the first synchronous one with completed rounds not yet
        handed, while the other ranks had each of those rounds handed at a micro-batch boundary of
        their own, and may act on them collectively there before they arrive (abs_sgd: a step
        checkpoint's save). Arriving would wait for them, and they for it. Held instead, its
        micro-batch joins its next arrival, made after the caller has applied those rounds: every
        rank's caller then arrives at the first synchronous round having been handed the same
        rounds (all before ``q - 1``). Never once a stop ended the rounds (nothing waits then).
        A resumed fit's results restored from its checkpoint are not handed until a deposit hands them: on
        every rank the rounds handed are those before the first of them, as in the fit that saved it.
        """
        return self._handed_through() < q - 2 and self._stop_round is None

    def _epoch_ended(self, epoch: Optional[int]) -> bool:
        """Under ``self._cond``: the completed rounds have ended epoch ``epoch`` (``None``: no epoch given)."""
        n = self.delayed.epoch_samples
        return epoch is not None and n is not None and self._global_samples >= (epoch + 1) * n

    def _outstanding_overlap(self) -> Optional[int]:
        """Under ``self._cond``: the round this rank arrived at without waiting and has not been handed yet, if any."""
        return self._overlapped if self._overlapped > self._handed_through() else None

    def _may_overlap(self, q: int) -> bool:
        """Under ``self._cond``: whether an arrival at synchronous round ``q`` may go on without waiting for it: not
        once a stop or the final round is known (no round follows them), nor while closing. Every round before
        ``q`` was handed (and completed) before this rank arrives at ``q``, and ``q`` cannot complete without
        this rank: the decision reads the rounds before ``q`` only, the same on every rank. (Handed because the
        deposit after going on is held, and because ``abs_sgd`` goes on only under ``AdaptiveBatchSize``'s arrival
        by samples or by time, set after a window of synchronous rounds: never at the switch, where
        :meth:`_behind` holds an arrival while older rounds are unhanded.)
        """
        return self._stop_round is None and self._final_round is None and not self._closing

    def _await_taken(self, q: int) -> list[RoundResult]:
        """Caller's thread, after arriving at synchronous round ``q`` without waiting for it (``deposit(wait=False)``):
        returns once this rank's communication thread has taken the round (its send buffer), so that the next
        micro-batch goes into round ``q + 1``. Its result is handed at the next deposit. Nothing else is due:
        every round before ``q`` was handed before this rank arrived."""
        self._caller_wait(
            lambda: self._synchronous_round_reached(q, self._snapshotted, f"synchronous round {q} was being taken"),
            q, f"synchronous round {q} was not taken (is this rank's communication thread stalled?)")
        with self._cond:
            limit = q - 1 if self._stop_round is None else min(q - 1, self._stop_round)
        return self._take_due(limit=limit)

    def _await_synchronous(self, q: int) -> list[RoundResult]:
        """Caller's thread, after arriving at synchronous round ``q``: waits for it; returns the results due."""
        # Every rank arrives at round q; the round waits for the slowest.
        self._caller_wait(
            lambda: self._synchronous_round_reached(q, self._completed, f"waiting for synchronous round {q}"),
            q, f"synchronous round {q} did not complete (is a rank dead or stalled?)")
        with self._cond:
            limit = q if self._stop_round is None else min(q, self._stop_round)
        return self._take_due(limit=limit)

    def _known_sync(self, round_index: int) -> bool:
        """The base class's rule, and every round of the synchronous finish (under ``self._cond`` or its thread)."""
        return super()._known_sync(round_index) or (self._sync_from is not None and round_index >= self._sync_from)

    def _trigger_met(self, pending: int) -> bool:
        if self._final_round is not None or pending < 1:
            return False
        if self.delayed.trigger == "samples":
            return pending >= int(self.delayed.target_samples)  # type: ignore[arg-type]
        return time.monotonic() - self._contributed_at >= float(self.delayed.interval)  # type: ignore[arg-type]

    def _caller_wait(self, done: Callable[[], bool], r: int, what: str) -> None:
        """Caller's thread: :meth:`_wait_on_cond`, its duration added to the wait the next result handed carries."""
        began = time.perf_counter()
        try:
            self._wait_on_cond(done, r, what)
        finally:
            self._blocked += time.perf_counter() - began

    def _take_due(self, *, limit: int) -> list[RoundResult]:
        """Results not handed yet, up to round ``limit``, in order (restored ones first).

        The last of them carries, as its stats' ``wait_time``, the seconds the caller was blocked in
        :meth:`deposit` and :meth:`drain` since the previous result was handed (the wait is for the
        round it follows, or for that round itself in a synchronous round): per rank, as ``PartialAllreduce``
        reports its caller's time in ``arrive``.
        """
        due, self._restored = self._restored, []
        with self._cond:
            rounds = list(range(self._handed + 1, limit + 1))
            published = {x.round_index for x in self._published(self._handed)}
            for r in rounds:
                if r not in published:
                    raise RuntimeError(f"rank {self.rank}: round {r} has no result to hand over")
            if rounds:
                self._handed = rounds[-1]
        due.extend(self._take_result(r) for r in rounds)
        if due and self._blocked:
            last = due[-1]
            due[-1] = dataclasses.replace(
                last, stats=dataclasses.replace(last.stats, wait_time=last.stats.wait_time + self._blocked))
            self._blocked = 0.0
        return due

    # ---------------------------------------------------- communication thread
    def _may_activate(self, r: int) -> bool:
        return (self._requested and not self._paused and self._final_round is None and not self._closing
                and not self._known_sync(r))

    def _await_activation(self, r: int) -> None:
        assert self._control is not None
        deadline = time.monotonic() + self.config.timeout.total_seconds()
        while True:
            with self._activation_lock:
                with self._cond:
                    if self._no_activation_needed(r) or self._activation_claimed(r):
                        return  # claimed already: _after_round activated it
                    activate = self._may_activate(r)
                    if activate:
                        self._claim_activation(r)
                if activate:
                    self._control.activate_from_comm(r)
                    return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise PartialCollectiveTimeout(
                    f"round {r} was not activated within {self.config.timeout.total_seconds():g}s "
                    "(no rank requested it: is a rank dead or stalled?)", rank=self.rank, round_index=r
                )
            self._control.wait_activated(r, timedelta(seconds=remaining))
            with self._cond:
                if self._no_activation_needed(r):
                    return
            if not self._control.only_woken(r):
                return  # another rank activated it
            with self._cond:
                retry_now = self._may_activate(r)
            if not retry_now:
                # Woken by our caller but paused meanwhile: the key stays set, so poll gently
                # until resume() or another rank's activation (rare: only around a checkpoint).
                time.sleep(0.005)

    def _on_snapshot(self, r: int, deposits: list[Deposit]) -> None:
        # Under self._cond, at the snapshot: the request (if any) is served by this round.
        self._requested = False
        self._contributed_at = time.monotonic()

    def _busy(self, deposits: list[Deposit]) -> float:
        """Header column: the caller's seconds of work behind the micro-batches taken."""
        return sum(cast(SampleDeposit, d).busy for d in deposits)

    def _describe_contribution(self, deposits: list[Deposit]) -> tuple[int, int, int]:
        """Header columns: the samples summed, the newest step, the oldest micro-batch's round."""
        if not deposits:
            return 0, -1, -1
        taken = cast(list[SampleDeposit], deposits)
        first = [d.first_step if d.first_step is not None else d.step for d in taken]
        return sum(d.samples for d in taken), max(d.step for d in taken), min(first)

    def _after_round(self, r: int, result: RoundResult) -> None:
        with self._activation_lock:
            with self._cond:
                d = self.delayed
                epochs = self._global_samples // d.epoch_samples if d.epoch_samples else 0
                self._samples_before_last = self._global_samples
                self._global_samples += int(result.stats.contributions)
                if d.epoch_samples:
                    for epoch in range(epochs, self._global_samples // d.epoch_samples):
                        self._epoch_end_rounds[epoch] = r
                if (d.sync_from_samples is not None and self._global_samples >= d.sync_from_samples
                        and (self._sync_from is None or self._sync_from > r + 1)):
                    # Every rank decides it from the same headers; sync_from and sync_from_samples both
                    # given: whichever comes first (only ever moved earlier, to the round not yet taken).
                    self._sync_from = r + 1
                if self._ends_fit(r) or result.stats.finish:
                    self._final_round = r
                discard = self._counting and self.rank == 0 and result.stats.synchronous
                if discard:
                    self._discarded_through = r
                activate = self._may_activate(r + 1)
                if activate:
                    self._claim_activation(r + 1)
                self._completed = r
                self._cond.notify_all()
            if discard:
                # Every rank counted into round r before arriving at it: nobody adds to its count again.
                assert self._control is not None
                self._control.discard_samples(r)
            if activate:
                assert self._control is not None
                self._control.activate_from_comm(r + 1)

