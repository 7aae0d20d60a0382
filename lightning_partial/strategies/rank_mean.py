"""Tensors replaced in place by their mean over the ranks: one host buffer and one sum per dtype.

Shared by the strategies' end-of-fit buffer average
(:meth:`~lightning_partial.strategies.partial.PartialStrategy._mean_over_ranks`) and by
``finish="gradients"``'s parameter and optimizer-state averages
(:class:`~lightning_partial.strategies.gradient_finish.GradientFinish`). The caller
supplies the sum (which group, which bound, which error), so ``mean_in_place`` serves
any thread and group the caller's contract names; :func:`allreduce_sum` is the plain
one (an allreduce on a group, its failure an error that names the rank and the round).

* Host buffers: the strategies' collective group is gloo, also beside a NCCL default
  group, so CUDA tensors travel through host memory (a copy each way).
* Half precision travels as float32 (not every gloo build sums float16 or bfloat16).
* A tensor that is not floating point (``num_batches_tracked``), or one flagged
  ``from_rank0`` (an optimizer's ``step``), takes rank 0's value: the other ranks send
  zeros into the same sum, so one collective per dtype serves both kinds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_partial.collectives.errors import naming_failure

__all__ = ["allreduce_sum", "mean_in_place", "wire_dtype"]


def allreduce_sum(group: Any, *, rank: int, what: str, last_round: Optional[int]) -> Callable[[Tensor], None]:
    """A ``sum_`` for :func:`mean_in_place`: an allreduce on ``group`` from the caller's thread, bounded by the
    group's timeout. A failure (a peer that died, or did not come in time) raises :class:`PartialCollectiveError`
    naming this rank, ``what`` was being averaged and the last round the caller saw: gloo's error names neither."""
    def sum_(buffer: Tensor) -> None:
        with naming_failure(f"the mean of {what} over the ranks", rank=rank, round_index=last_round, last=True):
            dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group)

    return sum_


def wire_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a buffer of ``dtype`` travels in: half precision as float32, ``bool`` as ``uint8`` (not every
    gloo build sums them)."""
    if dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    return torch.uint8 if dtype == torch.bool else dtype


@torch.no_grad()
def mean_in_place(tensors: Sequence[Tensor], *, rank: int, world_size: int, sum_: Callable[[Tensor], None],
                  from_rank0: Sequence[bool] = ()) -> None:
    """Each tensor replaced by its mean over the ``world_size`` ranks, or by rank 0's (see the module docstring).

    ``sum_(buffer)`` sums a host buffer over the ranks in place; it is called once per
    dtype, in the order the dtypes first appear in ``tensors``, which must be the same
    list (shapes, dtypes, flags) on every rank. Nothing happens without tensors.
    """
    flags = list(from_rank0) or [False] * len(tensors)
    if len(flags) != len(tensors):
        raise ValueError(f"from_rank0 has {len(flags)} flags for {len(tensors)} tensors")
    by_dtype: dict[torch.dtype, list[tuple[Tensor, bool]]] = {}
    for t, flagged in zip(tensors, flags):
        by_dtype.setdefault(t.dtype, []).append((t, flagged or not t.is_floating_point()))
    for dtype, members in by_dtype.items():
        # One buffer, filled slice by slice: a CUDA tensor costs its own size in host memory once, not twice.
        flat = torch.zeros(sum(t.numel() for t, _ in members), dtype=wire_dtype(dtype))
        offset = 0
        for t, rank0 in members:
            n = t.numel()
            if not (rank0 and rank != 0):  # the others send zeros for rank 0's values
                flat[offset:offset + n].copy_(t.detach().reshape(-1))
            offset += n
        sum_(flat)
        offset = 0
        for t, rank0 in members:
            n = t.numel()
            part = flat[offset:offset + n]
            offset += n
            if not rank0:
                part.div_(world_size)
            t.copy_(part.view(t.shape))
