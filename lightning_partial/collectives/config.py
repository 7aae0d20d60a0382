"""Configuration of a partial allreduce (its semantics: docs/algorithms.md, eager_sgd)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Literal, Optional

from lightning_partial.collectives.checks import check_int, check_timedelta
from lightning_partial.collectives.staleness import StalenessWeights

Mode = Literal["solo", "majority", "quorum", "sync"]
LatePolicy = Literal["carry", "drop"]
Normalize = Literal["world", "contributors", "sum"]

MODES: tuple[str, ...] = ("solo", "majority", "quorum", "sync")
LATE_POLICIES: tuple[str, ...] = ("carry", "drop")
NORMALIZATIONS: tuple[str, ...] = ("world", "contributors", "sum")


@dataclass(frozen=True, kw_only=True)
class EngineBounds:
    """The bounds on an engine's waits, shared by every engine's configuration.

    Its subclasses (:class:`PartialAllreduceConfig`,
    :class:`~lightning_partial.collectives.delayed.DelayedConfig`) document the
    fields; :meth:`check_bounds` validates them.
    """

    timeout: timedelta = timedelta(minutes=30)
    collective_timeout: timedelta = timedelta(seconds=60)
    setup_timeout: Optional[timedelta] = None

    def check_bounds(self) -> None:
        """Raises ``ValueError`` unless every bound is a positive ``timedelta`` (``setup_timeout``: or ``None``)."""
        check_timedelta("timeout", self.timeout)
        check_timedelta("collective_timeout", self.collective_timeout)
        check_timedelta("setup_timeout", self.setup_timeout, optional=True)

    @property
    def rendezvous_timeout(self) -> timedelta:
        """The bound on ``start()``'s rendezvous: ``setup_timeout``, else ``timeout``."""
        return self.timeout if self.setup_timeout is None else self.setup_timeout

    @property
    def collective_bound(self) -> timedelta:
        """The bound on a prompt round's collectives: ``collective_timeout``, at most ``timeout``."""
        return min(self.collective_timeout, self.timeout)


