"""The engine's NCCL data group, and the bounds on everything that waits for NCCL.

Three rules make the CUDA path safe without a second GPU to prove it on:

* **c10d knows the group.** The data group is made with :func:`torch.distributed.new_group`
  (the public API, so c10d's registry, flight recorder and ``destroy_process_group``
  see it), bound to the engine's device (``device_id``: NCCL's communicator is
  created eagerly, not at the first round on the communication thread), and
  exercised once at ``start()`` by a one-element allreduce whose completion is
  awaited with a deadline (:func:`warm_up`). The engine's gloo rendezvous runs
  first and is bounded by ``setup_timeout``: by the time the NCCL communicator
  is created every rank is known to be in ``start()``.
* **One communicator for every exchange.** Point-to-point exchanges (model
  averaging's groups) are issued as one ``batch_isend_irecv`` per round on this
  group: batched point-to-point calls use the group's communicator, where single
  ``send``/``recv`` calls would create a two-rank communicator per peer pair,
  lazily, during a round.
* **Every wait is bounded.** A round's NCCL kernels are enqueued on the engine's
  side stream and its result is published at once (blocking the communication
  thread until the kernels have run would make it wait for the caller's whole
  compute queue). :class:`CompletionWatch` then bounds their completion on the
  GPU: a round whose kernels have not completed ``timeout`` after they were
  enqueued fails the engine with :class:`PartialCollectiveTimeout` naming the
  rank and the round, and the data group is aborted so that the stuck kernels
  return. NCCL's own watchdog is armed later (:func:`watchdog_timeout`), so the
  engine's error comes first. Host reads of results (a checkpoint, the consensus
  distance) wait with :func:`await_event`, bounded the same way.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from lightning_partial.collectives.errors import PartialCollectiveError, PartialCollectiveTimeout

log = logging.getLogger(__name__)


def watchdog_timeout(timeout: timedelta) -> timedelta:
    """NCCL's watchdog bound for a group whose rounds the engine bounds by ``timeout``: later, so ours fires first."""
    return timeout + max(timedelta(seconds=60), timeout / 10)


def nccl_data_group(
    *, rank: int, world_size: int, device: torch.device, timeout: timedelta, description: str
) -> Any:
    """A NCCL group of every rank of the default group, bound to ``device``; collective over the default group.

    Raises ``ValueError`` if torch.distributed is not initialised or its ranks
    differ from the engine's: ``new_group`` builds on the default group.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "backend='nccl' needs torch.distributed to be initialised (init_process_group, as Lightning, "
            "torchrun and SLURM set-ups do): the engine creates its NCCL group with dist.new_group"
        )
    if dist.get_rank() != rank or dist.get_world_size() != world_size:
        raise ValueError(
            f"backend='nccl': the engine's rank {rank} of {world_size} must be the default group's "
            f"(rank {dist.get_rank()} of {dist.get_world_size()})"
        )
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    kwargs: dict[str, Any] = {"backend": "nccl", "timeout": watchdog_timeout(timeout), "group_desc": description}
    try:
        return dist.new_group(device_id=device, **kwargs)
    except TypeError:  # pragma: no cover - torch without new_group(device_id=): warm_up creates it
        return dist.new_group(**kwargs)


def await_event(event: torch.cuda.Event, *, seconds: float, rank: int, round_index: Optional[int], what: str) -> None:
    """Blocks until ``event`` has completed on the GPU, at most ``seconds``; raises naming rank and round.

    Polls instead of ``event.synchronize()``, which cannot be bounded.
    """
    deadline = time.monotonic() + seconds
    pause = 1e-4
    while not event.query():
        if time.monotonic() > deadline:
            raise PartialCollectiveTimeout(
                f"{what} did not complete on the GPU within {seconds:g}s; a peer rank probably died or stalled",
                rank=rank,
                round_index=round_index,
            )
        time.sleep(pause)
        pause = min(pause * 2, 0.01)


def warm_up(group: Any, device: torch.device, stream: torch.cuda.Stream, *, seconds: float, rank: int) -> None:
    """One one-element allreduce on ``group``: the communicator exists and every rank reached it, or an error."""
    with torch.cuda.stream(stream):
        probe = torch.ones(1, device=device)
        try:
            dist.all_reduce(probe, group=group)
        except Exception as err:
            raise PartialCollectiveError(
                f"set-up of the engine's NCCL group failed ({type(err).__name__}: {err})", rank=rank, round_index=None
            ) from err
        done = torch.cuda.Event()
        done.record(stream)
    await_event(done, seconds=seconds, rank=rank, round_index=None, what="set-up of the engine's NCCL group")


def abort_group(group: Any) -> None:
    """Aborts ``group``'s communicators (NCCL can cancel its kernels); never raises."""
    try:
        abort = getattr(group, "abort", None)
        if abort is not None:
            abort()
        else:  # pragma: no cover - older torch
            dist.distributed_c10d._abort_process_group(group)
    except Exception as err:  # already aborted or destroyed
        log.debug("NCCL group abort: %s", err)


