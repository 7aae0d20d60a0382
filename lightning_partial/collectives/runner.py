"""The communication thread's round runner, and the hooks through which engines change a round.

:meth:`RoundRunner._run` runs rounds ``0, 1, 2, ...`` in order, each exactly
once: it waits until the round is activated (:meth:`~RoundRunner._await_activation`),
or, for a round every rank knows to be synchronous, until its own rank arrived;
takes the send buffer under the engine's lock (:meth:`~RoundRunner._snapshot`,
which builds the round's :class:`~lightning_partial.collectives.rounds.RoundContext`),
issues the round's collectives (:meth:`~RoundRunner._reduce`) and publishes the
result for the caller's thread.

The hooks, each on the communication thread and given the round's context,
return what the next one needs:

* :meth:`~RoundRunner._await_activation`: how the round gets activated;
* :meth:`~RoundRunner._on_snapshot` (under the lock), :meth:`~RoundRunner._weigh`,
  :meth:`~RoundRunner._describe_contribution`: what this rank's row of the header says;
* :meth:`~RoundRunner._send_buffer`: the flat buffers this rank contributes;
* :meth:`~RoundRunner._start_data` / :meth:`~RoundRunner._finish_data`: which data
  collectives the round issues, and how their outcome becomes the result's buffers;
* :meth:`~RoundRunner._divisor`, :meth:`~RoundRunner._result`: the normalisation and the result's type;
* :meth:`~RoundRunner._after_round`: what follows a published round.
"""

from __future__ import annotations

import functools
import logging
import operator
import time
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor

from lightning_partial.collectives import header
from lightning_partial.collectives.errors import EngineClosedError, PartialCollectiveError, PartialCollectiveTimeout
from lightning_partial.collectives.groups import EngineGroups
from lightning_partial.collectives.layout import TensorLayout
from lightning_partial.collectives.results import RoundResult
from lightning_partial.collectives.rounds import DataOutcome, DataRound, Deposit, Issued, RoundContext
from lightning_partial.collectives.stats import RoundStats

log = logging.getLogger(__name__)