@dataclass(frozen=True, kw_only=True)
class PartialAllreduceConfig(EngineBounds):
    """What a :class:`~lightning_partial.collectives.PartialAllreduce` does each round.

    Args:
        mode: what activates round ``r``. ``"solo"``: the first rank to arrive.
            ``"majority"``: the round's initiator, a rank drawn from an RNG seeded
            with ``seed`` identically on every rank. ``"quorum"``: ``quorum`` ranks
            have arrived (``quorum = P - b`` is ``b`` backup workers). ``"sync"``:
            every rank has arrived (a plain allreduce, with the engine's header).
        quorum: number of arrivals that activate a round in ``"quorum"`` mode, in
            ``1..P``; checked against the world size when the engine is built.
        backup_workers: ``"quorum"`` mode, instead of ``quorum``: the number ``b``
            of ranks a round does not wait for (``quorum = P - b``, resolved with
            the world size, so that one configuration serves any ``P > b``).
        late: what happens to a gradient that arrives after its round was
            activated. ``"carry"`` (default): it stays in the send buffer and is
            contributed to the next round this rank takes part in (stale by >= 1),
            so nothing computed is lost (but what ``staleness`` withholds of it, counted
            as ``discounted``). ``"drop"``: it is discarded and counted
            in the round statistics (the reference code's behaviour).
        normalize: ``"world"`` divides the sum by ``P`` (the paper), ``"contributors"``
            by the number of gradients summed in the round (zero if none),
            ``"sum"`` returns the plain sum (what ``dist.all_reduce`` returns).
        sync_every: if set, every ``sync_every``-th round (rounds ``n-1, 2n-1, ...``)
            is fully synchronous: it activates only once every rank has arrived.
        sync_from: if set, every round from index ``sync_from`` on is fully
            synchronous, as a ``sync_every`` round (a fit's synchronous finish:
            its last rounds apply every rank's fresh gradient and nothing late).
            Every rank must configure the same index.
        max_staleness: if set to ``s``, round ``r`` activates only once every rank
            has arrived at step ``r - s``. Hence every gradient is applied at most
            ``s`` rounds after the step that computed it, and no rank arrives more
            than ``s`` steps ahead of the slowest rank. ``0`` is fully synchronous.
        staleness: how much of a carried gradient enters the round, by its
            staleness (:class:`~lightning_partial.collectives.staleness.StalenessWeights`):
            each rank scales each gradient it contributes by ``weight(r - step)``
            before the round's sum, and counts the rest in
            ``RoundStats.discounted``. Default: weight 1 (the paper's rule).
            ``normalize="contributors"`` still counts a discounted gradient as one.
        seed: seed of the initiator RNG (``"majority"``); must match on all ranks.
        timeout: bound on every wait that includes other ranks' compute: for a
            round's activation, for the caller's result, and for the collectives
            of rounds that every rank enters on its own arrival (``mode="sync"``,
            ``sync_every`` rounds, the flush), which wait for the slowest rank.
            A wait that exceeds it raises :class:`PartialCollectiveTimeout` naming
            the rank and the round. Keep it above the longest pause in arrivals
            (a validation loop, a checkpoint) of the job: a slow rank must never
            be mistaken for a dead one. (A rank that has stopped answering is
            found by a heartbeat within ``collective_timeout``:
            :mod:`~lightning_partial.collectives.liveness`.)
        collective_timeout: bound on the collectives of rounds activated through
            the store, which every rank's communication thread enters as soon as
            the round is activated, however slow its compute; and on each store
            call that is not a wait. Never more than ``timeout``. Keep it above
            the time one round's collectives take on a loaded host.
        setup_timeout: bound on :meth:`PartialAllreduce.start`'s rendezvous (the
            engine's process groups): every rank must call ``start()`` within it
            of the others, or ``start()`` raises :class:`PartialCollectiveTimeout`
            naming the rank. ``None`` (default): ``timeout``. Set it above
            ``timeout`` when ranks may reach ``start()`` far apart (a slow data
            set-up on one rank) but a stalled round must be detected quickly.
        name: prefix of the engine's store keys and process group; engines that
            share a store must have distinct names.
    """

    mode: Mode = "solo"
    quorum: Optional[int] = None
    backup_workers: Optional[int] = None
    late: LatePolicy = "carry"
    normalize: Normalize = "world"
    sync_every: Optional[int] = None
    sync_from: Optional[int] = None
    max_staleness: Optional[int] = None
    staleness: StalenessWeights = StalenessWeights()
    seed: int = 0
    name: str = "partial"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}: expected one of {', '.join(MODES)}")
        if self.mode == "quorum":
            if (self.quorum is None) == (self.backup_workers is None):
                raise ValueError(
                    "mode='quorum' needs either quorum=k, the number of arrivals that activate a round, or "
                    f"backup_workers=b, the ranks a round does not wait for (got quorum={self.quorum!r}, "
                    f"backup_workers={self.backup_workers!r})"
                )
            for name in ("quorum", "backup_workers"):
                value = getattr(self, name)
                if value is not None:
                    check_int(name, value)
        else:
            for name in ("quorum", "backup_workers"):
                if getattr(self, name) is not None:
                    raise ValueError(
                        f"{name}={getattr(self, name)!r} is only meaningful with mode='quorum' (mode={self.mode!r})"
                    )
        if self.late not in LATE_POLICIES:
            raise ValueError(f"unknown late policy {self.late!r}: expected one of {', '.join(LATE_POLICIES)}")
        if self.normalize not in NORMALIZATIONS:
            raise ValueError(f"unknown normalize {self.normalize!r}: expected one of {', '.join(NORMALIZATIONS)}")
        check_int("sync_every", self.sync_every, optional=True)
        check_int("sync_from", self.sync_from, minimum=0, optional=True)
        check_int("max_staleness", self.max_staleness, minimum=0, optional=True)
        if not isinstance(self.staleness, StalenessWeights):
            raise ValueError(f"staleness must be a StalenessWeights, got {type(self.staleness).__name__}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        self.check_bounds()
        if not isinstance(self.name, str) or not self.name or "/" in self.name:
            raise ValueError(f"name must be a non-empty string without '/', got {self.name!r}")

    def validate_world(self, world_size: int) -> None:
        """Checks what depends on the number of ranks ``P``; raises ``ValueError``."""
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world size must be an integer >= 1, got {world_size!r}")
        if self.mode == "quorum" and self.backup_workers is not None and self.backup_workers >= world_size:
            raise ValueError(
                f"backup_workers must be below the world size {world_size}, got {self.backup_workers}: "
                "a round must wait for at least one rank"
            )
        if self.mode == "quorum" and self.backup_workers is None and not 1 <= int(self.quorum or 0) <= world_size:
            raise ValueError(f"quorum must be in 1..{world_size} (the world size), got {self.quorum}")
        if self.mode == "majority" and world_size < 2:
            raise ValueError(
                "mode='majority' needs at least 2 ranks: with one rank there is no majority to wait for "
                "(use mode='sync' or 'solo')"
            )

    def activation_count(self, world_size: int, sync_round: bool) -> Optional[int]:
        """Arrivals that activate a round, or ``None`` when the initiator does (majority)."""
        if sync_round or self.mode == "sync":
            return world_size
        if self.mode == "solo":
            return 1
        if self.mode == "quorum":
            if self.backup_workers is not None:
                return world_size - self.backup_workers
            return int(self.quorum)  # type: ignore[arg-type]
        return None

    def is_sync_round(self, round_index: int) -> bool:
        """Whether round ``round_index`` is fully synchronous: a periodic one, or one of the synchronous finish."""
        if self.sync_from is not None and round_index >= self.sync_from:
            return True
        return self.sync_every is not None and (round_index + 1) % self.sync_every == 0
