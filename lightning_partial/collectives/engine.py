"""PartialAllreduce: eager-SGD's partial collectives over torch.distributed.

Threads and collectives (the contract):

* The **caller's thread** (the training loop) calls :meth:`PartialAllreduce.arrive`
  once per step, in step order, then :meth:`~PartialAllreduce.flush` once at the
  end. It deposits its gradient in the send buffer, counts its arrival in the
  store and, if its arrival meets the round's activation rule, activates the
  round. It then blocks only until the result of *its* step's round is there.
  It never issues a collective.
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
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_partial.collectives.config import PartialAllreduceConfig
from lightning_partial.collectives.control import ControlPlane
from lightning_partial.collectives.errors import (
    EngineClosedError,
    PartialCollectiveError,
    PartialCollectiveTimeout,
)
from lightning_partial.collectives.layout import TensorLayout
from lightning_partial.collectives.nccl import (
    CompletionWatch,
    abort_group,
    await_event,
    destroy_group,
    nccl_data_group,
    warm_up,
)
from lightning_partial.collectives.stats import RoundStats

log = logging.getLogger(__name__)

Tensors = Union[Tensor, Sequence[Tensor]]

# Columns of the per-rank header row.
_COUNT, _NEWEST, _OLDEST, _ACTIVATED, _FLUSH, _PROGRESS, _DROPPED, _STOP, _DISCOUNT = range(9)
_HEADER_WIDTH = 9
# _DISCOUNT holds the gradients' worth that staleness weights withheld, in fixed point
# (2**-24: exact for mu = 0.5 and tau <= 24, within 6e-8 per contribution otherwise).
_DISCOUNT_SCALE = 1 << 24
# A header fused into the data travels as 8-bit limbs of its int64 values, one
# element each: integers up to 255 are exact in every floating dtype a gradient
# has (bfloat16 included), and each rank writes only its own row, so the sum
# over ranks is exact. Header values are never negative.
_LIMB_BITS = 8
_LIMBS = 64 // _LIMB_BITS
_LIMB_SHIFTS = torch.arange(_LIMBS, dtype=torch.int64) * _LIMB_BITS


@dataclass
class _Deposit:
    """Gradients of one or more steps waiting in this rank's send buffer."""

    flats: list[Tensor]
    step: int
    ready: Optional[torch.cuda.Event] = None  # recorded on the producer's stream
    weight: float = 1.0  # set at the round's snapshot: config.staleness.weight(round - step)
    samples: int = 0  # DelayedAllreduce: samples summed into ``flats``
    first_step: Optional[int] = None  # DelayedAllreduce: round index of the oldest micro-batch in it


@dataclass(frozen=True)
class _Issued:
    """A collective in flight: its work, and whether NCCL runs it on the engine's side stream.

    ``stream_ordered``: ``wait()`` only orders the side stream after the kernel
    (it does not block this thread); its completion on the GPU is bounded by the
    engine's :class:`~lightning_partial.collectives.nccl.CompletionWatch`.
    """

    work: Any
    stream_ordered: bool = False


@dataclass(frozen=True, eq=False)
class RoundResult:
    """The result of one round, identical on every rank.

    ``tensors`` are shaped like the engine's tensors and already normalised;
    on CUDA they are ready to use on the caller's current stream. They are
    views of engine-allocated buffers that belong to the caller until it calls
    :meth:`release` (optional: it lets the engine reuse the memory).
    """

    round_index: int
    tensors: list[Tensor]
    stats: RoundStats
    buffers: list[Tensor] = dataclasses.field(default_factory=list, repr=False)
    # GroupAverage only: this rank's own contribution to the round (read-only views),
    # and whether it is in the group sum (``stale="skip"`` leaves out a repeated model).
    sent: list[Tensor] = dataclasses.field(default_factory=list, repr=False)
    included: bool = True
    layout: Optional[TensorLayout] = dataclasses.field(default=None, repr=False, compare=False)
    # Called once by release(): the engine may then reuse what else the result showed (``sent``).
    on_release: Optional[Callable[[], None]] = dataclasses.field(default=None, repr=False, compare=False)
    _released: list[bool] = dataclasses.field(default_factory=list, repr=False, compare=False)

    def release(self) -> None:
        """Hands the buffers back to the engine; ``tensors`` (and ``sent``) must not be used afterwards.

        Idempotent: a second call does nothing (a buffer is never pooled twice).
        """
        if self._released:
            return
        self._released.append(True)
        if self.layout is not None and self.buffers:
            buffers = list(self.buffers)
            self.buffers.clear()
            self.layout.recycle(buffers)
        if self.on_release is not None:
            self.on_release()


