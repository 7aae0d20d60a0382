"""GroupAverage: wait-avoiding group model averaging (WAGMA-SGD, DS-Sync) over the engine's rounds.

The rounds, their activation (solo, majority, quorum, sync, ``sync_every``,
``max_staleness``), the round header, ``request_stop`` and the final flush are
:class:`~lightning_partial.collectives.PartialAllreduce`'s. What differs:

* **What a rank contributes.** Its *model* as of its latest arrival (the send
  buffer). A newer arrival replaces it. When the rank has not arrived since
  the previous round it took part in, ``stale="skip"`` (default, **Decision**)
  leaves it out of the group sum: every model enters at most one average. With
  ``stale="resend"`` (the reference codes) its communication thread contributes
  the same model again; a rank far behind then pulls its partners back to its
  old model round after round, and its own (undamped, ``late="carry"``)
  correction adds their progress once per such round: on the benchmark,
  DS-Sync without a periodic global average diverged that way (loss 14 at
  step 100), while with ``"skip"`` it trains like DDP. The model the engine
  was built from counts as contributed (all replicas start equal).
* **How a rank applies the round** (:func:`apply_average`, caller's thread):
  by default every member of a group moves ``1 / (k + 1)`` of the way from its
  contribution to the group average, ``k`` the largest lag in the group's sum
  (**Decision**, ``late="damp"``): the sum of the replicas is conserved, and a
  rank that stays late cannot drift off, whatever its lag.
* **Which data collectives run.** In a group round, point-to-point send/recv
  within the round's group, from the :class:`~lightning_partial.collectives.schedules.Schedule`
  (a pure function of the round index), over the engine's own data process
  group. Every member sums the S received models in member order, so all
  members get bit-identical sums. In a global round (``sync_every``, the
  final flush): an allreduce of the models over all ranks.

Why point-to-point and not one process group per group: a shuffled partition
(DS-Sync) cannot be pre-created (there are P!/((P/G)!^G G!) of them), and
creating a group per round costs a store rendezvous per round. Send/recv over
the one data group needs no group creation after ``start()``; for the butterfly
(S = 2) it is also the optimal exchange (one send and one receive per rank).
Pairs exchange in one global order (lower rank sends first), which cannot
deadlock even with NCCL's blocking sends.

Threads and collectives (the contract): the caller's thread calls
:meth:`GroupAverage.arrive` with its model after each local step and applies
the result with :func:`apply_average`; it never issues a collective. The
communication thread runs every round: the int64 header allreduce on the
gloo header group (all ranks), then the group's send/recv (or the global
allreduce) on the data group, and, in rounds that measure the consensus
distance, one more allreduce of the models and one float64 scalar allreduce.

Consensus distance: ``mean_i ||w_i - mean_j w_j||^2`` over the models the
ranks contributed to a round; measured in every global round and every
``measure_every`` rounds.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_partial.collectives import header
from lightning_partial.collectives.checks import check_int
from lightning_partial.collectives.config import PartialAllreduceConfig
from lightning_partial.collectives.engine import PartialAllreduce, Tensors
from lightning_partial.collectives.results import RoundResult
from lightning_partial.collectives.rounds import DataOutcome, DataRound, Deposit, Issued, RoundContext
from lightning_partial.collectives.schedules import Schedule
from lightning_partial.collectives.stats import RoundStats

log = logging.getLogger(__name__)

AverageNormalization = Literal["group", "reference"]
AVERAGE_NORMALIZATIONS: tuple[str, ...] = ("group", "reference")
AverageLatePolicy = Literal["damp", "carry", "drop"]
AVERAGE_LATE_POLICIES: tuple[str, ...] = ("damp", "carry", "drop")
StalePolicy = Literal["skip", "resend"]
STALE_POLICIES: tuple[str, ...] = ("skip", "resend")


@dataclass(frozen=True, eq=False)
class GroupRoundResult(RoundResult):
    """A :class:`GroupAverage` round's result: the group sum, and what this rank contributed to it.

    Attributes:
        sent: this rank's own contribution to the round (read-only views), which
            :func:`apply_average` pulls the model from; valid until :meth:`release`.
        included: whether it is in the group sum (``stale="skip"`` leaves out a
            model already averaged).
    """

    sent: list[Tensor] = dataclasses.field(default_factory=list, repr=False)
    included: bool = True
    # Called once by release(): the engine may then reuse the buffers ``sent`` shows.
    on_release: Optional[Callable[[], None]] = dataclasses.field(default=None, repr=False, compare=False)

    def _on_release(self) -> None:
        if self.on_release is not None:
            self.on_release()


@dataclass
class _Exchange(DataRound):
    """The data collectives of a group round (``received`` from each peer), or of a global one (``sums``)."""

    group: tuple[int, ...] = ()
    received: dict[int, list[Tensor]] = dataclasses.field(default_factory=dict)
    sums: list[Tensor] = dataclasses.field(default_factory=list)


@dataclass
class _GroupOutcome(DataOutcome):
    """A group round's outcome: its ``RoundStats`` group fields, and whether this rank is in the sum."""

    included: bool = True
    group: tuple[int, ...] = ()
    group_id: int = -1
    averaged: tuple[int, ...] = ()
    consensus: Optional[float] = None

    def stats_fields(self) -> dict[str, Any]:
        return {"group": self.group, "group_id": self.group_id, "averaged": self.averaged, "consensus": self.consensus}


