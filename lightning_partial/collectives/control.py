"""The control plane: who has arrived, and which rounds are activated.

Activation travels through a c10d store (a ``TCPStore`` in a real job), never
through a collective: a rank that is still computing must learn that a round
was activated without posting anything itself. Per round the keys are

``n/<q>``
    counter of arrivals at step ``q`` (``store.add``); every rank adds once.
``g/<r>``
    counter of activation conditions met for round ``r``, used only when
    ``max_staleness`` adds a second condition (the gate) to the mode's one.
``s/<q>``
    the samples counted for synchronous round ``q`` so far (``store.add`` of each
    micro-batch's samples by the rank that computed it, before it arrives or holds
    it): a round that closes on samples (``DelayedAllreduce.count_round_samples``).
``go/<r>/<i>``
    set to ``"1"`` (one ``multi_set`` for all ``i``) when round ``r`` is activated;
    rank ``i``'s communication thread blocks in ``store.wait`` on its own key, so
    that ``close()`` can wake exactly that thread without touching the others
    (``wake`` creates the key as ``"0"`` where no activation has set it).

Keys are deleted once nobody can touch them again (the last adder of ``n/q``
and ``g/r``, rank ``i`` for ``go/r/i``, rank 0 for ``s/q`` once round ``q`` completed:
every rank counts into it before it arrives), so the store stays flat however long
the job runs. Deletions run on the communication thread, off the caller's
critical path.

Two store clients are used, because a ``TCPStore`` client is one connection and
a thread blocked in ``wait`` stalls every other call on it: the caller's
thread owns ``main`` (add, multi_set) and the communication thread owns
``comm`` (wait, delete).

Bounds: a ``wait`` for an activation is bounded by the engine's ``timeout`` (it
includes other ranks' compute); every other call is answered at once by a live
store, so it is bounded by ``op_timeout`` (the engine's ``collective_timeout``):
a frozen store host (rank 0) fails the caller in about a minute, not half an hour.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from lightning_partial.collectives.errors import PartialCollectiveError, PartialCollectiveTimeout
from lightning_partial.collectives.store import clone_store


# The activation key's value when only the rank's own wake() set it; an activation sets "1".
WOKEN = "0"


def _innermost(store: dist.Store) -> dist.Store:
    """The store under any ``PrefixStore`` wrappers."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


