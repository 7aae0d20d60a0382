"""PartialAllreduce: eager-SGD's partial collectives over torch.distributed.

Threads and collectives (the contract):

* The **caller's thread** (the training loop) calls :meth:`PartialAllreduce.arrive`
  once per step, in step order, then :meth:`~PartialAllreduce.flush` once at the
  end. It deposits its gradient in the send buffer, counts its arrival in the
  store and, if its arrival meets the round's activation rule, activates the
  round. It then blocks only until the result of *its* step's round is there.
  It never issues a collective. :meth:`~PartialAllreduce.arrive` is the two
  halves in one call: :meth:`~PartialAllreduce.submit` (the deposit, the
  counting and the activation) and :meth:`~PartialAllreduce.collect` (the wait
  for the result); a caller that overlaps a round with its next step's
  computation calls them apart (``eager_sgd``'s ``overlap``).
* The **communication thread** (one per engine) runs rounds ``0, 1, 2, ...`` in
  order, each exactly once: it waits in the store until the round is
  activated, takes whatever the send buffer holds at that moment (the fresh
  gradient, carried late ones, or nothing), and issues the round's
  allreduces on the engine's own process groups: the data on the data group
  (gloo, or NCCL for CUDA tensors) and a small int64 header (per-rank counts,
  steps, progress). With gloo and host tensors the header travels in the same
  allreduce as the data, in the tail of the first flat buffer (one collective
  a round: a second, tiny gloo allreduce measured 1.8 ms of CPU and doubled a
  round's latency on a 2-core host); otherwise it is a separate allreduce on
  a gloo group. The sequence of collectives is therefore identical on every
  rank, and so are the results: replicas that apply them in order stay
  bit-identical.

Round ``r`` is the round of training step ``r``: the caller of step ``r``
receives the result of round ``r`` whether its own gradient made it in
(fresh) or not (late; carried into a later round or dropped, by policy).

Module map: this module holds the caller's side and the API; the
communication thread's round runner and its hooks are
:mod:`~lightning_partial.collectives.runner`, the process groups and the
collectives on them :mod:`~lightning_partial.collectives.groups`, the round
header :mod:`~lightning_partial.collectives.header`, the per-round types
:mod:`~lightning_partial.collectives.rounds` and the result
:mod:`~lightning_partial.collectives.results`.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time
from typing import Any, NamedTuple, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_partial.collectives import header
from lightning_partial.collectives.checks import check_int
from lightning_partial.collectives.config import PartialAllreduceConfig
from lightning_partial.collectives.control import ControlPlane
from lightning_partial.collectives.errors import EngineClosedError, PartialCollectiveError
from lightning_partial.collectives.layout import TensorLayout
from lightning_partial.collectives.nccl import destroy_group
from lightning_partial.collectives.results import RoundResult, hand_over
from lightning_partial.collectives.rounds import Deposit
from lightning_partial.collectives.runner import RoundRunner

__all__ = ["PartialAllreduce", "RoundResult", "Tensors"]

log = logging.getLogger(__name__)

Tensors = Union[Tensor, Sequence[Tensor]]


def _is_plain_int(dtype: torch.dtype) -> bool:
    return dtype in (torch.int32, torch.int64)


class _Submitted(NamedTuple):
    """A round this rank submitted and has not collected (caller's thread only)."""

    started: float  # perf_counter() as the submission began
    arrived_at: float  # monotonic() as the deposit was in
    initiator: int  # the majority initiator drawn for the round
    arrived: object  # the arrivals this rank saw in the store (int), "?" where it did not count
    empty: bool = False  # arrived without a gradient (skip())


class PartialAllreduce(RoundRunner):
    """A partial allreduce over a sequence of rounds (see the module docstring).

    Args:
        config: what activates a round, what happens to late gradients, etc.
        store: a c10d store shared by all ranks (``TCPStore`` in a real job).
            The engine opens two clients of its own on it and builds its gloo
            groups from it, so no gloo engine touches the default group. A NCCL
            data group is made with ``dist.new_group`` at ``start()`` (the one
            default-group operation; see :mod:`~lightning_partial.collectives.nccl`).
        rank: this rank, ``0 <= rank < world_size``.
        world_size: number of ranks ``P``.
        like: tensors with the shapes, dtypes and devices that every round
            carries (their values are not read). Fixed for the engine's life.
        backend: ``"gloo"`` or ``"nccl"`` for the data; default: NCCL for CUDA
            tensors when available, gloo otherwise. The header uses gloo: inside
            the data allreduce for host tensors over gloo, on its own group otherwise.

    Example::

        engine = PartialAllreduce(PartialAllreduceConfig(mode="solo"), store=store,
                                  rank=rank, world_size=P, like=[p.grad for p in params])
        engine.start()
        for step in range(steps):
            ...
            result = engine.arrive([p.grad for p in params])
            for p, g in zip(params, result.tensors):
                p.grad.copy_(g)
            optimizer.step()
        last = engine.flush()   # apply last.tensors too: carried gradients
        engine.close()

    Extension points: engines that exchange something else than a global sum
    of gradients (:class:`~lightning_partial.collectives.GroupAverage`) or that
    activate rounds otherwise (:class:`~lightning_partial.collectives.DelayedAllreduce`)
    override the round hooks of :class:`~lightning_partial.collectives.runner.RoundRunner`
    (communication thread; each takes the round's
    :class:`~lightning_partial.collectives.rounds.RoundContext` and returns what
    the next one needs). On the caller's side a subclass uses only this
    protected API; the rest of the engine's state is private to it:

    * ``_cond``: the condition that guards the shared state below; a subclass
      guards its own shared state with it too (one lock, no lock ordering).
    * Under ``_cond``: ``_snapshotted`` (the last round the communication thread
      took; read only), ``_pending`` (the send buffer: the deposits the next
      round takes; a subclass may add to it), ``_waiting_round`` (the round the
      communication thread waits for, or ``None``; read only), ``_closing``
      (read only), :meth:`_raise_if_failed`.
    * ``_control``: the :class:`~lightning_partial.collectives.control.ControlPlane`
      (activation through the store; its methods say which thread calls them).
    * :meth:`_check_running`, :meth:`_as_list`, :meth:`_record_ready`,
      :meth:`_wait_on_cond` (bounded, naming rank and round),
      :meth:`_take_result` (one published result, handed over to the caller's
      stream), :meth:`_published`, :meth:`_await_published` (for a checkpoint),
      :meth:`_flush` (the final round, at a given step), :meth:`_await_gpu`.
    * Communication thread, under ``_cond``: :meth:`_no_activation_needed`,
      :meth:`_activation_claimed`, :meth:`_claim_activation` (for an engine that
      activates rounds itself in :meth:`_await_activation` or :meth:`_after_round`).
    """

    # Whether the header may ride in the data allreduce (subclasses whose data
    # collective differs between ranks must check the header first: False).
    _FUSE_HEADER = True
    # Whether skip() applies (a round's result is a gradient sum a rank can apply without contributing).
    _SKIPPABLE = True
    #: Whether :meth:`request_sync` is supported.
    _REQUESTS_SYNC = True

    def __init__(
        self,
        config: PartialAllreduceConfig,
        *,
        store: dist.Store,
        rank: int,
        world_size: int,
        like: Tensors,
        backend: Optional[str] = None,
    ) -> None:
        if not isinstance(config, PartialAllreduceConfig):
            raise ValueError(f"config must be a PartialAllreduceConfig, got {type(config).__name__}")
        config.validate_world(world_size)
        check_int("rank", rank, minimum=0)  # a bool or a float would pass the range check below
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in 0..{world_size - 1}, got {rank}")
        if backend not in (None, "gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo', 'nccl' or None, got {backend!r}")
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self._single = isinstance(like, Tensor)
        tensors = [like] if isinstance(like, Tensor) else list(like)
        self.layout = TensorLayout(tensors)
        devices = {b.device for b in self.layout.buckets}
        self._cuda_device = next((d for d in devices if d.type == "cuda"), None)
        if backend is None:
            backend = "nccl" if self._cuda_device is not None and dist.is_nccl_available() else "gloo"
        if backend == "nccl" and (len(devices) != 1 or self._cuda_device is None):
            raise ValueError(f"backend 'nccl' needs all tensors on one CUDA device, got {sorted(map(str, devices))}")
        self.backend = backend
        if config.staleness.active and not all(b.dtype.is_floating_point for b in self.layout.buckets):
            raise ValueError(
                f"config.staleness rule {config.staleness.rule!r} scales contributions by fractions: every tensor "
                f"must be floating point, got {sorted({str(b.dtype) for b in self.layout.buckets})}"
            )
        if config.normalize != "sum" and not all(b.dtype.is_floating_point for b in self.layout.buckets):
            # Every round divides its sum in place (RoundRunner._finish_data): an integer buffer would fail
            # each round on the communication thread instead of here.
            raise ValueError(
                f"{type(self).__name__}: normalize={config.normalize!r} divides each round's sum: every tensor "
                f"must be floating point (integer tensors only with normalize='sum'), got "
                f"{sorted({str(b.dtype) for b in self.layout.buckets})}"
            )
        self._store = store
        # One collective a round instead of two where the data allreduce can carry the header.
        # Not in pure sync mode: it needs a header only at the flush, and a buffer of its
        # own length keeps its rounds bit-identical to dist.all_reduce (gloo's ring splits
        # a buffer into chunks by its length, which fixes the order of the additions).
        self._fused_header = (
            self._FUSE_HEADER
            and config.mode != "sync"
            and backend == "gloo"
            and all(b.device.type == "cpu" for b in self.layout.buckets)
            and (self.layout.buckets[0].dtype.is_floating_point or _is_plain_int(self.layout.buckets[0].dtype))
        )
        if self._fused_header:
            self.layout = TensorLayout(tensors, tail=header.fused_length(world_size))

        # Shared between the caller's thread and the communication thread;
        # every field below is guarded by self._cond.
        self._cond = threading.Condition()
        self._step = 0  # the next step the caller arrives at
        self._snapshotted = -1  # the last round whose send buffer was taken
        self._pending: list[Deposit] = []
        self._dropped = 0
        self._activated_here: set[int] = set()
        self._flush_round: Optional[int] = None
        self._results: dict[int, Union[RoundResult, BaseException]] = {}
        self._stop_round: Optional[int] = None  # the round that carried a stop: the thread ended after it
        self._error: Optional[BaseException] = None
        self._waiting_round: Optional[int] = None
        self._closing = False
        # Written without the lock: request_stop() may run in a signal handler
        # that interrupted the caller's thread while it held self._cond.
        self._stop_requested = False
        self._finish_requested = False  # as the stop: a plain flag the communication thread reads
        self._sync_requested = False  # request_sync(), until the next snapshot carries it (under self._cond)
        # The first round of a synchronous finish that a round's header requested (under self._cond). Not in
        # the engine's state: the request is the fit's, made again by a resumed fit where still due.
        self._requested_sync_from: Optional[int] = None
        self._announce = 0  # bits announced since this rank's last snapshot (under self._cond)

        self._initiators = random.Random(config.seed)
        # Per round submitted and not collected: when its submission started, when it arrived,
        # the initiator drawn for it and the arrivals it saw (for its stats and a time-out's message).
        self._submitted: dict[int, _Submitted] = {}
        self._first_round = 0
        self._state = "new"  # new -> running -> flushed -> closed
        self._thread: Optional[threading.Thread] = None
        self._control: Optional[ControlPlane] = None
        # Set by the communication thread from taking a round's snapshot until its result
        # is published: collectives of that round may be in flight (see close()).
        self._in_round = False
        self._done_events: dict[int, torch.cuda.Event] = {}  # CUDA: result ready, per round
        self._init_groups()
        self._liveness: Any = None  # see attach_liveness()
        self._liveness_engine: Optional[int] = None

    # ------------------------------------------------------------------ API
    @property
    def step(self) -> int:
        """The step (= round) of the next :meth:`arrive`."""
        return self._step

    def begin_at(self, round_index: int) -> None:
        """Before :meth:`start`, instead of :meth:`load_state_dict`: the first round is ``round_index``, nothing
        pending (a fit resumed without engine state at that step: its rounds keep the steps' numbering, which the
        synchronous finish, ``sync_every`` and the group schedules count in). Every rank gives the same index."""
        if self._state != "new":
            raise RuntimeError(f"rank {self.rank}: begin_at() must come before start()")
        if isinstance(round_index, bool) or not isinstance(round_index, int) or round_index < 0:
            raise ValueError(f"rank {self.rank}: begin_at() takes a round index >= 0, got {round_index!r}")
        self._step = round_index

    @property
    def stopped(self) -> bool:
        """A round this rank collected carried a stop request: no later round runs (every rank stops there)."""
        return self._state == "stopped"

    @property
    def round_reached(self) -> int:
        """The latest round this rank has arrived at or taken (what a heartbeat reports)."""
        return max(self._step, self._snapshotted + 1)

    def start(self) -> "PartialAllreduce":
        """Creates the process groups and the communication thread. Collective: every rank calls it.

        The groups' rendezvous is bounded by ``config.setup_timeout`` (default: ``timeout``);
        a rank that does not call ``start()`` within it of the others makes ``start()``
        raise :class:`PartialCollectiveTimeout` on the ranks that did. The gloo groups'
        collectives are then bounded per round (``collective_bound`` or ``timeout``). A NCCL data group is made
        after the gloo rendezvous, with ``dist.new_group`` (torch.distributed must be
        initialised, with this engine's rank and world size), and its communicator is
        created and tried here, bounded by ``setup_timeout``
        (:mod:`~lightning_partial.collectives.nccl`).
        """
        if self._state != "new":
            raise RuntimeError(f"rank {self.rank}: start() called twice (state {self._state})")
        name = self.config.name
        self._control = ControlPlane(
            self._store, name=name, rank=self.rank, world_size=self.world_size, timeout=self.config.timeout,
            op_timeout=self.config.collective_bound,
        )
        try:
            self._open_groups()
        except BaseException:
            self._control = None
            raise
        self._snapshotted = self._step - 1
        self._first_round = self._step  # a resumed run has no arrivals before it
        self._state = "running"
        self._thread = threading.Thread(
            target=self._run, name=f"lightning_partial-{name}-rank{self.rank}", daemon=True
        )
        self._thread.start()
        return self

    def arrive(self, tensors: Tensors) -> RoundResult:
        """Contributes this step's gradient and returns the result of this step's round.

        Blocks only until this step's round has completed: if another rank already
        activated it, that is the time of the collective itself; if not, until the
        activation rule is met (never, in ``solo`` mode, since this arrival meets it).
        ``arrive(t)`` is ``collect(submit(t))``.
        """
        self._check_running("arrive")
        return self._arrive(self._as_list(tensors), flush=False)

    @property
    def behind(self) -> bool:
        """Whether the round of the next step has been taken already (run, or running) without this rank.

        A gradient this rank computes for that step now would be late on arrival. The caller's
        thread reads it before computing a step (eager-SGD's ``catch_up``); the answer can only
        change from ``False`` to ``True`` while it computes, never back.
        """
        with self._cond:
            return self._snapshotted >= self._step

    def skip(self) -> RoundResult:
        """Arrives at this step without a gradient and returns the result of this step's round.

        For a rank that is :attr:`behind`: the step's round ran without it, so it applies the
        round's result without computing a gradient for it (and catches up with the others
        instead of contributing a late one). The arrival is counted as any other (it opens the
        staleness gate of a later round); what this rank still carries goes into the next round
        that takes its send buffer, as always. The result's ``stats.skipped`` is ``True``.
        Allowed at any step, also one whose round has not run; not in a synchronous round,
        which waits for every rank's gradient.
        """
        if not self._SKIPPABLE:
            raise NotImplementedError(f"{type(self).__name__} does not support skip()")
        self._check_running("skip")
        q = self._step
        if self._known_sync(q):
            raise ValueError(
                f"rank {self.rank}: skip() at step {q}, whose round is synchronous (it waits for every rank's "
                "gradient): arrive with this step's gradient"
            )
        return self._arrive(None, flush=False)

    def submit(self, tensors: Tensors) -> int:
        """Contributes this step's gradient, activates its round where the rule says so; returns the round.

        Does not wait for the round: its collectives run on the communication
        thread while the caller goes on (computes the next step), and
        :meth:`collect` returns its result later. Every submitted round must be
        collected, in round order, before :meth:`flush`.
        """
        self._check_running("submit")
        return self._submit(self._as_list(tensors), flush=False)

    def collect(self, round_index: int) -> RoundResult:
        """The result of round ``round_index``, submitted by this rank and not yet collected.

        Blocks until the round has completed, bounded by ``config.timeout`` (a
        :class:`PartialCollectiveTimeout` naming the rank and the round). Rounds
        are collected in the order they were submitted.
        """
        self._check_running("collect")
        with self._cond:
            submitted = sorted(self._submitted)
        if not submitted or round_index != submitted[0]:
            raise ValueError(
                f"rank {self.rank}: collect({round_index}): the rounds submitted and not collected are {submitted}; "
                "collect them in that order"
            )
        return self._collect(round_index)

    @property
    def uncollected(self) -> list[int]:
        """The rounds this rank submitted and has not collected yet, in order."""
        with self._cond:
            return sorted(self._submitted)

    def flush(self, tensors: Optional[Tensors] = None) -> RoundResult:
        """The final, fully-synchronous round: every rank's pending gradients are summed.

        Every rank must call it at the same step. Afterwards nothing is pending
        anywhere; the engine accepts no more rounds (``close()`` it).
        ``tensors``, if given, are a last fresh contribution.
        """
        self._check_running("flush")
        uncollected = self.uncollected
        if uncollected:
            raise RuntimeError(
                f"rank {self.rank}: flush() with submitted rounds not collected ({uncollected}): collect them first"
            )
        return self._flush(tensors)

    def _flush(self, tensors: Optional[Tensors], *, step: Optional[int] = None) -> RoundResult:
        """Caller's thread, protected: :meth:`flush`'s final round, at ``step`` if given (else the next step).

        :meth:`DelayedAllreduce.finish <lightning_partial.collectives.DelayedAllreduce.finish>`
        runs it at the round after the one every rank agreed on.
        """
        with self._cond:
            if step is not None:
                self._step = step
            if self._snapshotted >= self._step:
                # Round q ran already: other ranks *arrived* at step q (their arrivals
                # activated it) while this rank flushes there. Under the lock, so that
                # the communication thread either sees the flush mark or has run q.
                raise PartialCollectiveError(
                    f"flush() at step {self._step}, but other ranks arrived at this step and its round has run: "
                    "every rank must flush at the same step (the same number of optimizer steps on every rank)",
                    rank=self.rank,
                    round_index=self._step,
                )
            self._flush_round = self._step
        result = self._arrive(None if tensors is None else self._as_list(tensors), flush=True)
        self._state = "flushed"
        assert self._thread is not None and self._control is not None
        self._thread.join(timeout=self.config.timeout.total_seconds())
        self._control.finish(result.round_index, self.config.max_staleness)
        return result

    def _require_header(self, call: str) -> None:
        """Raises ``ValueError`` in pure ``sync`` mode: ``call`` rides in the round header, which it does not send."""
        if self.config.mode == "sync":
            raise ValueError(f"rank {self.rank}: {call}() needs the round header, which pure mode='sync' does not send")

    def request_stop(self) -> None:
        """Asks every rank to stop after the next round this rank's thread snapshots.

        The request travels in that round's header, so every rank learns it in the
        same round ``R`` (``result.stats.stop``): every communication thread ends
        after ``R``, and an ``arrive`` after ``R`` raises ``EngineClosedError``.
        Safe to call from a signal handler. Not available in pure ``sync`` mode,
        whose rounds carry no header.
        """
        self._require_header("request_stop")
        self._stop_requested = True

    def request_finish(self) -> None:
        """Asks every rank to end its fit after the next round this rank's thread snapshots.

        The request travels in that round's header (``result.stats.finish`` on every
        rank in the same round ``R``, and in the rounds after it). Unlike
        :meth:`request_stop`, nothing ends here: the rounds go on, and the caller
        ends its loop where it sees ``finish``, then flushes as at any end (a
        training time limit: Lightning's ``max_time``). Callable from any thread.
        Not available in pure ``sync`` mode, whose rounds carry no header.
        """
        self._require_header("request_finish")
        self._finish_requested = True

    def request_sync(self) -> None:
        """Asks every rank to make every round synchronous from a few rounds after the next one this rank's
        thread snapshots (a synchronous finish whose start the caller decides as the fit runs: a training
        time limit, where the fit's rounds cannot be counted in advance).

        The request travels in that round's header: every rank finds the first synchronous round in
        that round's ``result.stats.sync_from``, ``max_staleness + 2`` rounds after it (2 without a
        bound), so that every rank has that round's header before it decides anything about the
        first synchronous one. From there on the rounds are as from ``config.sync_from`` (which is
        kept where it comes first); :attr:`sync_from` is the first synchronous round in force. A second
        request changes nothing. The margin holds for a caller that submits at most one round before
        collecting it (:meth:`arrive`, or eager_sgd's overlap). The request is not in :meth:`state_dict`: it
        belongs to the fit, whose caller asks again after a resume where it is still due. Not available in
        pure ``sync`` mode, whose rounds carry no header, nor in a ``DelayedAllreduce``, whose finish is
        placed by its own rules.
        """
        if not self._REQUESTS_SYNC:
            raise NotImplementedError(f"{type(self).__name__} does not support request_sync()")
        self._require_header("request_sync")
        with self._cond:
            self._sync_requested = True

    @property
    def sync_from(self) -> Optional[int]:
        """The first round of the synchronous finish in force: the configuration's ``sync_from`` or a requested
        one (:meth:`request_sync`), whichever comes first; ``None`` while neither is known. A caller that
        collected round ``r`` reads every request up to ``r``."""
        with self._cond:
            known = [r for r in (self.config.sync_from, self._requested_sync_from) if r is not None]
        return min(known) if known else None

    def announce(self, flags: int) -> None:
        """Has every rank see ``flags`` (caller-defined bits) in the same round, once.

        The next round this rank's thread snapshots carries them in its header:
        every rank finds them in that round's ``result.stats.announced`` (the OR
        over the ranks' announcements), and in no other round. Bits announced
        twice before a snapshot arrive once. The caller decides what a bit means
        (the strategies: a time-based checkpoint every rank takes at the same
        step). Not in pure ``sync`` mode, whose rounds carry no header.
        """
        self._require_header("announce")
        if not isinstance(flags, int) or isinstance(flags, bool) or not 0 < flags < 1 << header.ANNOUNCE_BITS:
            raise ValueError(f"rank {self.rank}: announce() takes bits as an int in [1, 2**{header.ANNOUNCE_BITS}), "
                             f"got {flags!r}")
        with self._cond:
            self._announce |= flags

    def close(self, timeout: float = 10.0) -> None:
        """Stops the communication thread; bounded by ``timeout`` seconds and idempotent."""
        if self._state == "closed":
            return
        previous, self._state = self._state, "closed"
        if previous == "new":
            return
        gpu_idle = True
        if self._watch is not None:  # pragma: no cover - needs GPUs
            # Rounds may still be queued on the GPU (their results were published at once):
            # destroying the communicator under them could block; abort them instead.
            gpu_idle = self._watch.wait_idle(timeout)
            self._watch.stop()
        with self._cond:
            self._closing = True
            waiting = self._waiting_round
            self._cond.notify_all()
        thread = self._thread
        # Failed (a peer is gone): the thread may be blocked on that peer, or on a store whose
        # host is frozen; neither a wake nor a long join would help. It is a daemon: leave it.
        failed = self._error is not None
        if (
            not failed
            and thread is not None
            and thread.is_alive()
            and waiting is not None
            and not self._known_sync(waiting)  # that wait is on self._cond, notified above
            and self._control is not None
        ):
            try:
                self._control.wake(waiting)
            except Exception as err:  # the store may be gone with a dead rank
                log.debug("rank %d: could not wake the communication thread: %s", self.rank, err)
        if thread is not None:
            thread.join(timeout=min(timeout, 1.0) if failed else timeout)
            if thread.is_alive():
                # Stuck inside a collective with a peer that never comes: abort the
                # groups so that it returns, and leave the daemon thread behind.
                self._abort_groups()
                log.warning("rank %d: the communication thread did not stop within %.1fs", self.rank, timeout)
        stuck = thread is not None and thread.is_alive()
        # A collective may still be in flight if the thread failed (its peers failed
        # too and never complete it), is stuck, or stopped inside a round.
        if self._error is not None or stuck or self._in_round or not gpu_idle:
            self._retire_groups()
            # The store clients go too (a stuck thread holds its own reference to the control plane, and
            # releases it if it ever returns): this engine no longer keeps two store connections open.
            self._control = self._store = None  # type: ignore[assignment]
            return
        if self.backend == "nccl":  # pragma: no cover - needs GPUs
            # Release the engine's NCCL communicator now rather than at garbage collection
            # (torch warns about a NCCL group destroyed without shutdown).
            destroy_group(self._data_pg)
        # Nothing in flight: the groups' destructors return at once; the store clients close
        # now too, not whenever this object is collected.
        self._header_pg = self._data_pg = None
        self._control = self._store = None  # type: ignore[assignment]

    def fail(self, error: PartialCollectiveError) -> None:
        """Fails the engine from another thread (a liveness monitor's verdict on a peer).

        The caller's current or next wait raises ``error``; the communication
        thread is left to its own bounds (``close()`` does not wait for it).
        The first failure is kept.
        """
        with self._cond:
            if self._error is None and not self._closing:
                self._error = error
            self._cond.notify_all()

    def attach_liveness(self, liveness: Any, *, engine: Optional[int] = None) -> None:
        """A :class:`~lightning_partial.collectives.liveness.Heartbeat` consulted when a collective times out.

        Before :meth:`start`. A collective that timed out then raises the heartbeat's
        verdict naming the rank that stopped answering, if one comes within two beats, and
        so does one that failed otherwise once the round had waited about as long as its
        bound (a peer's own timeout closed the connection); one that failed early in the
        round (a peer's process gone), a verdict already published. A wait that timed out
        with every rank alive names the ranks behind by their beats: in this engine's rounds
        where ``engine`` is its index in the heartbeat's ``engine_rounds``, else by its progress.
        """
        self._liveness = liveness
        self._liveness_engine = engine

    def __enter__(self) -> "PartialAllreduce":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """Round counter, initiator RNG and pending (carried) gradients of this rank.

        Take it between steps; results that other ranks' activity already
        produced for later rounds are not part of it, so for a consistent
        resume of all ranks take it right after a synchronous round.
        """
        if self._cuda_device is not None:  # pragma: no cover - needs GPUs
            # The copies below block the host until this stream reaches them: wait for it first,
            # bounded and without the lock (never an unbounded synchronisation under it).
            caught_up = torch.cuda.Event()
            caught_up.record(torch.cuda.current_stream(self._cuda_device))
            self._await_gpu(self._step, "the caller's stream (for a checkpoint)", caught_up)
        with self._cond:
            if self._cuda_device is not None:  # pragma: no cover - needs GPUs
                # The deposits were written on the stream that arrived: read them after it.
                stream = torch.cuda.current_stream(self._cuda_device)
                for d in self._pending:
                    if d.ready is not None:
                        stream.wait_event(d.ready)
            pending = [[f.detach().clone().cpu() for f in self.layout.data(d.flats)] for d in self._pending]
            steps = [d.step for d in self._pending]
            return {
                "step": self._step,
                "initiator_rng": self._initiators.getstate(),
                "pending": pending,
                "pending_steps": steps,
                "dropped": self._dropped,
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores :meth:`state_dict` before :meth:`start`."""
        if self._state != "new":
            raise RuntimeError(f"rank {self.rank}: load_state_dict() must come before start()")
        pending = []
        for flats, step in zip(state["pending"], state["pending_steps"]):
            if len(flats) != len(self.layout.buckets) or any(
                f.dim() != 1 or f.numel() != b.numel or f.dtype != b.dtype for f, b in zip(flats, self.layout.buckets)
            ):
                raise ValueError(f"rank {self.rank}: the checkpoint's pending gradients do not match the layout")
            # A copy: the buffer becomes a send buffer, reduced in place.
            pending.append(Deposit(self.layout.from_data(flats), int(step)))
        self._step = int(state["step"])
        self._initiators.setstate(state["initiator_rng"])
        self._pending = pending
        self._dropped = int(state.get("dropped", 0))

    # ------------------------------------------------------ caller's thread
    def _as_list(self, tensors: Tensors) -> list[Tensor]:
        if isinstance(tensors, Tensor):
            return [tensors]
        if not isinstance(tensors, (list, tuple)):
            raise ValueError(f"rank {self.rank}: expected a tensor or a sequence of tensors, got {type(tensors)}")
        return list(tensors)

    def _check_running(self, what: str) -> None:
        if self._state != "running":
            hint = {
                "new": "call start() first",
                "flushed": "the engine was flushed",
                "stopped": "a rank requested a stop (request_stop) and every rank stopped at the same round",
                "closed": "it was closed",
            }
            raise EngineClosedError(
                f"{what}() on an engine that is not running: {hint[self._state]}", rank=self.rank, round_index=self._step
            )

    def _arrive(self, tensors: Optional[list[Tensor]], *, flush: bool) -> RoundResult:
        q = self._submit(tensors, flush=flush)
        return self._collect(q, since_submit=True)

    def _submit(self, tensors: Optional[list[Tensor]], *, flush: bool) -> int:
        """Caller's thread: deposits ``tensors`` for round ``q`` (the next step), counts the arrival, activates."""
        q = self._step
        deposit = None
        if tensors is not None:
            self.layout.check(tensors, rank=self.rank, round_index=q)
            deposit = Deposit(self.layout.flatten(tensors), q)
            self._record_ready(deposit)
        started = time.perf_counter()
        with self._cond:
            self._raise_if_failed(q)
            late = self._snapshotted >= q
            if deposit is not None:
                if late and self.config.late == "drop":
                    self._dropped += 1
                else:
                    self._pending.append(deposit)
            self._step = q + 1
            self._cond.notify_all()  # a synchronous round waits for this arrival only
        arrived_at = time.monotonic()

        control = self._control
        assert control is not None
        initiator = self._initiators.randrange(self.world_size)  # advanced once per round on every rank
        s = self.config.max_staleness
        synchronous = flush or self._known_sync(q)
        # Only a round activated through the store, or a staleness gate that a
        # later round activated through the store waits on, needs the count.
        gate = s is not None and not self._known_sync(q + s)
        arrived = control.arrive(q) if (not synchronous or gate) else None
        if not synchronous:
            needed = self.config.activation_count(self.world_size, sync_round=False)
            meets_rule = arrived == needed if needed is not None else initiator == self.rank
            if meets_rule:
                with self._cond:
                    self._claim_activation(q)
                control.meet_condition(q, self._conditions(q))
        if gate and arrived == self.world_size:
            # Everybody has arrived at q: the gate of round q + s opens.
            control.meet_condition(q + s, self._conditions(q + s))
        if flush and not self._known_sync(q):
            # Our communication thread may be blocked in the store on round q: the
            # flush makes q synchronous, so wake it (the other ranks flush at q too).
            # After the counting above, so that the thread's last collection sees it.
            control.wake(q)
        with self._cond:
            self._submitted[q] = _Submitted(started, arrived_at, initiator, arrived if arrived is not None else "?",
                                            empty=tensors is None and not flush)
        return q

    def _collect(self, q: int, *, since_submit: bool = False) -> RoundResult:
        """Caller's thread: waits for round ``q`` (submitted here) and returns its result with this rank's stats.

        ``since_submit``: the stats' ``wait_time`` counts from the submission (``arrive``: the
        store's counting included, as before the split); else from now, the time spent blocked here.
        """
        with self._cond:
            info = self._submitted[q]
        started = info.started if since_submit else time.perf_counter()
        result = self._wait_result(q, info)
        with self._cond:
            del self._submitted[q]
        if result.stats.stop:
            self._state = "stopped"  # the communication thread has ended after this round
        stats = dataclasses.replace(
            result.stats,
            wait_time=time.perf_counter() - started,
            arrived_at=info.arrived_at,
            skipped=info.empty,
            initiator=info.initiator if self.config.mode == "majority" and not result.stats.synchronous else None,
        )
        return dataclasses.replace(result, stats=stats)

    def _conditions(self, round_index: int) -> int:
        """How many conditions activate ``round_index``: the mode's rule, plus the staleness gate."""
        s = self.config.max_staleness
        return 2 if s is not None and round_index - s >= self._first_round else 1

    def _wait_result(self, q: int, info: "_Submitted") -> RoundResult:
        def done() -> bool:
            self._raise_if_failed(q)
            if self._closing:
                raise EngineClosedError(f"close() was called while waiting for round {q}", rank=self.rank, round_index=q)
            return q in self._results

        self._wait_on_cond(
            done,
            q,
            f"round {q} did not complete (mode={self.config.mode}"
            + (f", {info.arrived} of {self.world_size} ranks had arrived at this step when this rank did"
               if isinstance(info.arrived, int) else "")  # synchronous rounds count no arrivals
            + "); is a rank dead or stalled?",
        )
        return self._take_result(q)

    def _take_result(self, r: int) -> RoundResult:
        """Caller's thread, protected: pops round ``r``'s published result, usable on the caller's stream."""
        with self._cond:
            result = self._results.pop(r)
            done = self._done_events.pop(r) if self._cuda_device is not None else None
        if isinstance(result, BaseException):
            raise result
        hand_over(result, done, self._cuda_device)
        return result

    def _published(self, after: int) -> list[RoundResult]:
        """Under ``self._cond``, protected: the results published for rounds after ``after``, in round order."""
        taken = [self._results[r] for r in sorted(self._results) if r > after]
        return [r for r in taken if isinstance(r, RoundResult)]

    def _await_published(self, after: int, why: str) -> None:
        """Caller's thread, protected: CUDA: waits (bounded) until the results after round ``after`` are written.

        A host read of a result (a checkpoint's copy) then never sees it half-written.
        """
        with self._cond:
            events = sorted((r, e) for r, e in self._done_events.items() if r > after)
        for r, event in events:  # pragma: no cover - needs GPUs
            self._await_gpu(r, f"round {r}'s result ({why})", event)

    def _record_ready(self, deposit: Deposit) -> None:
        """Caller's thread, protected: CUDA: records on its current stream that ``deposit`` is written."""
        if self._cuda_device is not None:  # pragma: no cover - needs GPUs
            deposit.ready = torch.cuda.Event()
            deposit.ready.record(torch.cuda.current_stream(self._cuda_device))

    def _raise_if_failed(self, q: int) -> None:
        if self._error is not None:
            err = self._error
            if isinstance(err, PartialCollectiveError):
                raise err
            raise PartialCollectiveError(
                f"the communication thread failed: {err!r}", rank=self.rank, round_index=q
            ) from err