class GroupAverage(PartialAllreduce):
    """Model averaging in groups that change every round (see the module docstring).

    Args:
        config: the rounds' activation and bounds. ``normalize`` must be
            ``"sum"`` (the engine returns group sums; :func:`apply_average`
            normalises) and ``late`` must be ``"carry"`` (a late model is the
            next send buffer, never dropped). ``sync_every=tau`` makes every
            tau-th round a global average.
        schedule: the groups of every round; built for ``world_size`` ranks.
        store, rank, world_size, backend: as for :class:`PartialAllreduce`.
        like: the model's tensors; their *values* at construction are the
            send buffer until the first arrival.
        measure_every: measure the consensus distance every ``n`` rounds
            (rounds ``n-1, 2n-1, ...``) besides every global round; ``None``:
            global rounds only.
        stale: ``"skip"`` (a model enters at most one group sum) or ``"resend"``
            (a late rank's last model is contributed to every round until it arrives).
    """

    _SKIPPABLE = False  # no skip(): a round averages models, which every arrival carries

    # The header must be checked before the data: a rank's data collective depends on
    # its role in the round (group send/recv, or a global average on the flush).
    _FUSE_HEADER = False

    def __init__(
        self,
        config: PartialAllreduceConfig,
        *,
        schedule: Schedule,
        store: dist.Store,
        rank: int,
        world_size: int,
        like: Tensors,
        backend: Optional[str] = None,
        measure_every: Optional[int] = None,
        stale: StalePolicy = "skip",
    ) -> None:
        if stale not in STALE_POLICIES:
            raise ValueError(f"unknown stale policy {stale!r}: expected one of {', '.join(STALE_POLICIES)}")
        if not isinstance(schedule, Schedule):
            raise ValueError(f"schedule must be a Schedule, got {type(schedule).__name__}")
        if isinstance(config, PartialAllreduceConfig):
            if config.normalize != "sum":
                raise ValueError(
                    f"GroupAverage returns group sums: config.normalize must be 'sum', got {config.normalize!r} "
                    "(normalise with apply_average)"
                )
            if config.late != "carry":
                raise ValueError(
                    f"GroupAverage needs late='carry' (a late model is the next send buffer), got {config.late!r}"
                )
            if config.staleness.active:
                # The engine's weights scale gradients; a model scaled by its lag would be a different
                # model. A late model's weight is apply_average's (late="damp").
                raise ValueError(
                    f"GroupAverage sends whole models: config.staleness must be rule 'none', got "
                    f"{config.staleness.rule!r} (apply_average(late='damp') weighs late models)"
                )
        schedule.check_world(world_size)
        check_int("measure_every", measure_every, optional=True)
        super().__init__(config, store=store, rank=rank, world_size=world_size, like=like, backend=backend)
        if self.backend == "gloo" and self._cuda_device is not None:
            raise ValueError("GroupAverage exchanges CUDA tensors point-to-point with backend='nccl' only")
        # A round takes up to P - 1 received models, a sum and a consensus copy from the pool.
        self.layout.max_free = max(self.layout.max_free, world_size + 2)
        self.schedule = schedule
        self.measure_every = measure_every
        self.stale = stale
        # The send buffer: the model as of the latest arrival whose round was taken.
        # Owned by the communication thread once started. Once a newer model replaces
        # it, it is recycled when no unreleased result still shows it as ``sent``.
        self._last_sent: list[Tensor] = self.layout.flatten(self._as_list(like))
        self._sent_users: dict[int, int] = {}  # id(buffer set) -> unreleased results showing it (self._cond)
        self._superseded_at: dict[int, torch.cuda.Event] = {}  # CUDA: id -> event after its last side-stream use
        if self._cuda_device is not None:  # pragma: no cover - needs GPUs
            # Once, at construction: the side stream may read this buffer before any event exists.
            torch.cuda.current_stream(self._cuda_device).synchronize()
        self._last_sent_step = -1

    def start(self) -> "GroupAverage":
        self._last_sent_step = self._step - 1  # the model the engine was built from: after step - 1
        super().start()
        if self._stream is not None:  # pragma: no cover - needs GPUs
            # The side stream reads the initial model (later ones are followed as deposits): the
            # allocator must not reuse its block while it does once a newer model replaces it.
            for f in self._last_sent:
                f.record_stream(self._stream)
        return self

    def flush(self, tensors: Optional[Tensors] = None) -> RoundResult:
        """The final global average of ``tensors`` (this rank's model): required, unlike gradients."""
        if tensors is None:
            raise ValueError(
                f"rank {self.rank}: GroupAverage.flush() needs this rank's model (the final round averages it)"
            )
        return super().flush(tensors)

    # ------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """Round counter and initiator RNG; never models (**Decision**).

        A pending deposit is a whole model that the checkpoint's weights
        supersede: a resumed fit restarts every rank from the checkpoint's
        replica (rank 0's), and its engine sends that model until the first
        arrival. Saving deposits would add ``P`` models to the file and, on a
        resume, mix models of other replicas into the restored one.
        """
        state = super().state_dict()
        state["pending"], state["pending_steps"] = [], []
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores the round counter and the RNG; models pending in ``state`` are ignored (see :meth:`state_dict`)."""
        if state.get("pending"):
            log.warning(
                "rank %d: ignoring %d pending model(s) in the engine state: the restored weights replace them",
                self.rank,
                len(state["pending"]),
            )
        super().load_state_dict({**state, "pending": [], "pending_steps": []})

    # ------------------------------------------------------------ hooks
    def _describe_contribution(self, deposits: list[Deposit]) -> tuple[int, int, int]:
        # One model per rank and round; its step says how stale it is. Count 0: a
        # model already contributed, left out of the sum with stale="skip".
        step = max(d.step for d in deposits) if deposits else self._last_sent_step
        return int(bool(deposits) or self.stale == "resend"), step, step

    def _send_buffer(self, ctx: RoundContext) -> list[Tensor]:
        """The newest model deposited, else the model last sent; older deposits are superseded."""
        deposits = ctx.deposits
        if deposits:
            newest = max(deposits, key=lambda d: d.step)
            with self._side_stream():
                for d in deposits:
                    self._follow(d)  # a superseded one's recycle event then follows its writer
                    if d is not newest:  # older models of this rank: superseded
                        self.layout.recycle(d.flats)
            with self._cond:  # against _release_sent on the caller's thread
                old = self._last_sent
                self._last_sent, self._last_sent_step = newest.flats, newest.step
                unused = self._sent_users.get(id(old), 0) == 0
                if not unused and self._stream is not None:  # pragma: no cover - needs GPUs
                    # Its last use on the side stream is behind this event; _release_sent waits for it.
                    event = torch.cuda.Event()
                    event.record(self._stream)
                    self._superseded_at[id(old)] = event
            if unused:
                with self._side_stream():  # after the side stream's last use of it (earlier rounds)
                    self.layout.recycle(old)
        return self._last_sent

    def _start_data(self, ctx: RoundContext, flats: list[Tensor]) -> _Exchange:
        """A global round: an allreduce of a copy of the model on the data group; else the group's send/recv."""
        r = ctx.index
        if ctx.global_round:
            sums = self._copy(flats)  # the send buffer stays intact: it is the round's ``sent``
            return _Exchange([self._start(self._data_pg, s, r, "global average") for s in sums], sums=sums)
        group = self.schedule.group_of(r, self.rank)
        peers = [m for m in group if m != self.rank]
        received: dict[int, list[Tensor]] = {}
        with self._side_stream():
            for peer in peers:
                received[peer] = self.layout.take()  # pooled: no allocation per round and peer
        if self.backend == "nccl":  # pragma: no cover - needs GPUs
            works = [issued for issued, _ in self._exchange_batched(r, flats, received)]
            return _Exchange(works, group=tuple(group), received=received)
        works = []
        # Pairs in one global order; in each pair the lower rank sends first.
        for a in group:
            for b in group:
                if a >= b or self.rank not in (a, b):
                    continue
                peer = b if self.rank == a else a
                ops = ("send", "recv") if self.rank == a else ("recv", "send")
                for op in ops:
                    for tag, f in enumerate(flats):
                        works.append(self._p2p(op, f if op == "send" else received[peer][tag], peer, tag, r))
        return _Exchange(works, group=tuple(group), received=received)

    def _exchange_batched(
        self, r: int, flats: list[Tensor], received: dict[int, list[Tensor]]
    ) -> list[tuple[Issued, str]]:  # pragma: no cover - needs GPUs
        """NCCL: the round's sends and receives as one ``batch_isend_irecv`` on the data group's communicator.

        Batched point-to-point calls run in one NCCL group call on the group's own
        communicator (created at ``start()``): no two-rank communicator per peer
        pair, and no send/recv ordering between the pairs to get right.
        """
        ops = []
        for peer, bufs in received.items():
            for f, into in zip(flats, bufs):
                ops.append(dist.P2POp(dist.isend, f, peer, group=self._data_pg))
                ops.append(dist.P2POp(dist.irecv, into, peer, group=self._data_pg))
        if not ops:
            return []  # alone in its group this round (batch_isend_irecv refuses an empty list)
        what = f"group exchange with ranks {sorted(received)}"
        try:
            with self._side_stream():
                works = dist.batch_isend_irecv(ops)
        except Exception as err:
            raise self._collective_error(err, r, what) from err
        return [(Issued(w, what, stream_ordered=True), what) for w in works]

    def _p2p(self, op: str, tensor: Tensor, peer: int, tag: int, r: int) -> Issued:
        """A send or receive on the data group (the side stream for CUDA tensors)."""
        what = f"group {op} with rank {peer}"
        try:
            with self._side_stream():
                if op == "send":
                    return Issued(self._data_pg.send([tensor], peer, tag), what)
                return Issued(self._data_pg.recv([tensor], peer, tag), what)
        except Exception as err:
            raise self._collective_error(err, r, what) from err

    def _copy(self, flats: list[Tensor]) -> list[Tensor]:
        """A pooled copy of ``flats``, made on the side stream."""
        with self._side_stream():
            out = self.layout.take()
            for o, f in zip(out, flats):
                o.copy_(f)
        return out

    def _finish_data(self, ctx: RoundContext, flats: list[Tensor], data: DataRound, summed: Tensor) -> _GroupOutcome:
        """The group's sum (or the global one), this rank's part in it, and the consensus distance if measured."""
        assert isinstance(data, _Exchange)
        r = ctx.index
        if ctx.global_round:
            consensus = self._consensus(r, flats, data.sums)
            everybody = tuple(range(self.world_size))
            return _GroupOutcome(data.sums, 1.0, included=True, group=everybody, group_id=-1, averaged=everybody,
                                 consensus=consensus)
        group, received = data.group, data.received
        averaged = tuple(m for m in group if summed[m, header.COUNT] > 0)
        included = self.rank in averaged
        parts = [flats if m == self.rank else received[m] for m in averaged] if included else [flats]
        # Included: the members' sum; otherwise this rank's model was averaged before and it sits
        # this round out with a copy of it.
        sums = self._copy(parts[0])
        with self._side_stream():
            for part in parts[1:]:  # member order: bit-identical sums on every member
                for acc, t in zip(sums, part):
                    acc.add_(t)
            for bufs in received.values():
                self.layout.recycle(bufs)  # after the additions above, on this stream
        consensus = None
        if self.measure_every is not None and (r + 1) % self.measure_every == 0:
            totals = self._copy(flats)
            for t in totals:
                self._finish(self._start(self._data_pg, t, r, "consensus"), r)
            consensus = self._consensus(r, flats, totals)
            with self._side_stream():
                self.layout.recycle(totals)
        return _GroupOutcome(sums, 1.0, included=included, group=group, group_id=self.schedule.group_id(r, self.rank),
                             averaged=averaged, consensus=consensus)

    def _consensus(self, r: int, flats: list[Tensor], totals: list[Tensor]) -> float:
        """``mean_i ||w_i - mean||^2`` from this rank's model and the global sums (one scalar allreduce).

        In float64, a chunk at a time: at most two float64 chunks exist besides the
        buffers, never float64 copies of the whole model. The scalar travels on the
        gloo header group (a host tensor).
        """
        chunk = 1 << 20
        with self._side_stream():
            acc = torch.zeros((), dtype=torch.float64, device=flats[0].device)
            for f, t in zip(flats, totals):
                for start in range(0, f.numel(), chunk):
                    diff = f[start : start + chunk].to(torch.float64, copy=True)  # never f itself
                    diff.sub_(t[start : start + chunk].double() / self.world_size)  # out of place: t is the result
                    acc += diff.square_().sum()
        self._await_gpu(r, "the consensus distance's allreduce")  # bounded, before the host read
        own = float(acc)
        value = torch.tensor([own], dtype=torch.float64)
        self._finish(self._start(self._header_pg, value, r, "consensus distance"), r)
        return float(value.item()) / self.world_size

    def _result(self, ctx: RoundContext, sent: list[Tensor], outcome: DataOutcome, stats: RoundStats) -> RoundResult:
        """A :class:`GroupRoundResult`: ``sent`` stays unrecycled until the caller releases the result."""
        assert isinstance(outcome, _GroupOutcome)
        with self._cond:
            self._sent_users[id(sent)] = self._sent_users.get(id(sent), 0) + 1
        return GroupRoundResult(
            round_index=ctx.index, tensors=self.layout.unflatten(outcome.flats), stats=stats, buffers=outcome.flats,
            layout=self.layout, sent=self.layout.unflatten(sent), included=outcome.included,
            on_release=lambda: self._release_sent(sent),
        )

    def _release_sent(self, sent: list[Tensor]) -> None:
        """Caller's thread, from ``RoundResult.release()``: a result no longer shows ``sent``; recycles it if superseded."""
        with self._cond:
            users = self._sent_users[id(sent)] - 1
            if users:
                self._sent_users[id(sent)] = users
                return
            del self._sent_users[id(sent)]
            if sent is self._last_sent:
                return  # still the send buffer: the communication thread recycles it once superseded
            event = self._superseded_at.pop(id(sent), None)
        if event is not None:  # pragma: no cover - needs GPUs
            # The side stream may still read it in a round whose result this caller has not taken
            # yet: wait for that last use only, not for every round queued since.
            torch.cuda.current_stream(self._stream.device).wait_event(event)
        self.layout.recycle(sent)


def lag_damping(lag: int) -> float:
    """The share ``1 / (lag + 1)`` of its pull that each member of a group round takes under ``late="damp"``.

    ``lag`` is the largest staleness of a model in the group's sum. Why this
    factor: with one member ``k`` rounds late in groups of ``n`` among many
    ranks (the others barely move), the gap ``d`` between it and the others
    follows ``d_q = d_{q-1} - a d_{q-k-1}`` with ``a = beta (n - 1) / n``, and
    that recurrence is stable iff ``0 < a < 2 sin(pi / (4k + 2))``, which is at
    least ``2 / (2k + 1) > 1 / (k + 1) >= a`` for every ``k`` and ``n``. The
    undamped rule (``beta = 1``, ``late="carry"``) breaks it from ``k = 3`` in
    groups of two (spectral radius 1.024; 1.060 at ``k = 4``) and from ``k = 2``
    in larger groups; ``1 / (k + 1)`` keeps it below 1 for every lag (groups of
    two: 0.824 at ``k = 4``, 0.988 at ``k = 64``; ``n`` large: 0.917, 0.995), so
    no ``max_staleness``, or none at all, lets a late rank drift off.
    """
    check_int("lag", lag, minimum=0)
    return 1.0 / (lag + 1)


def apply_average(
    result: RoundResult,
    current: Tensors,
    *,
    normalize: AverageNormalization = "group",
    late: AverageLatePolicy = "damp",
) -> None:
    """Replaces ``current`` (this rank's model, as passed to ``arrive``) with the round's average, in place.

    A rank left out of the round's sum (``result.included`` false: ``stale="skip"``
    and nothing new since its last round) keeps ``current`` unchanged. Otherwise,
    with ``n`` the number of models summed (``P`` in a global round), ``s`` the sum,
    ``c`` this rank's contribution to the round, ``u`` its current model and ``k``
    the largest staleness (``RoundStats.staleness``) of a model in the sum:

    * ``normalize="group"``, ``late="damp"`` (default, **Decision**): ``u <- u +
      beta (s / n - c)`` with ``beta = 1 / (k + 1)`` (:func:`lag_damping`), the
      same ``beta`` on every member of the group. When every model in the sum is
      fresh (``k = 0``: every synchronous and every global round) each member
      gets exactly ``s / n``, bit-identical across the group. A late member keeps
      the local progress that missed the round (its ``u - c``), as ``"carry"``
      does. The sum of all replicas is conserved by every round for every lag
      (the members' pulls ``s / n - c`` sum to zero and share one factor), so
      nothing computed is lost. What it gives up against ``"carry"``: while a
      member is late, its group's members move only ``beta`` of the way to the
      group average (they are not left identical, and a late rank catches up
      over about ``k + 1`` rounds instead of one). Why: ``"carry"`` measures a
      late rank's pull from the model it contributed ``k`` rounds ago although
      its current model already took the ``k`` pulls of the rounds since; at
      ``k >= 3`` that overshoot grows without bound (DS-Sync with ``max_staleness=4``
      allows ``k = 4``; see :func:`lag_damping`).
    * ``late="carry"``: ``u <- s / n + (u - c)``, the same for ``k = 0`` and
      conserving too, but unstable for a lag of 3 or more (kept for comparison).
    * ``late="drop"``: ``u <- s / n``: a late rank discards the local progress
      that missed the round (not conserving; stable).
    * ``normalize="reference"``: ``u <- (s + u) / (n + 1)`` in group rounds, the
      WAGMA reference code's rule (a late rank's current weights still count; not
      conserving; stable: a convex combination); ``late`` is ignored; global
      rounds use ``s / n``.
    """
    if normalize not in AVERAGE_NORMALIZATIONS:
        raise ValueError(f"unknown normalize {normalize!r}: expected one of {', '.join(AVERAGE_NORMALIZATIONS)}")
    if late not in AVERAGE_LATE_POLICIES:
        raise ValueError(f"unknown late policy {late!r}: expected one of {', '.join(AVERAGE_LATE_POLICIES)}")
    group = result.stats.group
    if group is None or not isinstance(result, GroupRoundResult) or not result.sent:
        raise ValueError("apply_average() needs a GroupAverage round result")
    if not result.included:
        return
    averaged = result.stats.averaged or group
    n = len(averaged)
    tensors = [current] if isinstance(current, Tensor) else list(current)
    if len(tensors) != len(result.tensors) or any(u.shape != s.shape for u, s in zip(tensors, result.tensors)):
        raise ValueError(
            f"apply_average(): current has {len(tensors)} tensor(s) of shapes {[tuple(u.shape) for u in tensors]}, "
            f"the round averaged {len(result.tensors)} of shapes {[tuple(s.shape) for s in result.tensors]}: "
            "pass the tensors given to arrive()"
        )
    global_round = result.stats.group_id == -1
    beta = 1.0
    if late == "damp":
        # One factor for the whole group (the header is identical on every member): the
        # members' pulls then still sum to zero, and so does the change of the replicas' sum.
        beta = lag_damping(max(result.stats.staleness[m] or 0 for m in averaged))
    with torch.no_grad():
        for u, s, c in zip(tensors, result.tensors, result.sent):
            if normalize == "reference" and not global_round:
                u.add_(s).div_(n + 1)
                continue
            if beta < 1.0:
                u.add_(s.div(n).sub_(c), alpha=beta)
                continue
            # beta == 1: every model in the sum is fresh (u == c), or "carry"/"drop".
            delta = u - c if late != "drop" else None
            u.copy_(s).div_(n)
            if delta is not None:
                u.add_(delta)
