"""The engine's own process groups, and the collectives its communication thread issues on them.

Every engine owns a gloo header group and a data group (gloo, or NCCL for CUDA
tensors), built at ``start()`` from the engine's store (the NCCL one with
``dist.new_group``, see :mod:`~lightning_partial.collectives.nccl`); no gloo
engine touches the default group. Only the communication thread issues
collectives on them, always naming the group: :meth:`EngineGroups._start`
takes it as an argument (``self._data_pg`` or ``self._header_pg``), and every
wait (:meth:`EngineGroups._finish`) is bounded by the running round's bound,
its error naming rank and round.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_partial.collectives.config import PartialAllreduceConfig
from lightning_partial.collectives.errors import PartialCollectiveError, PartialCollectiveTimeout, error_kind
from lightning_partial.collectives.nccl import CompletionWatch, abort_group, await_event, nccl_data_group, warm_up
from lightning_partial.collectives.rounds import Deposit, Issued

log = logging.getLogger(__name__)


def _release_later(groups: list[Any], seconds: float) -> None:
    """Holds ``groups`` for ``seconds``, then drops them: their destructors run on this thread."""
    time.sleep(seconds)
    groups.clear()


class EngineGroups:
    """Mixin of :class:`~lightning_partial.collectives.PartialAllreduce`: its process groups and collectives.

    State (set by :meth:`_init_groups`): ``_header_pg``, ``_data_pg`` (built at
    ``start()``, dropped or retired at ``close()``), ``_stream`` (the CUDA side
    stream the collectives and the results' arithmetic run on), ``_watch`` (NCCL:
    bounds a round's completion on the GPU), ``_round_bound`` (the bound of the
    running round's collectives, set by the communication thread at each
    snapshot) and ``_inflight_until`` (until when a gloo collective issued may
    still occupy its group's worker).
    """

    config: PartialAllreduceConfig
    rank: int
    world_size: int
    backend: str
    _store: Any
    _cuda_device: Optional[torch.device]
    _cond: threading.Condition
    _error: Optional[BaseException]
    _closing: bool

    def _init_groups(self) -> None:
        self._header_pg: Any = None
        self._data_pg: Any = None
        # The bound of the running round's collectives (communication thread): collective_bound for
        # rounds activated through the store, which every rank enters promptly; timeout for rounds
        # that every rank enters on its own arrival (they wait for the slowest rank's compute).
        self._round_bound: timedelta = self.config.collective_bound
        # Until when a gloo collective issued may still occupy its group's worker (see _retire_groups).
        self._inflight_until = 0.0
        self._stream: Optional[torch.cuda.Stream] = None
        self._watch: Optional[CompletionWatch] = None  # NCCL: bounds the rounds' completion on the GPU

    def _open_groups(self) -> None:
        """``start()``, caller's thread: the header group, the side stream, the data group (all ranks)."""
        timeout = self.config.timeout
        name = self.config.name
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
            self._header_pg = self._data_pg = None
            raise

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
            kind = error_kind(err)
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

    def _start(self, pg: Any, tensor: Tensor, r: int, what: str) -> Issued:
        """Communication thread: starts an allreduce of ``tensor`` on ``pg`` (the side stream for CUDA tensors)."""
        try:
            if self.backend == "nccl" and pg is self._data_pg:  # pragma: no cover - needs GPUs
                with torch.cuda.stream(self._stream):
                    return Issued(dist.all_reduce(tensor, group=pg, async_op=True), what, stream_ordered=True)
            bound = self._round_bound
            self._inflight_until = max(self._inflight_until, time.monotonic() + bound.total_seconds())
            options = dist.AllreduceOptions()
            options.timeout = bound  # the group's own default is collective_bound
            if self._stream is not None and tensor.is_cuda:  # pragma: no cover - needs GPUs
                with torch.cuda.stream(self._stream):
                    return Issued(pg.allreduce([tensor], options), what)
            return Issued(pg.allreduce([tensor], options), what)
        except Exception as err:
            raise self._collective_error(err, r, what) from err

    def _finish(self, issued: Issued, r: int, what: Optional[str] = None) -> None:
        """Communication thread: waits for ``issued``, bounded by the round's bound; raises naming rank and round."""
        what = issued.what if what is None else what
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

    def _collective_error(self, err: Exception, r: int, what: str) -> PartialCollectiveError:
        kind = error_kind(err)
        # A timeout names the bound it ran under: the round's (the set-up bound never applies here).
        failed = f"timed out after {self._round_bound.total_seconds():g}s" if kind is PartialCollectiveTimeout else "failed"
        return kind(
            f"{what} allreduce {failed} ({type(err).__name__}: {err}); a peer rank probably died or stalled",
            rank=self.rank,
            round_index=r,
        )

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

    def _abort_groups(self) -> None:
        """``close()``: the communication thread is stuck in a collective; aborts both groups so that it returns."""
        for pg in {id(self._data_pg): self._data_pg, id(self._header_pg): self._header_pg}.values():
            abort_group(pg)  # not every backend supports it: then a no-op

    # ------------------------------------------------------------------ CUDA
    def _side_stream(self) -> Any:
        """The engine's side stream as the current one on CUDA; nothing on the host."""
        return torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()

    def _follow(self, deposit: Deposit) -> None:
        """CUDA: the side stream reads ``deposit`` only after its producer wrote it, and the allocator knows."""
        if self._stream is None:
            return
        if deposit.ready is not None:  # pragma: no cover - needs GPUs
            self._stream.wait_event(deposit.ready)
        for f in deposit.flats:  # pragma: no cover - needs GPUs
            f.record_stream(self._stream)

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