class RoundRunner(EngineGroups):
    """Mixin of :class:`~lightning_partial.collectives.PartialAllreduce`: the communication thread.

    It reads and writes the engine's shared state only under ``self._cond``
    (see ``PartialAllreduce.__init__``), issues every collective of a round on
    the group it names (:class:`~lightning_partial.collectives.groups.EngineGroups`),
    and never blocks without a bound: a wait for the activation or for its own
    rank's arrival is bounded by ``config.timeout``, a collective by the
    round's bound; each raises naming rank and round.
    """

    layout: TensorLayout
    _fused_header: bool
    _step: int
    _snapshotted: int
    _pending: list[Deposit]
    _dropped: int
    _activated_here: set[int]
    _flush_round: Optional[int]
    _results: dict[int, Union[RoundResult, BaseException]]
    _stop_round: Optional[int]
    _waiting_round: Optional[int]
    _stop_requested: bool
    _finish_requested: bool
    _sync_requested: bool
    _requested_sync_from: Optional[int]
    _announce: int
    _in_round: bool
    _done_events: dict[int, torch.cuda.Event]
    _control: Any
    _liveness: Any
    _liveness_engine: Optional[int]  # the engine's index in its heartbeat's engine_rounds (attach_liveness)
    # When this thread issued the current round's collectives (None outside _reduce): see _explain.
    _reduce_began: Optional[float] = None

    def _run(self) -> None:
        if self._cuda_device is not None:  # pragma: no cover - needs GPUs
            torch.cuda.set_device(self._cuda_device)
        r = self._snapshotted + 1
        control = self._control
        assert control is not None
        try:
            while True:
                with self._cond:
                    if self._closing:
                        return
                    self._waiting_round = r
                began = time.monotonic()
                synchronous = self._known_sync(r)
                if synchronous:
                    self._wait_own_arrival(r)
                else:
                    self._await_activation(r)
                context = self._snapshot(r, synchronous, began=began, activated=time.monotonic())
                if context is None:
                    return
                self._reduce_began = time.monotonic()
                result = self._reduce(context)
                self._reduce_began = None
                with self._cond:
                    self._results[r] = result
                    self._in_round = False
                    if result.stats.stop:
                        self._stop_round = r
                    if result.stats.sync_from is not None:
                        # Before the result is published: the caller that collects round r, and this
                        # thread in round r + 1, already count the requested rounds as synchronous.
                        self._requested_sync_from = result.stats.sync_from
                    self._cond.notify_all()
                control.collect(r, activated_through_store=not synchronous)
                if result.stats.flush or result.stats.stop:
                    return
                self._after_round(r, result)
                r += 1
        except BaseException as err:  # noqa: BLE001 - handed to the caller's thread
            err = self._explain(err)
            with self._cond:
                if self._closing:
                    return
                if not isinstance(err, PartialCollectiveError):
                    err = PartialCollectiveError(f"{type(err).__name__}: {err}", rank=self.rank, round_index=r)
                if self._error is not None:
                    # The first failure is the cause (the CompletionWatch's timeout, which aborted
                    # the group this thread's collective then failed on): keep it.
                    log.debug("rank %d: after %s: %s", self.rank, self._error, err)
                    return
                self._error = err
                self._cond.notify_all()
            log.error("%s", err)

    def _snapshot(self, r: int, synchronous: bool, *, began: float, activated: float) -> Optional[RoundContext]:
        """Takes round ``r``'s send buffer and fills this rank's header row; ``None`` if the engine is closing."""
        with self._cond:
            if self._closing:
                return None
            self._waiting_round = None
            self._in_round = True
            # A deposit of a later step stays for its own round: a caller that submits without
            # collecting (overlap) may deposit step r + 1 before this thread has taken round r.
            deposits = [d for d in self._pending if d.step <= r]
            self._pending = [d for d in self._pending if d.step > r]
            self._snapshotted = r
            flush = self._flush_round == r
            # Activated through the store: every rank's thread enters this round's collectives
            # now, however slow its compute. Otherwise (sync rounds, the flush) they wait for it.
            prompt = not synchronous and not flush
            self._round_bound = self.config.collective_bound if prompt else self.config.timeout
            self._cond.notify_all()  # DelayedAllreduce.deposit waits for the snapshot
            self._on_snapshot(r, deposits)
            row = header.empty(self.world_size)
            own = row[self.rank]
            count, newest, oldest = self._describe_contribution(deposits)
            own[header.COUNT] = count
            own[header.NEWEST] = newest + 1
            own[header.OLDEST] = oldest + 1
            own[header.ACTIVATED] = int(r in self._activated_here)
            self._activated_here.discard(r)
            own[header.FLUSH] = int(flush)
            own[header.PROGRESS] = self._step
            own[header.DROPPED] = self._dropped
            own[header.STOP] = int(self._stop_requested)
            own[header.FINISH] = (header.FINISH_FIT if self._finish_requested else 0) | (
                header.FINISH_SYNC if self._sync_requested else 0)
            self._sync_requested = False  # a request rides exactly one round
            own[header.ANNOUNCED] = self._announce  # each announcement rides exactly one round
            self._announce = 0
            own[header.DISCOUNT] = round(self._weigh(r, deposits) * header.DISCOUNT_SCALE)
            own[header.BUSY] = round(max(self._busy(deposits), 0.0) * header.BUSY_SCALE)
            self._dropped = 0
        # Whether every rank takes part in the data collective with the same role
        # (GroupAverage: a global average). Known locally: the flush round is the
        # same step on every rank (checked in _reduce), sync_every rounds are fixed.
        return RoundContext(
            index=r, row=row, deposits=deposits, flush=flush, global_round=flush or self._sync_round(r),
            began=began, activated=activated,
        )

    def _reduce(self, ctx: RoundContext) -> RoundResult:
        """Issues the round's allreduces, the header's and the data's, and builds the result.

        With ``_fused_header`` the header rides in the data allreduce; otherwise
        it is an allreduce on the gloo header group, in flight with the data.
        In pure ``sync`` mode only the final flush carries a header.
        """
        r, row = ctx.index, ctx.row
        flats = self._send_buffer(ctx)
        header_work: Optional[Issued] = None
        fused = False
        if self.config.mode == "sync" and not ctx.flush:
            # Pure sync mode: every rank contributed exactly its fresh gradient,
            # so the header is known without a collective (a tiny allreduce costs
            # as much latency as a large one on a loaded host).
            row[:, header.COUNT] = 1
            row[:, header.NEWEST] = row[:, header.OLDEST] = row[:, header.PROGRESS] = r + 1
        elif self._fused_header:
            fused = True
            header.encode(row, self.layout.tail_of(flats))
        else:
            header_work = self._start(self._header_pg, row, r, "header")
        data = self._start_data(ctx, flats)
        if header_work is not None:
            self._finish(header_work, r)
            # Checked before waiting on the data: a rank that flushes alone runs
            # another data collective than the others (GroupAverage: a global
            # allreduce against their group send/recv), which would only end
            # at the timeout. Every rank sees the same header and raises here.
            header.check_flush(row, rank=self.rank, round_index=r)
        for issued in data.works:
            self._finish(issued, r)
        summed = row
        if fused:
            summed = header.decode(self.layout.tail_of(flats), self.world_size)
            header.check_flush(summed, rank=self.rank, round_index=r)
        outcome = self._finish_data(ctx, flats, data, summed)
        if self._stream is not None:  # pragma: no cover - needs GPUs
            event = torch.cuda.Event()
            event.record(self._stream)
            with self._cond:
                self._done_events[r] = event
            if self._watch is not None:
                self._watch.add(r, event, seconds=self._round_bound.total_seconds())
        return self._result(ctx, flats, outcome, self._stats(ctx, summed, outcome))

    def _stats(self, ctx: RoundContext, summed: Tensor, outcome: DataOutcome) -> RoundStats:
        """The round's statistics, from the summed header (identical on every rank)."""
        r = ctx.index
        flushing = summed[:, header.FLUSH].tolist()
        counts = summed[:, header.COUNT].tolist()
        newest = summed[:, header.NEWEST].tolist()
        oldest = summed[:, header.OLDEST].tolist()
        activators = [i for i, a in enumerate(summed[:, header.ACTIVATED].tolist()) if a]
        finishing = summed[:, header.FINISH].tolist()
        return RoundStats(
            round_index=r,
            activator=activators[0] if activators else -1,
            initiator=None,
            synchronous=bool(flushing[0]) or self._known_sync(r),
            flush=bool(flushing[0]),
            fresh=tuple(i for i, n in enumerate(newest) if n - 1 == r),
            counts=tuple(int(c) for c in counts),
            staleness=tuple(r - (n - 1) if c else None for c, n in zip(counts, newest)),
            oldest_staleness=tuple(r - (o - 1) if c else None for c, o in zip(counts, oldest)),
            progress=tuple(int(p) for p in summed[:, header.PROGRESS].tolist()),
            dropped=tuple(int(d) for d in summed[:, header.DROPPED].tolist()),
            discounted=tuple(int(d) / header.DISCOUNT_SCALE for d in summed[:, header.DISCOUNT].tolist()),
            busy=tuple(int(b) / header.BUSY_SCALE for b in summed[:, header.BUSY].tolist()),
            stop=bool(summed[:, header.STOP].any()),
            finish=any(int(f) & header.FINISH_FIT for f in finishing),
            # The first request only (every rank has applied the earlier rounds' the same way).
            sync_from=r + self.sync_margin if self._requested_sync_from is None and any(
                int(f) & header.FINISH_SYNC for f in finishing) else None,
            announced=functools.reduce(operator.or_, (int(a) for a in summed[:, header.ANNOUNCED].tolist()), 0),
            contributions=int(sum(counts)),
            divisor=outcome.divisor,
            activation_latency=ctx.activated - ctx.began,
            activated_at=ctx.activated,
            **outcome.stats_fields(),
        )

    def _known_sync(self, round_index: int) -> bool:
        """Whether every rank knows in advance that ``round_index`` is synchronous.

        Such a round needs no activation through the store: each communication
        thread enters the collective as soon as its own rank has arrived, and the
        collective itself waits for everybody. (The final flush is synchronous
        too, but not known in advance: flush() wakes its own thread instead.)
        """
        return self.config.mode == "sync" or self._sync_round(round_index)

    def _sync_round(self, round_index: int) -> bool:
        """Whether ``round_index`` is a synchronous round of the configuration's (``sync_every``, ``sync_from``)
        or of a synchronous finish requested in an earlier round (``request_sync``)."""
        requested = self._requested_sync_from
        return self.config.is_sync_round(round_index) or (requested is not None and round_index >= requested)

    @property
    def sync_margin(self) -> int:
        """How many rounds after the round that carries a ``request_sync`` the synchronous rounds begin.

        Every rank must know a round is synchronous before it decides anything about it, and
        a caller decides about round ``q`` (its activation) and ``q + s`` (the staleness gate
        ``s``) when it submits step ``q``, by which time it has collected round ``q - 1``, or
        ``q - 2`` when it submits before collecting (``overlap``): ``s + 2`` rounds later, every
        rank has the request's round before any decision about the first synchronous one.
        """
        s = getattr(self.config, "max_staleness", None)
        return (s or 0) + 2

    def _explain(self, err: BaseException) -> BaseException:
        """A collective that failed: the heartbeat's verdict naming the rank gone, if one comes soon.

        Any failure, not only a timeout: a survivor that read the verdict first and
        exited closes its connections, and the others' collectives then fail with
        "connection closed" before they have read it. A timeout waits up to two
        beats, in which the heartbeat may name the rank that stopped. So does a
        failure that comes when the round's collectives have waited about as long as
        their bound (within two beats of it): that is a peer's own timeout seen from
        this side (gloo closes a timed-out context's connections), and the verdict
        on the stalled rank follows within a beat or two. Any other failure (a
        connection closed or reset early in the round: a peer's process is gone, its
        heartbeat silent for moments) can only find a verdict some rank already
        published: one fresh read of the store, not two beats (10 s at the default
        ``collective_timeout``, per engine, before the error surfaced).
        """
        liveness = self._liveness
        if liveness is None or not isinstance(err, PartialCollectiveError) or isinstance(err, EngineClosedError):
            return err
        began = self._reduce_began
        near_bound = (began is not None and time.monotonic() - began
                      >= self._round_bound.total_seconds() - 2 * liveness.interval)
        verdict = liveness.verdict_after_failure(timed_out=isinstance(err, PartialCollectiveTimeout) or near_bound)
        if verdict is None:
            return err
        # One prefix: the verdict's (this rank, its progress) and err's (this rank, this round) would repeat
        # what this one says. A timeout stays one (as the strategies' explained collectives: naming_failure).
        kind = PartialCollectiveTimeout if isinstance(err, PartialCollectiveTimeout) else PartialCollectiveError
        named = kind(f"{verdict.detail} (then: {err.detail})", rank=self.rank, round_index=err.round_index)
        named.__cause__ = err
        return named

    def _wait_own_arrival(self, r: int) -> None:
        self._wait_on_cond(
            lambda: self._step > r or self._closing, r, f"this rank did not arrive at synchronous round {r}"
        )

    def _wait_on_cond(self, done: Callable[[], bool], r: int, what: str) -> None:
        """Waits on ``self._cond`` until ``done()``, at most ``config.timeout``; raises naming rank and round."""
        timeout = self.config.timeout.total_seconds()
        deadline = time.monotonic() + timeout
        with self._cond:
            while not done():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(timeout=remaining)
            else:
                return
        # Outside the lock: reading the heartbeats takes store calls.
        raise PartialCollectiveTimeout(f"timed out after {timeout:g}s: {what}{self._rounds_reported()}",
                                       rank=self.rank, round_index=r)

    def _rounds_reported(self) -> str:
        """For a wait that timed out: the ranks behind the others by their last heartbeats (each reports the
        round it has reached), or nothing (no heartbeat, none behind, or no answer within 5 s)."""
        liveness = self._liveness
        reached = liveness.reported_rounds(engine=self._liveness_engine) if liveness is not None else {}
        if not reached:
            return ""
        top = max(reached.values())
        behind = [f"rank {r} (round {v})" for r, v in sorted(reached.items()) if v < top]
        return f"; behind by their last heartbeats: {', '.join(behind)}, the others at round {top}" if behind else ""

    # -------------------------------------------------- activation (protected)
    def _no_activation_needed(self, r: int) -> bool:
        """Under ``self._cond``: the engine is closing, or ``r`` is the flush round (its caller wakes the thread)."""
        return self._closing or self._flush_round == r

    def _activation_claimed(self, r: int) -> bool:
        """Under ``self._cond``: whether this rank activated round ``r`` (its header row will say so)."""
        return r in self._activated_here

    def _claim_activation(self, r: int) -> None:
        """Under ``self._cond``, before activating round ``r`` through the store: its header row will say so."""
        self._activated_here.add(r)

    # ----------------------------------------------------------------- hooks
    def _await_activation(self, r: int) -> None:
        """Blocks until round ``r`` is activated (through the store), at most ``config.timeout``."""
        assert self._control is not None
        self._control.wait_activated(r, self.config.timeout)

    def _on_snapshot(self, r: int, deposits: list[Deposit]) -> None:
        """Under ``self._cond``, as round ``r`` takes ``deposits``: a subclass's own bookkeeping (nothing here)."""

    def _weigh(self, r: int, deposits: list[Deposit]) -> float:
        """Sets each deposit's staleness weight for round ``r``; returns the gradients' worth withheld.

        Under ``self._cond``, at the snapshot; :meth:`_sum_deposits` applies the weights.
        """
        weights = self.config.staleness
        if not weights.active:
            return 0.0
        withheld = 0.0
        for d in deposits:
            d.weight = weights.weight(r - d.step)
            withheld += 1.0 - d.weight
        return withheld

    def _busy(self, deposits: list[Deposit]) -> float:
        """Header column: seconds of the caller's work behind ``deposits`` (0.0: not measured; DelayedAllreduce's)."""
        return 0.0

    def _describe_contribution(self, deposits: list[Deposit]) -> tuple[int, int, int]:
        """Header columns of this rank's contribution: (count, newest step, oldest step); steps -1 if none."""
        if not deposits:
            return 0, -1, -1
        return len(deposits), max(d.step for d in deposits), min(d.step for d in deposits)

    def _send_buffer(self, ctx: RoundContext) -> list[Tensor]:
        """The flat buffers this rank contributes to the round (reduced in place)."""
        return self._sum_deposits(ctx.deposits)

    def _start_data(self, ctx: RoundContext, flats: list[Tensor]) -> DataRound:
        """Starts the round's data collectives: an allreduce of each buffer on the data group."""
        return DataRound([self._start(self._data_pg, flat, ctx.index, "data") for flat in flats])

    def _finish_data(self, ctx: RoundContext, flats: list[Tensor], data: DataRound, summed: Tensor) -> DataOutcome:
        """After the collectives: the result's flat buffers (the sums, divided) and the divisor applied."""
        divisor = self._divisor(int(sum(summed[:, header.COUNT].tolist())))
        if divisor != 1.0:
            with self._side_stream():
                for flat in flats:
                    flat.div_(divisor)
        return DataOutcome(flats, divisor)

    def _divisor(self, total: int) -> float:
        """What a round's sum is divided by, given its ``total`` contributions (``config.normalize``)."""
        normalize = self.config.normalize
        return float(self.world_size if normalize == "world" else max(total, 1) if normalize == "contributors" else 1)

    def _result(self, ctx: RoundContext, sent: list[Tensor], outcome: DataOutcome, stats: RoundStats) -> RoundResult:
        """The round's result (``sent``: what this rank contributed, from :meth:`_send_buffer`)."""
        tensors = self.layout.unflatten(outcome.flats)
        return RoundResult(round_index=ctx.index, tensors=tensors, stats=stats, buffers=outcome.flats, layout=self.layout)

    def _after_round(self, r: int, result: RoundResult) -> None:
        """After round ``r`` was published (not after a flush or stop round)."""

    # -------------------------------------------------------- send buffer
    def _sum_deposits(self, deposits: list[Deposit]) -> list[Tensor]:
        """The send buffer of a round: the deposits' sum, each scaled by its weight, or zeros.

        On CUDA everything runs on the side stream, the one the collective follows. The
        first deposit's buffers become the round's, reduced in place (no copy per round);
        the others go back to the pool once added.
        """
        with self._side_stream():
            if not deposits:
                return self.layout.zeros()
            for d in deposits:
                self._follow(d)
            flats = deposits[0].flats
            self._accumulate(flats, deposits)
            for d in deposits[1:]:
                self.layout.recycle(d.flats)  # on CUDA with an event on the side stream, after the additions
            return flats

    @staticmethod
    def _accumulate(flats: list[Tensor], deposits: list[Deposit]) -> None:
        """``flats`` (a copy of ``deposits[0]``'s, or its own) becomes the weighted sum of the deposits, in place."""
        if deposits[0].weight != 1.0:
            for f in flats:
                f.mul_(deposits[0].weight)
        for d in deposits[1:]:
            for acc, f in zip(flats, d.flats):
                # alpha only when weighted: integer buffers refuse a float alpha.
                acc.add_(f) if d.weight == 1.0 else acc.add_(f, alpha=d.weight)
