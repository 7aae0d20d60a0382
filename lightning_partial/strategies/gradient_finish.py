"""DDP's own step in the synchronous finish of model averaging (``finish="gradients"``).

In the synchronous finish (``final_sync``) every round of ``wagma_sgd`` and
``ds_sync`` is a global average of every rank's model of that step. For SGD,
with or without momentum, the average of the P local steps is DDP's step on
the averaged gradient (the update is linear in the gradient and in the
momentum buffer). For Adam it is not: each rank normalises its own gradient by
its own moments, and the mean of ``m_i / sqrt(v_i)`` is not DDP's
``mean(m) / sqrt(v)``; adaptive scaling corrects the step's size, not its
direction. ``finish="gradients"`` makes the finish DDP's step itself:

* At the finish's first round (``sync_from``), before the optimizer steps, the
  parameters are averaged over the ranks (in ``order="average_then_step"`` the
  engine's global average has just done it), and so is the optimizer state: every
  floating-point state tensor (Adam's ``exp_avg``, ``exp_avg_sq``,
  ``max_exp_avg_sq``; SGD's ``momentum_buffer``) is replaced by its mean, the
  counters (``step``, NAdam's ``mu_product``) by rank 0's. A parameter whose
  state some rank lacks (it had gradients on some ranks only) has its state
  dropped on every rank: the optimizer starts it afresh, identically everywhere.
  The mean of the ``m_i`` is DDP's first moment (it is linear in the gradients).
  The mean of the ``v_i`` is not DDP's second moment: each ``v_i`` was built from
  gradients of ``1/P`` of the global batch, whose noise variance is ``P`` times
  that of DDP's gradient. With adaptive scaling in force for the optimizer, the
  averaged second moment gets the same noise correction that scaling applies to
  the local steps (:mod:`~lightning_partial.strategies.adaptive_scaling`), in the
  raw (not bias-corrected) units that Adam keeps, at step ``t``::

      s = min(m^2 (1 - beta2^t) / (1 - beta1^t)^2, v)     # the signal's part of v
      v <- s + (v - s) / P

  (and ``max_exp_avg_sq`` likewise, then at least ``exp_avg_sq``). Adam's bias
  correction is the one used for NAdam and RAdam too, whose first-moment
  corrections differ (an approximation there). With ``adaptive_scaling="none"``
  the plain means are kept.
* In every finish round, after the closure (forward and backward) and before
  the precision plugin, clipping and ``optimizer.step``: the gradients are
  replaced by their mean over the ranks (sum over the ranks divided by P, a rank
  without a gradient for a parameter counting as zero, as DDP's; a parameter
  that no rank has a gradient for keeps ``None``). No local step is rescaled:
  the gradient already is the global batch's.

Replicas that start a round identical, with identical optimizer state and
identical gradients, take identical steps: from the finish's first round on
each is DDP's step (the first on gradients of the ranks' own models). The
engine's global average still runs in every finish round (the rounds'
protocol, their statistics and stop requests are unchanged); on identical
replicas it changes nothing.

Not the default (``finish="models"``): in the AdamW main job it ended no closer
to DDP than the average of the local steps (``wagma_sgd`` -1.4 against -0.9
points over the same five seeds, ``ds_sync`` -1.4 against -1.3;
``docs/staleness.md#ddps-step-in-the-finish``). It is for a fit that should end
on DDP's steps with one optimizer state on every rank.

Contract: every rank, main thread, the strategy's collective group (gloo), in
the same order on every rank: one allreduce per gradient dtype per finish round;
at the finish's first round, one per parameter dtype, one agreeing on the state's
entries and one per state dtype. A round's first collective waits for the
slowest rank's compute and is bounded by the strategy's ``timeout`` (as the
engine's synchronous rounds); every later one by ``collective_timeout``. A
failure raises :class:`~lightning_partial.collectives.PartialCollectiveError`
naming the rank and the round. The buffers are on the host (half precision
travels as float32); on CUDA that is a device-to-host copy in the finish's
rounds only.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from lightning_partial.collectives import PartialCollectiveError
from lightning_partial.strategies.adaptive_scaling import ADAM_FAMILY, signal_part
from lightning_partial.strategies.rank_mean import mean_in_place, wire_dtype

__all__ = ["FINISHES", "GradientFinish", "check_finish", "resolve", "resolve_all"]

#: ``finish`` values: ``"models"`` (the default: the global average of the local steps) and
#: ``"gradients"`` (DDP's step; SGD and the Adam family).
FINISHES: tuple[str, ...] = ("models", "gradients")

#: The optimizers whose state the finish knows how to average.
STATE_AVERAGED: tuple[type[Optimizer], ...] = (torch.optim.SGD, *ADAM_FAMILY)

#: The state entries averaged (a parameter's shape) or taken from rank 0 (scalars); others are left alone.
STATE_KEYS: tuple[str, ...] = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "mu_product", "step")


def check_finish(value: object, *, owner: str) -> str:
    """Validates a strategy's ``finish`` at construction; returns it."""
    if not isinstance(value, str) or value not in FINISHES:
        raise ValueError(f"{owner}: unknown finish {value!r}: expected one of {', '.join(FINISHES)}")
    return value


