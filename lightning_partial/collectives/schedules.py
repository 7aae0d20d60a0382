"""Group schedules: which ranks average together in round ``r`` (see docs/algorithms.md).

A schedule is a pure function of the round index: every rank computes the
same partition of ``0..P-1`` for every round without talking, a resumed run
computes the same groups as the original, and the communication thread can
run rounds ahead of its own caller. Groups are returned as sorted tuples and
partitions sorted by their smallest member, so the group id (the index in
:meth:`Schedule.groups`) is identical on every rank too.
"""

from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional, Sequence

from lightning_partial.collectives.checks import check_int

Group = tuple[int, ...]


class Schedule(ABC):
    """A partition of the ranks per round; immutable and picklable."""

    world_size: int

    @abstractmethod
    def groups(self, round_index: int) -> list[Group]:
        """The partition of ``range(world_size)`` used in round ``round_index``."""

    def group_of(self, round_index: int, rank: int) -> Group:
        """The members (sorted, ``rank`` included) of ``rank``'s group in round ``round_index``."""
        return self.groups(round_index)[self.group_id(round_index, rank)]

    def group_id(self, round_index: int, rank: int) -> int:
        """The index of ``rank``'s group in :meth:`groups` (identical on every rank)."""
        for index, group in enumerate(self.groups(round_index)):
            if rank in group:
                return index
        raise ValueError(f"rank {rank} is in no group of round {round_index} (world size {self.world_size})")

    def check_world(self, world_size: int) -> None:
        """Raises ``ValueError`` unless the schedule was built for ``world_size`` ranks."""
        if world_size != self.world_size:
            raise ValueError(
                f"{type(self).__name__} was built for {self.world_size} ranks, but the job has {world_size}"
            )


def _is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


@dataclass(frozen=True, kw_only=True)
class ButterflySchedule(Schedule):
    """WAGMA's hypercube schedule: groups of ``group_size`` S over ``world_size`` P = 2^n ranks.

    Phase ``k = r mod phases``: the group of rank ``i`` is every rank that
    differs from ``i`` only in bits ``[k*log2(S), (k+1)*log2(S))``. With
    ``phases = ceil(log_S P)`` consecutive rounds every rank's weights reach every
    other rank (P=4, S=2: ``{0,1},{2,3}`` then ``{0,2},{1,3}``). When ``log2 S``
    does not divide ``log2 P`` the last phase uses the remaining bits (P=8, S=4:
    groups of 4, then groups of 2): documented fallback, still mixing all ranks.

    ``global_every=tau``: rounds ``tau-1, 2 tau-1, ...`` are global averages (the engine's ``sync_every``),
    which take no phase: ``k`` counts the group rounds before ``r`` instead, so the phases rotate over
    the group rounds (with ``k = r mod phases`` and a ``tau`` that divides ``phases``, the group rounds
    would all fall on the same phases: P=4, S=2, ``tau=2`` would average in ``{0,1},{2,3}`` only).

    Raises ``ValueError`` when P or S is not a power of two, or S > P.
    """

    world_size: int
    group_size: int
    global_every: Optional[int] = None

    def __post_init__(self) -> None:
        check_int("world_size", self.world_size)
        check_int("group_size", self.group_size)
        check_int("global_every", self.global_every, minimum=1, optional=True)
        if not _is_power_of_two(self.world_size):
            raise ValueError(
                f"the butterfly schedule needs a power-of-two number of ranks: world_size must be 1, 2, 4, 8, ..., "
                f"got {self.world_size} (use the shuffle schedule, ds_sync, for other sizes)"
            )
        if not _is_power_of_two(self.group_size):
            raise ValueError(f"group_size must be a power of two, got {self.group_size}")
        if self.group_size > self.world_size:
            raise ValueError(f"group_size {self.group_size} exceeds the world size {self.world_size}")

    @property
    def phases(self) -> int:
        """Rounds after which every rank has mixed with every other (1 when S = P or P = 1)."""
        bits, per = int(math.log2(self.world_size)), int(math.log2(self.group_size))
        return 1 if per == 0 or bits == 0 else math.ceil(bits / per)

    def groups(self, round_index: int) -> list[Group]:
        bits, per = int(math.log2(self.world_size)), int(math.log2(self.group_size))
        if per == 0:  # S = 1: every rank alone
            return [(i,) for i in range(self.world_size)]
        tau = self.global_every
        phase = round_index if tau is None else round_index - (round_index + 1) // tau  # group rounds before it
        low = (phase % self.phases) * per
        mask = ((1 << min(per, bits - low)) - 1) << low
        partition: dict[int, list[int]] = {}
        for i in range(self.world_size):
            partition.setdefault(i & ~mask, []).append(i)
        return sorted(tuple(g) for g in partition.values())


@dataclass(frozen=True, kw_only=True)
class ShuffleSchedule(Schedule):
    """DS-Sync's schedule: a random permutation per round split into ``num_groups`` G groups of P/G.

    The permutation of round ``r`` comes from ``random.Random(f"{seed}:{r}")``:
    identical on every rank, independent of how many rounds a rank has seen.
    Raises ``ValueError`` unless G divides P.
    """

    world_size: int
    num_groups: int
    seed: int = 0

    def __post_init__(self) -> None:
        check_int("world_size", self.world_size)
        check_int("num_groups", self.num_groups)
        if self.num_groups > self.world_size:
            raise ValueError(f"num_groups {self.num_groups} exceeds the world size {self.world_size}")
        if self.world_size % self.num_groups:
            raise ValueError(
                f"num_groups {self.num_groups} does not divide the world size {self.world_size}: "
                "DS-Sync splits the ranks into equal groups"
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")

    @property
    def group_size(self) -> int:
        return self.world_size // self.num_groups

    def groups(self, round_index: int) -> list[Group]:
        order = list(range(self.world_size))
        random.Random(f"{self.seed}:{round_index}").shuffle(order)
        n = self.group_size
        return sorted(tuple(sorted(order[i : i + n])) for i in range(0, self.world_size, n))


@dataclass(frozen=True, kw_only=True)
class SwitchingSchedule(Schedule):
    """``schedules[k]`` from round ``starts[k]`` on (``starts[0] == 0``, increasing).

    How :class:`~lightning_partial.callbacks.GroupRotation` changes the schedule
    during a fit: the change is fixed before the engines start, as a function
    of the round index, so every rank switches at the same round even though
    communication threads run rounds at different wall times.
    """

    starts: tuple[int, ...]
    schedules: tuple[Schedule, ...]

    def __post_init__(self) -> None:
        if not self.schedules or len(self.starts) != len(self.schedules):
            raise ValueError("SwitchingSchedule needs one start round per schedule, at least one")
        if self.starts[0] != 0 or any(b <= a for a, b in zip(self.starts, self.starts[1:])):
            raise ValueError(f"starts must begin at 0 and increase, got {self.starts}")
        sizes = {s.world_size for s in self.schedules}
        if len(sizes) != 1:
            raise ValueError(f"the schedules are for different world sizes: {sorted(sizes)}")
        object.__setattr__(self, "world_size", sizes.pop())

    def active(self, round_index: int) -> Schedule:
        """The schedule that round ``round_index`` uses."""
        current = self.schedules[0]
        for start, schedule in zip(self.starts, self.schedules):
            if round_index >= start:
                current = schedule
        return current

    def groups(self, round_index: int) -> list[Group]:
        return self.active(round_index).groups(round_index)


def describe(groups: Sequence[Group]) -> str:
    """``"{0,1} {2,3}"``: a partition, for logs."""
    return " ".join("{" + ",".join(map(str, g)) + "}" for g in groups)
