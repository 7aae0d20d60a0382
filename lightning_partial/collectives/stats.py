"""Per-round statistics, as seen by one rank after the round completed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True, kw_only=True)
class RoundStats:
    """What happened in one round.

    Everything but ``wait_time`` and ``activation_latency`` comes from the
    header that travels with the round's data, so it is identical on all ranks.

    Attributes:
        round_index: the round (= training step) these statistics describe.
        activator: the rank whose arrival activated the round; ``-1`` for a
            synchronous round, which every rank's arrival activates.
        initiator: the round's initiator in ``"majority"`` mode, else ``None``.
        synchronous: the round waited for every rank (``sync`` mode, a
            ``sync_every`` round, a round from ``sync_from`` on, or the final flush).
        flush: the round is a final flush.
        stop: some rank requested a stop (``request_stop``): this is the last round.
        finish: some rank asked every rank to end its fit after this round (``request_finish``);
            unlike ``stop``, the rounds go on (the final flush among them) until the caller ends.
        sync_from: set in the round that carried the first ``request_sync``: every round from this
            index on is synchronous (the same index on every rank); ``None`` in every other round.
        announced: the caller-defined bits that ranks announced with this round (``announce``), OR-ed
            over the ranks; each announcement is in exactly one round, the same on every rank.
        fresh: ranks whose gradient of this very step was in the round.
        counts: per rank, how many gradients it contributed (0: none).
        staleness: per rank, ``round_index`` minus the step of the newest gradient
            it contributed; ``None`` where it contributed nothing.
        oldest_staleness: per rank, the same for its oldest contributed gradient.
        progress: per rank, how many arrivals it had made when the round was
            snapshotted (its steps done, from its own point of view).
        dropped: gradients dropped by ``late="drop"`` since the previous round, per rank.
        discounted: per rank, the gradients' worth that the staleness weights
            (``PartialAllreduceConfig.staleness``) withheld from this round:
            ``sum(1 - weight)`` over its contributions (0.0 each under rule ``"none"``;
            empty where the engine does not weigh).
        busy: per rank, the seconds its caller worked on what it contributed, outside
            the engine's waits (:class:`~lightning_partial.collectives.delayed.DelayedAllreduce`:
            from each deposit's return to the next deposit, summed over the micro-batches
            in the round; to the microsecond): everything the caller did in between, its
            optimizer step, and a validation when one came between; not the time paused
            (a checkpoint's agreement and save: counted from ``resume``). 0.0 where the
            engine does not measure it; empty for results restored from a checkpoint.
        contributions: total gradients summed in the round.
        divisor: what the sum was divided by (1 for ``normalize="sum"``).
        wait_time: seconds this rank's caller was blocked in ``arrive``/``flush``;
            under :class:`~lightning_partial.collectives.delayed.DelayedAllreduce`, in
            ``deposit``/``drain`` since the previous result it was handed (the last
            result a call hands carries it).
        activation_latency: seconds between this rank's communication thread
            starting to wait for the round and the round being activated,
            or ``0.0`` if it was already active.
        activated_at: ``time.monotonic()`` on this rank when its communication
            thread saw the activation (a system-wide clock on one machine: the
            benchmarks compare it across ranks to measure activation latency).
        arrived_at: ``time.monotonic()`` when this rank's caller arrived.
        skipped: this rank's caller arrived at the round's step without a gradient
            (:meth:`~lightning_partial.collectives.PartialAllreduce.skip`: eager-SGD's
            ``catch_up``, the step's round had run without it); this rank's own figure.
        group: group averaging (:class:`~lightning_partial.collectives.GroupAverage`)
            only: the members of this rank's group in the round (all ranks in a
            global round); ``None`` for a partial allreduce.
        group_id: the index of that group in the schedule's partition (``-1``: global).
        averaged: the members whose models the group sum holds: those with a model
            not contributed before (``stale="skip"``), or the whole group (``"resend"``).
        consensus: the consensus distance of the contributed models, measured in
            this round (``mean_i ||w_i - mean||^2`` over all ranks), or ``None``.
    """

    round_index: int
    activator: int
    initiator: Optional[int]
    synchronous: bool
    flush: bool
    stop: bool = False
    finish: bool = False
    sync_from: Optional[int] = None
    announced: int = 0
    fresh: tuple[int, ...]
    counts: tuple[int, ...]
    staleness: tuple[Optional[int], ...]
    oldest_staleness: tuple[Optional[int], ...]
    progress: tuple[int, ...]
    dropped: tuple[int, ...]
    discounted: tuple[float, ...] = ()
    busy: tuple[float, ...] = ()
    contributions: int
    divisor: float
    wait_time: float = 0.0
    activation_latency: float = 0.0
    activated_at: float = 0.0
    arrived_at: Optional[float] = None
    skipped: bool = False
    group: Optional[tuple[int, ...]] = None
    group_id: Optional[int] = None
    averaged: Optional[tuple[int, ...]] = None
    consensus: Optional[float] = None

    @property
    def max_staleness(self) -> int:
        """Largest staleness of any contribution of the round (0 if none is stale)."""
        values = [s for s in self.oldest_staleness if s is not None]
        return max(values) if values else 0

    @property
    def discounted_total(self) -> float:
        """The gradients' worth withheld from the round by staleness weights, over all ranks."""
        return float(sum(self.discounted))

    @property
    def mean_staleness(self) -> float:
        """Mean staleness over the ranks that contributed (newest gradient each)."""
        values = [s for s in self.staleness if s is not None]
        return sum(values) / len(values) if values else 0.0