def _release_later(groups: list[Any], seconds: float) -> None:
    """Holds ``groups`` for ``seconds``, then drops them: their destructors run on this thread."""
    time.sleep(seconds)
    groups.clear()


def _error_kind(err: BaseException) -> type[PartialCollectiveError]:
    """:class:`PartialCollectiveTimeout` if torch's ``err`` reports a timeout, else :class:`PartialCollectiveError`."""
    text = str(err).lower()
    return PartialCollectiveTimeout if ("timed out" in text or "timeout" in text) else PartialCollectiveError


def _is_plain_int(dtype: torch.dtype) -> bool:
    return dtype in (torch.int32, torch.int64)


class PartialAllreduce:
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
    """

    # Whether the header may ride in the data allreduce (subclasses whose data
    # collective differs between ranks must check the header first: False).
    _FUSE_HEADER = True

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
            self.layout = TensorLayout(tensors, tail=world_size * _HEADER_WIDTH * _LIMBS)

        # Shared between the caller's thread and the communication thread;
        # every field below is guarded by self._cond.
        self._cond = threading.Condition()
        self._step = 0  # the next step the caller arrives at
        self._snapshotted = -1  # the last round whose send buffer was taken
        self._pending: list[_Deposit] = []
        self._dropped = 0
        self._activated_here: set[int] = set()
        self._flush_round: Optional[int] = None
        self._results: dict[int, Union[RoundResult, BaseException]] = {}
        self._error: Optional[BaseException] = None
        self._waiting_round: Optional[int] = None
        self._closing = False
        # Written without the lock: request_stop() may run in a signal handler
        # that interrupted the caller's thread while it held self._cond.
        self._stop_requested = False

        self._initiators = random.Random(config.seed)
        self._arrivals_seen: tuple[int, object] = (-1, "?")  # (step, count): for a timeout's message
        self._first_round = 0
        self._state = "new"  # new -> running -> flushed -> closed
        self._thread: Optional[threading.Thread] = None
        self._control: Optional[ControlPlane] = None
        self._header_pg: Any = None
        self._data_pg: Any = None
        # The bound of the running round's collectives (communication thread): collective_bound for
        # rounds activated through the store, which every rank enters promptly; timeout for rounds
        # that every rank enters on its own arrival (they wait for the slowest rank's compute).
        self._round_bound = config.collective_bound
        # Until when a gloo collective issued may still occupy its group's worker (see _retire_groups).
        self._inflight_until = 0.0
        # Set by the communication thread from taking a round's snapshot until its result
        # is published: collectives of that round may be in flight (see close()).
        self._in_round = False
        self._stream: Optional[torch.cuda.Stream] = None
        self._done_events: dict[int, torch.cuda.Event] = {}  # CUDA: result ready, per round
        self._watch: Optional[CompletionWatch] = None  # NCCL: bounds the rounds' completion on the GPU
        self._liveness: Any = None  # see attach_liveness()

    # ------------------------------------------------------------------ API
    @property
    def step(self) -> int:
        """The step (= round) of the next :meth:`arrive`."""
        return self._step

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
        timeout = self.config.timeout
        name = self.config.name
        self._control = ControlPlane(
            self._store, name=name, rank=self.rank, world_size=self.world_size, timeout=timeout,
            op_timeout=self.config.collective_bound,
        )
        prefix = f"lightning_partial/{name}/pg/"
        try:
            self._header_pg = self._gloo_group(prefix + "gloo")
            if self._cuda_device is not None:  # pragma: no cover - needs GPUs
                self._stream = torch.cuda.Stream(device=self._cuda_device)
            if self.backend == "nccl":  # pragma: no cover - needs GPUs
                # After the gloo rendezvous: every rank is in start() by now.
                assert self._cuda_device is not None and self._stream is not None
                self._data_pg = nccl_data_group(
                    rank=self.rank, world_size=self.world_size, device=self._cuda_device, timeout=timeout,
                    description=prefix + "nccl",
                )
                warm_up(self._data_pg, self._cuda_device, self._stream,
                        seconds=self.config.rendezvous_timeout.total_seconds(), rank=self.rank)
                self._watch = CompletionWatch(
                    timeout=timeout.total_seconds(), rank=self.rank, name=f"lightning_partial-{name}-rank{self.rank}",
                    on_expired=self._expired,
                ).start()
            else:
                self._data_pg = self._gloo_group(prefix + "gloo-data")
        except BaseException:
            # No round has run on them: dropping them here is immediate.
            if self.backend == "nccl" and self._data_pg is not None:  # pragma: no cover - needs GPUs
                abort_group(self._data_pg)
            self._control = self._header_pg = self._data_pg = None
            raise
        self._snapshotted = self._step - 1
        self._first_round = self._step  # a resumed run has no arrivals before it
        self._state = "running"
        self._thread = threading.Thread(
            target=self._run, name=f"lightning_partial-{name}-rank{self.rank}", daemon=True
        )
        self._thread.start()
        return self

    def _gloo_group(self, prefix: str) -> Any:
        """A gloo group of all ranks whose rendezvous waits ``setup_timeout``, its collectives ``collective_bound``.

        One bound for both would make a short round timeout (to detect a stalled
        peer quickly) also the bound on how far apart the ranks may start. A round
        whose collectives wait for other ranks' compute passes ``timeout`` per
        collective (:meth:`_start`).
        """
        setup = self.config.rendezvous_timeout
        try:
            pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix, self._store), self.rank, self.world_size, setup)
        except Exception as err:
            kind = _error_kind(err)
            what = f"did not complete within {setup.total_seconds():g}s (setup_timeout)"
            raise kind(
                f"set-up of the engine's process group {prefix!r} "
                f"{what if kind is PartialCollectiveTimeout else 'failed'}: every rank must call start() "
                f"({type(err).__name__}: {err})",
                rank=self.rank,
                round_index=None,
            ) from err
        # Every allreduce passes its round's bound (_start) and every point-to-point wait its
        # own (_finish); the group's default bounds anything else. Backend.set_timeout is
        # torch >= 2.9; ProcessGroupGloo._set_default_timeout is older.
        set_timeout = getattr(pg, "set_timeout", None) or getattr(pg, "_set_default_timeout", None)
        if set_timeout is not None:
            set_timeout(self.config.collective_bound)
        return pg

    def arrive(self, tensors: Tensors) -> RoundResult:
        """Contributes this step's gradient and returns the result of this step's round.

        Blocks only until this step's round has completed: if another rank already
        activated it, that is the time of the collective itself; if not, until the
        activation rule is met (never, in ``solo`` mode, since this arrival meets it).
        """
        self._check_running("arrive")
        return self._arrive(self._as_list(tensors), flush=False)

    def flush(self, tensors: Optional[Tensors] = None) -> RoundResult:
        """The final, fully-synchronous round: every rank's pending gradients are summed.

        Every rank must call it at the same step. Afterwards nothing is pending
        anywhere; the engine accepts no more rounds (``close()`` it).
        ``tensors``, if given, are a last fresh contribution.
        """
        self._check_running("flush")
        with self._cond:
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

    def request_stop(self) -> None:
        """Asks every rank to stop after the next round this rank's thread snapshots.

        The request travels in that round's header, so every rank learns it in the
        same round ``R`` (``result.stats.stop``): every communication thread ends
        after ``R``, and an ``arrive`` after ``R`` raises ``EngineClosedError``.
        Safe to call from a signal handler. Not available in pure ``sync`` mode,
        whose rounds carry no header.
        """
        if self.config.mode == "sync":
            raise ValueError(
                f"rank {self.rank}: request_stop() needs the round header, which pure mode='sync' does not send"
            )
        self._stop_requested = True

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
                for pg in {id(self._data_pg): self._data_pg, id(self._header_pg): self._header_pg}.values():
                    abort_group(pg)  # not every backend supports it: then a no-op
                log.warning("rank %d: the communication thread did not stop within %.1fs", self.rank, timeout)
        stuck = thread is not None and thread.is_alive()
        # A collective may still be in flight if the thread failed (its peers failed
        # too and never complete it), is stuck, or stopped inside a round.
        if self._error is not None or stuck or self._in_round or not gpu_idle:
            self._retire_groups()
            return
        if self.backend == "nccl":  # pragma: no cover - needs GPUs
            # Release the engine's NCCL communicator now rather than at garbage collection
            # (torch warns about a NCCL group destroyed without shutdown).
            destroy_group(self._data_pg)
        # Nothing in flight: the groups' destructors return at once; the store clients close
        # now too, not whenever this object is collected.
        self._header_pg = self._data_pg = None
        self._control = self._store = None  # type: ignore[assignment]

    def _retire_groups(self) -> None:
        """Hands the process groups to a daemon thread that drops them once their collectives timed out.

        A gloo group's destructor joins its worker threads: destroying one while a
        collective waits for peers that failed blocks until that collective's
        timeout, in whichever thread drops the last reference. That may be any
        thread that runs the garbage collector: in the tests, another engine's
        ``start()`` and rounds stalled for the 20 s timeout of a closed engine's
        collective. ``abort()`` and ``shutdown()`` do not cancel gloo collectives
        (torch 2.15), so the groups are held until every collective they run has
        failed: each is bounded by its round's bound since it began, so the hold
        is what is left of the latest one (``collective_bound`` after a failure in
        a prompt round). An NCCL data group is aborted instead: NCCL can cancel its work.
        """
        groups = [pg for pg in (self._header_pg, self._data_pg) if pg is not None]
        if self.backend == "nccl" and self._data_pg is not None:  # pragma: no cover - needs GPUs
            abort_group(self._data_pg)
            groups = [pg for pg in groups if pg is not self._data_pg]
        self._header_pg = self._data_pg = None
        if groups:
            threading.Thread(
                target=_release_later,
                args=(groups, self._retire_hold()),
                name=f"lightning_partial-{self.config.name}-rank{self.rank}-retired-groups",
                daemon=True,
            ).start()

    def _retire_hold(self) -> float:
        """Seconds until every gloo collective issued has failed by its own bound, plus a margin."""
        return max(0.0, self._inflight_until - time.monotonic()) + 1.0

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

    def attach_liveness(self, liveness: Any) -> None:
        """A :class:`~lightning_partial.collectives.liveness.Heartbeat` consulted when a collective times out.

        Before :meth:`start`. A collective that timed out then raises the heartbeat's
        verdict naming the rank that stopped answering, if one comes within two beats.
        """
        self._liveness = liveness

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
            pending.append(_Deposit(self.layout.from_data(flats), int(step)))
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
        q = self._step
        deposit = None
        if tensors is not None:
            self.layout.check(tensors, rank=self.rank, round_index=q)
            flats = self.layout.flatten(tensors)
            ready = None
            if self._cuda_device is not None:  # pragma: no cover - needs GPUs
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(self._cuda_device))
            deposit = _Deposit(flats, q, ready)
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
                    self._activated_here.add(q)
                control.meet_condition(q, self._conditions(q))
        if gate and arrived == self.world_size:
            # Everybody has arrived at q: the gate of round q + s opens.
            control.meet_condition(q + s, self._conditions(q + s))
        if flush and not self._known_sync(q):
            # Our communication thread may be blocked in the store on round q: the
            # flush makes q synchronous, so wake it (the other ranks flush at q too).
            # After the counting above, so that the thread's last collection sees it.
            control.wake(q)
        self._arrivals_seen = (q, arrived if arrived is not None else "?")

        result = self._wait_result(q)
        if result.stats.stop:
            self._state = "stopped"  # the communication thread has ended after this round
        stats = dataclasses.replace(
            result.stats,
            wait_time=time.perf_counter() - started,
            arrived_at=arrived_at,
            initiator=initiator if self.config.mode == "majority" and not result.stats.synchronous else None,
        )
        return dataclasses.replace(result, stats=stats)

    def _known_sync(self, round_index: int) -> bool:
        """Whether every rank knows in advance that ``round_index`` is synchronous.

        Such a round needs no activation through the store: each communication
        thread enters the collective as soon as its own rank has arrived, and the
        collective itself waits for everybody. (The final flush is synchronous
        too, but not known in advance: flush() wakes its own thread instead.)
        """
        return self.config.mode == "sync" or self.config.is_sync_round(round_index)

    def _conditions(self, round_index: int) -> int:
        """How many conditions activate ``round_index``: the mode's rule, plus the staleness gate."""
        s = self.config.max_staleness
        return 2 if s is not None and round_index - s >= self._first_round else 1

    def _wait_result(self, q: int) -> RoundResult:
        def done() -> bool:
            self._raise_if_failed(q)
            if self._closing:
                raise EngineClosedError(f"close() was called while waiting for round {q}", rank=self.rank, round_index=q)
            return q in self._results

        seen, arrived = self._arrivals_seen
        self._wait_on_cond(
            done,
            q,
            f"round {q} did not complete (mode={self.config.mode}, "
            f"{arrived if seen == q else '?'} of {self.world_size} ranks had arrived at this step "
            "when this rank did); is a rank dead or stalled?",
        )
        with self._cond:
            result = self._results.pop(q)
        if isinstance(result, BaseException):
            raise result
        if self._cuda_device is not None:  # pragma: no cover - needs GPUs
            stream = torch.cuda.current_stream(self._cuda_device)
            with self._cond:
                event = self._done_events.pop(q)
            stream.wait_event(event)
            for t in result.tensors:
                t.record_stream(stream)
        return result

    def _raise_if_failed(self, q: int) -> None:
        if self._error is not None:
            err = self._error
            if isinstance(err, PartialCollectiveError):
                raise err
            raise PartialCollectiveError(
                f"the communication thread failed: {err!r}", rank=self.rank, round_index=q
            ) from err

    # ---------------------------------------------------- communication thread
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
                activated = time.monotonic()
                with self._cond:
                    if self._closing:
                        return
                    self._waiting_round = None
                    self._in_round = True
                    deposits, self._pending = self._pending, []
                    self._snapshotted = r
                    # Activated through the store: every rank's thread enters this round's collectives
                    # now, however slow its compute. Otherwise (sync rounds, the flush) they wait for it.
                    prompt = not synchronous and self._flush_round != r
                    self._round_bound = self.config.collective_bound if prompt else self.config.timeout
                    self._cond.notify_all()  # DelayedAllreduce.deposit waits for the snapshot
                    row = torch.zeros(self.world_size, _HEADER_WIDTH, dtype=torch.int64)
                    count, newest, oldest = self._describe_contribution(deposits)
                    row[self.rank, _COUNT] = count
                    row[self.rank, _NEWEST] = newest + 1
                    row[self.rank, _OLDEST] = oldest + 1
                    row[self.rank, _ACTIVATED] = int(r in self._activated_here)
                    self._activated_here.discard(r)
                    row[self.rank, _FLUSH] = int(self._flush_round == r)
                    row[self.rank, _PROGRESS] = self._step
                    row[self.rank, _DROPPED] = self._dropped
                    row[self.rank, _STOP] = int(self._stop_requested)
                    row[self.rank, _DISCOUNT] = round(self._weigh(r, deposits) * _DISCOUNT_SCALE)
                    self._dropped = 0
                result = self._reduce(r, row, deposits, began=began, activated=activated)
                with self._cond:
                    self._results[r] = result
                    self._in_round = False
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

    def _explain(self, err: BaseException) -> BaseException:
        """A collective that failed: the heartbeat's verdict naming the rank gone, if one comes soon.

        Any failure, not only a timeout: a survivor that read the verdict first and
        exited closes its connections, and the others' collectives then fail with
        "connection closed" before they have read it.
        """
        liveness = self._liveness
        if liveness is None or not isinstance(err, PartialCollectiveError) or isinstance(err, EngineClosedError):
            return err
        verdict = liveness.wait_verdict(2 * liveness.interval)
        if verdict is None:
            return err
        named = PartialCollectiveError(f"{verdict} (then: {err})", rank=self.rank, round_index=err.round_index)
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
                    raise PartialCollectiveTimeout(f"timed out after {timeout:g}s: {what}", rank=self.rank, round_index=r)
                self._cond.wait(timeout=remaining)

    # Hooks for engines that exchange something else than a global sum of
    # gradients (GroupAverage), or that activate rounds otherwise (DelayedAllreduce):
    # how a round gets activated, what a rank contributes, which data collectives
    # a round issues, how their outcome becomes the round's result, what follows it.
    def _await_activation(self, r: int) -> None:
        """Communication thread: blocks until round ``r`` is activated (through the store)."""
        assert self._control is not None
        self._control.wait_activated(r, self.config.timeout)

    def _after_round(self, r: int, result: RoundResult) -> None:
        """Communication thread, after round ``r`` was published (not after a flush or stop round)."""

    def _weigh(self, r: int, deposits: list[_Deposit]) -> float:
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

    def _describe_contribution(self, deposits: list[_Deposit]) -> tuple[int, int, int]:
        """Header columns of this rank's contribution: (count, newest step, oldest step); steps -1 if none."""
        if not deposits:
            return 0, -1, -1
        return len(deposits), max(d.step for d in deposits), min(d.step for d in deposits)

    def _send_buffer(self, deposits: list[_Deposit]) -> list[Tensor]:
        """The flat buffers this rank contributes to the round (reduced in place)."""
        return self._sum_deposits(deposits)

    def _start_data(self, r: int, flats: list[Tensor], *, global_round: bool) -> tuple[list[tuple[Any, str]], Any]:
        """Starts the round's data collectives; returns the works to wait for and a context for :meth:`_finish_data`."""
        return [(self._start(self._data_pg, flat, r, "data"), "data") for flat in flats], None

    def _divisor(self, total: int) -> float:
        """What a round's sum is divided by, given its ``total`` contributions (``config.normalize``)."""
        normalize = self.config.normalize
        return float(self.world_size if normalize == "world" else max(total, 1) if normalize == "contributors" else 1)

    def _finish_data(
        self, r: int, flats: list[Tensor], context: Any, header: Tensor, *, global_round: bool
    ) -> tuple[list[Tensor], float, dict[str, Any]]:
        """After the collectives: the result's flat buffers, the divisor applied, extra ``RoundStats`` fields."""
        counts = header[:, _COUNT].tolist()
        divisor = self._divisor(int(sum(counts)))
        if divisor != 1.0:
            with self._side_stream():
                for flat in flats:
                    flat.div_(divisor)
        return flats, divisor, {}

    def _reduce(self, r: int, header: Tensor, deposits: list[_Deposit], *, began: float, activated: float) -> RoundResult:
        """Issues the round's allreduces: the header and the data.

        With ``_fused_header`` the header rides in the data allreduce; otherwise
        it is an allreduce on the gloo header group, in flight with the data.
        In pure ``sync`` mode only the final flush carries a header.
        """
        flats = self._send_buffer(deposits)
        # Whether every rank takes part in the data collective with the same role
        # (GroupAverage: a global average). Known locally: the flush round is the
        # same step on every rank (checked below), sync_every rounds are fixed.
        global_round = bool(header[self.rank, _FLUSH]) or self.config.is_sync_round(r)
        works = []
        fused = False
        if self.config.mode == "sync" and not header[self.rank, _FLUSH]:
            # Pure sync mode: every rank contributed exactly its fresh gradient,
            # so the header is known without a collective (a tiny allreduce costs
            # as much latency as a large one on a loaded host).
            header[:, _COUNT] = 1
            header[:, _NEWEST] = header[:, _OLDEST] = header[:, _PROGRESS] = r + 1
        elif self._fused_header:
            fused = True
            self._encode_header(header, flats)
        else:
            works.append((self._start(self._header_pg, header, r, "header"), "header"))
        data_works, context = self._start_data(r, flats, global_round=global_round)
        works += data_works
        for work, what in works:
            self._finish(work, r, what)
            if what == "header":
                # Checked before waiting on the data: a rank that flushes alone runs
                # another data collective than the others (GroupAverage: a global
                # allreduce against their group send/recv), which would only end
                # at the timeout. Every rank sees the same header and raises here.
                self._check_flush(header, r)
        if fused:
            header = self._decode_header(flats)
            self._check_flush(header, r)
        flushing = header[:, _FLUSH].tolist()

        counts = header[:, _COUNT].tolist()
        newest = header[:, _NEWEST].tolist()
        oldest = header[:, _OLDEST].tolist()
        activators = [i for i, a in enumerate(header[:, _ACTIVATED].tolist()) if a]
        total = int(sum(counts))
        flats, divisor, extra = self._finish_data(r, flats, context, header, global_round=global_round)
        if self._stream is not None:  # pragma: no cover - needs GPUs
            event = torch.cuda.Event()
            event.record(self._stream)
            with self._cond:
                self._done_events[r] = event
            if self._watch is not None:
                self._watch.add(r, event, seconds=self._round_bound.total_seconds())
        stats = RoundStats(
            round_index=r,
            activator=activators[0] if activators else -1,
            initiator=None,
            synchronous=bool(flushing[0]) or self.config.mode == "sync" or self.config.is_sync_round(r),
            flush=bool(flushing[0]),
            fresh=tuple(i for i, n in enumerate(newest) if n - 1 == r),
            counts=tuple(int(c) for c in counts),
            staleness=tuple(r - (n - 1) if c else None for c, n in zip(counts, newest)),
            oldest_staleness=tuple(r - (o - 1) if c else None for c, o in zip(counts, oldest)),
            progress=tuple(int(p) for p in header[:, _PROGRESS].tolist()),
            dropped=tuple(int(d) for d in header[:, _DROPPED].tolist()),
            discounted=tuple(int(d) / _DISCOUNT_SCALE for d in header[:, _DISCOUNT].tolist()),
            stop=bool(header[:, _STOP].any()),
            contributions=total,
            divisor=divisor,
            activation_latency=activated - began,
            activated_at=activated,
            **extra,
        )
        tensors = self.layout.unflatten(flats)
        return RoundResult(round_index=r, tensors=tensors, stats=stats, buffers=flats, layout=self.layout)

    def _check_flush(self, header: Tensor, r: int) -> None:
        """Raises on every rank alike if only some ranks flush at round ``r``."""
        flushing = header[:, _FLUSH].tolist()
        if 0 < sum(flushing) < self.world_size:
            raise PartialCollectiveError(
                f"ranks {[i for i, f in enumerate(flushing) if f]} called flush() at this round but ranks "
                f"{[i for i, f in enumerate(flushing) if not f]} arrived: every rank must flush at the "
                "same step (the same number of optimizer steps on every rank)",
                rank=self.rank,
                round_index=r,
            )

    def _encode_header(self, header: Tensor, flats: list[Tensor]) -> None:
        """Writes ``header`` (non-negative int64) as 8-bit limbs into the first buffer's tail."""
        limbs = (header.unsqueeze(-1) >> _LIMB_SHIFTS) & ((1 << _LIMB_BITS) - 1)
        self.layout.tail_of(flats).copy_(limbs.reshape(-1))

    def _decode_header(self, flats: list[Tensor]) -> Tensor:
        """The summed header, from the tail of the first buffer after the allreduce."""
        limbs = self.layout.tail_of(flats).to(torch.int64).reshape(self.world_size, _HEADER_WIDTH, _LIMBS)
        return (limbs << _LIMB_SHIFTS).sum(dim=-1)

    def _sum_deposits(self, deposits: list[_Deposit]) -> list[Tensor]:
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

    def _side_stream(self) -> Any:
        """The engine's side stream as the current one on CUDA; nothing on the host."""
        return torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()

    def _follow(self, deposit: _Deposit) -> None:
        """CUDA: the side stream reads ``deposit`` only after its producer wrote it, and the allocator knows."""
        if self._stream is None:
            return
        if deposit.ready is not None:  # pragma: no cover - needs GPUs
            self._stream.wait_event(deposit.ready)
        for f in deposit.flats:  # pragma: no cover - needs GPUs
            f.record_stream(self._stream)

    @staticmethod
    def _accumulate(flats: list[Tensor], deposits: list[_Deposit]) -> None:
        """``flats`` (a copy of ``deposits[0]``'s, or its own) becomes the weighted sum of the deposits, in place."""
        if deposits[0].weight != 1.0:
            for f in flats:
                f.mul_(deposits[0].weight)
        for d in deposits[1:]:
            for acc, f in zip(flats, d.flats):
                # alpha only when weighted: integer buffers refuse a float alpha.
                acc.add_(f) if d.weight == 1.0 else acc.add_(f, alpha=d.weight)

    def _start(self, pg: Any, tensor: Tensor, r: int, what: str) -> _Issued:
        """Starts an allreduce of ``tensor`` on ``pg`` (the side stream for CUDA tensors)."""
        try:
            if self.backend == "nccl" and pg is self._data_pg:  # pragma: no cover - needs GPUs
                with torch.cuda.stream(self._stream):
                    return _Issued(dist.all_reduce(tensor, group=pg, async_op=True), stream_ordered=True)
            bound = self._round_bound
            self._inflight_until = max(self._inflight_until, time.monotonic() + bound.total_seconds())
            options = dist.AllreduceOptions()
            options.timeout = bound  # the group's own default is collective_bound
            if self._stream is not None and tensor.is_cuda:  # pragma: no cover - needs GPUs
                with torch.cuda.stream(self._stream):
                    return _Issued(pg.allreduce([tensor], options))
            return _Issued(pg.allreduce([tensor], options))
        except Exception as err:
            raise self._collective_error(err, r, what) from err

    def _finish(self, issued: _Issued, r: int, what: str) -> None:
        timeout = self._round_bound
        work = issued.work
        try:
            if issued.stream_ordered:  # pragma: no cover - needs GPUs
                # wait() only orders the side stream after the kernel. NCCL's
                # wait(timeout) would block this thread until the kernel has run,
                # i.e. until the caller's compute stream has drained (measured on
                # an H100: arrive took the 200 ms of a pending kernel). The round's
                # completion on the GPU is bounded by the CompletionWatch instead.
                with torch.cuda.stream(self._stream):
                    work.wait()
                completed = True
            elif self._stream is not None:  # pragma: no cover - needs GPUs
                with torch.cuda.stream(self._stream):
                    completed = work.wait(timeout)
            else:
                completed = work.wait(timeout)
        except Exception as err:
            raise self._collective_error(err, r, what) from err
        if completed is False:
            raise PartialCollectiveTimeout(
                f"{what} allreduce did not complete within {timeout.total_seconds():g}s", rank=self.rank, round_index=r
            )

    def _expired(self, err: PartialCollectiveTimeout) -> None:  # pragma: no cover - needs GPUs
        """CompletionWatch thread: a round's NCCL kernels did not complete in time; fails the engine."""
        # The abort runs in a thread of its own: a caller blocked in a host read behind the stuck
        # kernels (a checkpoint's copy, under self._cond) is released only by it, so it must not wait
        # for the lock; and the abort itself can block while the kernels it cancels are still queued
        # behind others, so the callers must not wait for it to learn of the failure.
        data_pg = self._data_pg
        if data_pg is not None:
            name = f"lightning_partial-{self.config.name}-rank{self.rank}-abort"
            threading.Thread(target=abort_group, args=(data_pg,), name=name, daemon=True).start()
        with self._cond:
            if self._error is None and not self._closing:
                self._error = err
            self._cond.notify_all()
        log.error("%s", err)

    def _await_gpu(self, r: int, what: str, event: Optional[torch.cuda.Event] = None) -> None:
        """Before a host read of side-stream results: waits for ``event`` (else one recorded now), bounded."""
        if self._stream is None:
            return
        if event is None:  # pragma: no cover - needs GPUs
            event = torch.cuda.Event()
            event.record(self._stream)
        await_event(event, seconds=self.config.timeout.total_seconds(), rank=self.rank, round_index=r, what=what)

    def _collective_error(self, err: Exception, r: int, what: str) -> PartialCollectiveError:
        return _error_kind(err)(
            f"{what} allreduce failed ({type(err).__name__}: {err}); a peer rank probably died or stalled",
            rank=self.rank,
            round_index=r,
        )