class ControlPlane:
    """Arrival counters and activation keys of one engine, on one rank."""

    def __init__(
        self,
        store: dist.Store,
        *,
        name: str,
        rank: int,
        world_size: int,
        timeout: timedelta,
        op_timeout: Optional[timedelta] = None,
    ) -> None:
        prefix = f"lightning_partial/{name}/ctl"  # PrefixStore adds the "/"
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.op_timeout = timeout if op_timeout is None else op_timeout
        self.main = dist.PrefixStore(prefix, clone_store(store))
        self._hash_store = isinstance(_innermost(store), dist.HashStore)  # see wake()
        self.comm = dist.PrefixStore(prefix, clone_store(store))
        # The clients' default bound serves the calls that are not waits; a wait passes its own.
        self.comm.set_timeout(self.op_timeout)
        self.main.set_timeout(self.op_timeout)
        # Keys the communication thread deletes after its next round.
        self._garbage: list[str] = []
        self._garbage_lock = threading.Lock()

    # -- caller's thread -------------------------------------------------
    def arrive(self, step: int) -> int:
        """Counts this rank's arrival at ``step``; returns how many ranks have arrived there."""
        count = self._call(lambda: self.main.add(f"n/{step}", 1), step, "count the arrival")
        if count == self.world_size:
            self.discard(f"n/{step}")  # every rank has added: nobody touches it again
        return count

    def count_samples(self, round_index: int, samples: int) -> int:
        """Adds ``samples`` to synchronous round ``round_index``'s count; returns the count (every rank's so far)."""
        return self._call(lambda: self.main.add(f"s/{round_index}", samples), round_index, "count the round's samples")

    def meet_condition(self, round_index: int, needed: int) -> None:
        """One of the ``needed`` activation conditions of ``round_index`` holds; activates on the last."""
        if needed == 1:
            self.activate(round_index)
            return
        met = self._call(lambda: self.main.add(f"g/{round_index}", 1), round_index, "meet a condition")
        if met == needed:
            self.discard(f"g/{round_index}")
            self.activate(round_index)

    def activate(self, round_index: int) -> None:
        """Activates ``round_index`` for every rank (one ``multi_set``)."""
        keys = [f"go/{round_index}/{i}" for i in range(self.world_size)]
        self._call(lambda: self.main.multi_set(keys, ["1"] * len(keys)), round_index, "activate")

    def activate_from_comm(self, round_index: int) -> None:
        """:meth:`activate`, from the communication thread (its own store client)."""
        keys = [f"go/{round_index}/{i}" for i in range(self.world_size)]
        self._call(lambda: self.comm.multi_set(keys, ["1"] * len(keys)), round_index, "activate")

    def only_woken(self, round_index: int) -> bool:
        """Communication thread, once the key exists: whether only :meth:`wake` set it (no rank activated the round)."""
        key = f"go/{round_index}/{self.rank}"
        return self._call(lambda: self.comm.get(key), round_index, "read the activation").decode() == WOKEN

    def is_activated(self, round_index: int) -> bool:
        """Caller's thread: whether this rank's activation key of ``round_index`` is set."""
        key = f"go/{round_index}/{self.rank}"
        if not self._call(lambda: self.main.check([key]), round_index, "check the activation"):
            return False
        value = self._call(lambda: self.main.get(key), round_index, "read the activation").decode()
        return value != WOKEN  # only this rank's own wake() set it

    def discard_samples(self, round_index: int) -> None:
        """Rank 0, once synchronous round ``round_index`` completed: its sample count is deleted at the next collection."""
        self.discard(f"s/{round_index}")

    def delete_samples(self, rounds: range) -> None:
        """Caller's thread, after the engine's last round: deletes those rounds' sample counts (some may not exist)."""
        self._delete(self.main, [f"s/{r}" for r in rounds], rounds.start)

    def discard(self, key: str) -> None:
        with self._garbage_lock:
            self._garbage.append(key)

    # -- communication thread ---------------------------------------------
    def wait_activated(self, round_index: int, timeout: timedelta) -> None:
        """Blocks until ``round_index`` is activated (or ``wake`` is called)."""
        self._call(
            lambda: self.comm.wait([f"go/{round_index}/{self.rank}"], timeout),
            round_index,
            "wait for activation",
            bound=timeout,
        )

    def wake(self, round_index: int) -> None:
        """Unblocks this rank's communication thread waiting on ``round_index`` (flush, close, a request).

        Never replaces an activation: a plain ``set`` could land just after another rank's
        activation and hide it (:meth:`only_woken`, :meth:`is_activated`), and a thread that then
        reads "woken" while its rank is paused waits for an activation of its own of a round the
        others are already in. ``add(key, 0)`` leaves an activation's ``"1"`` as it is and creates
        ``"0"`` otherwise; a ``HashStore``'s ``add`` wakes no waiter, so there ``compare_set``
        creates it (which a classic, non-libuv ``TCPStore`` server does not announce to waiters).
        """
        key = f"go/{round_index}/{self.rank}"
        what = "wake the communication thread"
        if self._hash_store:
            self._call(lambda: self.main.compare_set(key, "", WOKEN), round_index, what)
        else:
            self._call(lambda: self.main.add(key, 0), round_index, what)
        # The caller read the waiting round before this call: if the round ran and was collected meanwhile, the
        # key is created again, and only the next collection (or finish) deletes it.
        self.discard(key)

    def collect(self, round_index: int, *, activated_through_store: bool) -> None:
        """Deletes this rank's activation key of a completed round and any discarded keys."""
        keys = self._take_garbage()
        if activated_through_store:
            keys.insert(0, f"go/{round_index}/{self.rank}")
        self._delete(self.comm, keys, round_index)

    def finish(self, flush_round: int, max_staleness: int | None) -> None:
        """After the flush, on the caller's thread: deletes what no later round will.

        Gates opened by the last ``s`` steps and the flush (``g/F .. g/F+s``) belong
        to rounds that never run; rank 0 deletes them. Every rank deletes the keys
        it discarded after its communication thread's last collection.
        """
        keys = self._take_garbage()
        if self.rank == 0 and max_staleness is not None:
            keys += [f"g/{r}" for r in range(flush_round, flush_round + max_staleness + 1)]
        self._delete(self.main, keys, flush_round)

    def _take_garbage(self) -> list[str]:
        with self._garbage_lock:
            garbage, self._garbage = self._garbage, []
        return garbage

    def _delete(self, client: dist.Store, keys: list[str], round_index: int) -> None:
        """Deletes ``keys`` with ``client`` (the calling thread's own store client)."""
        for key in keys:
            self._call(lambda key=key: client.delete_key(key), round_index, "delete old keys")

    def _call(self, fn, round_index: int, what: str, bound: Optional[timedelta] = None):  # type: ignore[no-untyped-def]
        try:
            return fn()
        except dist.DistStoreError as err:
            if "timeout" in str(err).lower():
                seconds = (bound or self.op_timeout).total_seconds()
                raise PartialCollectiveTimeout(
                    f"could not {what}: no answer within {seconds:g}s ({err}); "
                    + ("is a rank dead or far behind?" if bound is not None else
                       "is the store's host (rank 0) frozen or unreachable?"),
                    rank=self.rank,
                    round_index=round_index,
                ) from err
            raise PartialCollectiveError(
                f"could not {what}: the store failed ({err})", rank=self.rank, round_index=round_index
            ) from err
        except (dist.DistError, RuntimeError) as err:
            raise PartialCollectiveError(
                f"could not {what}: the store is unreachable ({err}); did the rank hosting it die?",
                rank=self.rank,
                round_index=round_index,
            ) from err