def destroy_group(group: Any) -> None:
    """Releases ``group`` through c10d (nothing in flight); never raises."""
    try:
        dist.destroy_process_group(group)
    except Exception as err:  # already destroyed, or the default group is gone
        log.debug("NCCL group destroy: %s", err)


class CompletionWatch:
    """Bounds the GPU-side completion of enqueued rounds (see the module docstring).

    Threads: the communication thread calls :meth:`add` after enqueueing a
    round; a daemon thread of its own polls the rounds' events in order and,
    when the oldest has not completed ``timeout`` seconds after it was added,
    calls ``on_expired`` with the error (once) and ends. :meth:`stop` ends it.
    """

    def __init__(
        self, *, timeout: float, rank: int, name: str, on_expired: Callable[[PartialCollectiveTimeout], None]
    ) -> None:
        self.timeout = timeout
        self.rank = rank
        self._on_expired = on_expired
        self._queue: deque[tuple[int, torch.cuda.Event, float, float]] = deque()
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._poll = min(0.5, max(0.01, timeout / 20))
        self._thread = threading.Thread(target=self._watch, name=f"{name}-completion-watch", daemon=True)

    def start(self) -> "CompletionWatch":
        self._thread.start()
        return self

    def add(self, round_index: int, event: torch.cuda.Event, seconds: Optional[float] = None) -> None:
        """Watches ``event`` of ``round_index``: it must complete within ``seconds`` (default ``timeout``)."""
        with self._lock:
            self._queue.append((round_index, event, time.monotonic(), self.timeout if seconds is None else seconds))

    def pending(self) -> list[int]:
        """Rounds enqueued whose completion has not been seen yet."""
        with self._lock:
            return [r for r, _, _, _ in self._queue]

    def wait_idle(self, seconds: float) -> bool:
        """Whether every enqueued round completed within ``seconds`` (polled; never blocks longer)."""
        deadline = time.monotonic() + seconds
        while True:
            with self._lock:
                while self._queue and self._queue[0][1].query():
                    self._queue.popleft()
                if not self._queue:
                    return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)

    def stop(self, timeout: float = 5.0) -> None:
        self._stopped.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=timeout)

    def _watch(self) -> None:
        while not self._stopped.wait(self._poll):
            with self._lock:
                while self._queue and self._queue[0][1].query():
                    self._queue.popleft()
                oldest = self._queue[0] if self._queue else None
            if oldest is None:
                continue
            r, _, since, bound = oldest
            waited = time.monotonic() - since
            if waited > bound:
                self._on_expired(
                    PartialCollectiveTimeout(
                        f"the NCCL collectives of round {r} did not complete on the GPU within {bound:g}s "
                        "of being enqueued; a peer rank probably died or stalled",
                        rank=self.rank,
                        round_index=r,
                    )
                )
                return
