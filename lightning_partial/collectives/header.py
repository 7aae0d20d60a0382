"""The round header: one int64 row per rank, summed over the ranks with the round's data.

Each rank's communication thread fills only its own row at the round's snapshot
(:meth:`~lightning_partial.collectives.runner.RoundRunner._snapshot`); the
allreduce sums the rows, so every rank reads every rank's row afterwards and
derives the same :class:`~lightning_partial.collectives.stats.RoundStats`.

A header fused into the data travels as 8-bit limbs of its int64 values, one
element each: integers up to 255 are exact in every floating dtype a gradient
has (bfloat16 included), and each rank writes only its own row, so the sum over
ranks is exact. Header values are never negative.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_partial.collectives.errors import PartialCollectiveError

# Columns of the per-rank header row.
COUNT, NEWEST, OLDEST, ACTIVATED, FLUSH, PROGRESS, DROPPED, STOP, DISCOUNT, BUSY, FINISH, ANNOUNCED = range(12)
WIDTH = 12
# FINISH holds flags: the fit ends after this round (request_finish), and every round from a few after
# this one is synchronous (request_sync). Each rank writes only its own row, so the flags never carry.
FINISH_FIT = 1
FINISH_SYNC = 2
# ANNOUNCED holds caller-defined bits (PartialAllreduce.announce), at most this many.
ANNOUNCE_BITS = 62
# DISCOUNT holds the gradients' worth that staleness weights withheld, in fixed point
# (2**-24: exact for mu = 0.5 and tau <= 24, within 6e-8 per contribution otherwise).
DISCOUNT_SCALE = 1 << 24
# BUSY holds the seconds of work behind the contribution, in microseconds (DelayedAllreduce).
BUSY_SCALE = 1_000_000
LIMB_BITS = 8
LIMBS = 64 // LIMB_BITS
_LIMB_SHIFTS = torch.arange(LIMBS, dtype=torch.int64) * LIMB_BITS


def empty(world_size: int) -> Tensor:
    """A header of ``world_size`` zero rows."""
    return torch.zeros(world_size, WIDTH, dtype=torch.int64)


def fused_length(world_size: int) -> int:
    """Elements a header fused into the data occupies (the layout's tail)."""
    return world_size * WIDTH * LIMBS


def encode(header: Tensor, tail: Tensor) -> None:
    """Writes ``header`` (non-negative int64) as 8-bit limbs into ``tail`` (the first buffer's tail)."""
    limbs = (header.unsqueeze(-1) >> _LIMB_SHIFTS) & ((1 << LIMB_BITS) - 1)
    tail.copy_(limbs.reshape(-1))


def decode(tail: Tensor, world_size: int) -> Tensor:
    """The summed header, from the first buffer's tail after the allreduce."""
    limbs = tail.to(torch.int64).reshape(world_size, WIDTH, LIMBS)
    return (limbs << _LIMB_SHIFTS).sum(dim=-1)


def check_flush(header: Tensor, *, rank: int, round_index: int) -> None:
    """Raises on every rank alike if only some ranks flush at round ``round_index``."""
    flushing = header[:, FLUSH].tolist()
    if 0 < sum(flushing) < len(flushing):
        raise PartialCollectiveError(
            f"ranks {[i for i, f in enumerate(flushing) if f]} called flush() at this round but ranks "
            f"{[i for i, f in enumerate(flushing) if not f]} arrived: every rank must flush at the "
            "same step (the same number of optimizer steps on every rank)",
            rank=rank,
            round_index=round_index,
        )