def resolve(value: str, optimizer: Optimizer, *, world_size: int, owner: str) -> bool:
    """Whether ``optimizer``'s finish rounds take DDP's step; raises ``ValueError`` naming ``finish``.

    ``"gradients"`` needs an optimizer whose state the finish can average (SGD, the
    Adam family). With one rank there is nothing to average.
    """
    if value != "gradients":
        return False
    if not isinstance(optimizer, STATE_AVERAGED):
        raise ValueError(
            f"{owner}: finish='gradients' averages the optimizer's state, which it knows for "
            f"{', '.join(c.__name__ for c in STATE_AVERAGED)}, not {type(optimizer).__name__}: "
            "use finish='models'"
        )
    return world_size > 1


def resolve_all(value: str, optimizers: Sequence[Optimizer], *, world_size: int, owner: str) -> set[int]:
    """The indices of the optimizers whose finish rounds take DDP's step (a strategy's set-up)."""
    return {i for i, opt in enumerate(optimizers) if resolve(value, opt, world_size=world_size, owner=owner)}


#: State entries that are the optimizer's counters, identical on every rank: taken from rank 0, never averaged.
SCALAR_KEYS: frozenset[str] = frozenset({"step", "mu_product"})


class GradientFinish:
    """The collectives of ``finish="gradients"``: gradients, parameters and optimizer state averaged over the ranks.

    Args:
        group: the process group (the strategy's gloo collective group).
        rank: this rank (named in errors; rank 0's values are the optimizer's counters everywhere).
        world_size: P.
        arrival_timeout: bound on a round's first collective, which waits for the slowest
            rank's compute (the strategy's ``timeout``, as the engine's synchronous rounds).
        timeout: bound on every later collective of the round, once every rank is there
            (the strategy's ``collective_timeout``).
    """

    def __init__(self, *, group: Any, rank: int, world_size: int, arrival_timeout: timedelta,
                 timeout: timedelta) -> None:
        if world_size < 2:
            raise ValueError(f"GradientFinish needs at least 2 ranks, got world_size={world_size}")
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.arrival_timeout = arrival_timeout
        self.timeout = timeout

    def _sum(self, buffer: Tensor, *, round_index: int, what: str, first: bool = False) -> None:
        """``buffer`` (host) summed over the ranks in place; ``first``: the round's first collective."""
        bound = self.arrival_timeout if first else self.timeout
        option = "timeout" if first else "collective_timeout"
        try:
            work = dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
            completed = work.wait(timeout=bound)
        except Exception as err:  # gloo raises RuntimeError (timeout, a peer's connection reset)
            raise PartialCollectiveError(
                f"the synchronous finish's {what} failed or exceeded {option}={bound}: {err}",
                rank=self.rank, round_index=round_index,
            ) from err
        if completed is False:
            raise PartialCollectiveError(f"the synchronous finish's {what} did not complete within {option}={bound}",
                                         rank=self.rank, round_index=round_index)

    @torch.no_grad()
    def mean_gradients(self, params: Sequence[Tensor], *, round_index: int) -> None:
        """Each parameter's gradient replaced by the sum of the ranks' divided by P (DDP's gradient).

        One allreduce per parameter dtype (the first bounded by ``arrival_timeout``): the
        gradients flattened into one host buffer, a rank without a gradient contributing
        zeros, followed by one presence flag per parameter. A parameter that no rank has a
        gradient for keeps ``None``; one that some rank lacks gets the mean there too. A
        sparse gradient is flagged rather than sent, so that every rank raises together.
        """
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for p in params:
            by_dtype.setdefault(p.dtype, []).append(p)
        sparse = 2 * self.world_size  # a flag no count of dense gradients reaches
        for k, (dtype, members) in enumerate(by_dtype.items()):
            sizes = [p.numel() for p in members]
            total = sum(sizes)
            flat = torch.zeros(total + len(members), dtype=wire_dtype(dtype))
            offset = 0
            for i, (p, n) in enumerate(zip(members, sizes)):
                if p.grad is not None:
                    if p.grad.is_sparse:
                        flat[total + i] = sparse
                    else:
                        flat[offset:offset + n].copy_(p.grad.reshape(-1))
                        flat[total + i] = 1
                offset += n
            self._sum(flat, round_index=round_index, what="gradient average", first=k == 0)
            if flat[total:].max().item() >= sparse:
                raise PartialCollectiveError(
                    "finish='gradients' averages dense gradients; a rank has a sparse one (use finish='models')",
                    rank=self.rank, round_index=round_index)
            flat[:total].div_(self.world_size)
            offset = 0
            for i, (p, n) in enumerate(zip(members, sizes)):
                mean = flat[offset:offset + n].view(p.shape)
                offset += n
                if flat[total + i].item() == 0:
                    continue  # no rank computed a gradient for it: untouched, as under DDP
                if p.grad is None:
                    p.grad = mean.to(device=p.device, dtype=p.dtype, copy=True)
                else:
                    p.grad.copy_(mean)

    @torch.no_grad()
    def mean_parameters(self, params: Sequence[Tensor], *, round_index: int) -> None:
        """Each parameter replaced by its mean over the ranks (one allreduce per dtype).

        At the finish's first round, before the step: the replicas then step from one model,
        so that an update that reads the weights (weight decay folded into the gradient, and
        so into the moments) leaves one optimizer state on every rank.
        """
        self._mean_in_place([p.detach() for p in params], round_index=round_index, what="parameter average")

    def _mean_in_place(self, tensors: Sequence[Tensor], *, round_index: int, what: str,
                       from_rank0: Sequence[bool] = ()) -> None:
        """``tensors`` replaced by their mean over the ranks (or rank 0's where ``from_rank0``), per dtype."""
        mean_in_place(tensors, rank=self.rank, world_size=self.world_size, from_rank0=from_rank0,
                      sum_=lambda buffer: self._sum(buffer, round_index=round_index, what=what))

    @torch.no_grad()
    def average_state(self, optimizer: Optimizer, params: Sequence[Tensor], *, noise_correction: bool,
                      round_index: int) -> None:
        """The optimizer's state of ``params`` made identical on every rank (see the module docstring).

        One allreduce agrees on which entries every rank has, then one per state dtype
        averages them (``step`` and NAdam's ``mu_product``: rank 0's). A parameter with
        an entry that some rank lacks (it had gradients on some ranks only) has its state
        dropped on every rank: the optimizer starts it afresh, identically everywhere.
        """
        keys = STATE_KEYS
        entries: list[tuple[Tensor, str]] = []  # (parameter, key) in a fixed order
        for p in params:
            state = optimizer.state.get(p) or {}
            for key in keys:
                value = state.get(key)
                if isinstance(value, Tensor) and value.is_floating_point():
                    entries.append((p, key))
        # The parameters are the same list on every rank, their state entries may not be:
        # agree first, on one count per parameter and known key, so that the sums line up.
        index = {id(p): i for i, p in enumerate(params)}
        counts = torch.zeros(len(params) * len(keys), dtype=torch.float64)
        for p, key in entries:
            counts[index[id(p)] * len(keys) + keys.index(key)] = 1
        self._sum(counts, round_index=round_index, what="optimizer-state agreement")
        per_param = counts.view(len(params), len(keys))
        partial = {i for i in range(len(params))
                   if bool(((per_param[i] > 0) & (per_param[i] < self.world_size)).any())}
        for i in partial:
            optimizer.state.pop(params[i], None)
        agreed = [(p, key) for p, key in entries if index[id(p)] not in partial]
        self._mean_in_place([optimizer.state[p][key] for p, key in agreed], round_index=round_index,
                            what="optimizer-state average", from_rank0=[key in SCALAR_KEYS for _, key in agreed])
        if noise_correction:
            self._correct_second_moments(optimizer, [p for p, key in agreed if key == "exp_avg_sq"])

    def _correct_second_moments(self, optimizer: Optimizer, params: Sequence[Tensor]) -> None:
        """``v <- s + (v - s) / P`` with ``s = min(m^2 (1 - beta2^t) / (1 - beta1^t)^2, v)`` (raw moments)."""
        group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
        world = float(self.world_size)
        for p in params:
            state, group = optimizer.state[p], group_of.get(id(p))
            if group is None or "exp_avg" not in state or "betas" not in group:
                continue
            t = float(state["step"])
            if t <= 0:
                continue
            for key in ("exp_avg_sq", "max_exp_avg_sq"):
                v: Optional[Tensor] = state.get(key)
                if v is None:
                    continue
                s = signal_part([state["exp_avg"]], [v], t=t, betas=group["betas"])[0]
                v.copy_(s + (v.float() - s) / world)
            if "max_exp_avg_sq" in state:
                torch.maximum(state["max_exp_avg_sq"], state["exp_avg_sq"], out=state["max_exp_avg_sq"])
