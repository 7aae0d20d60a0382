"""Global-batch scaling: local Adam steps sized as DDP's Adam would size them.

Under model averaging (``wagma_sgd``, ``ds_sync``) each rank's optimizer steps
on its own gradient, of ``1/P`` of the global batch, and the models are
averaged. For SGD, with or without momentum, the average of the P local steps
is the step on the average gradient: DDP's. For Adam it is not. Adam divides
each coordinate by the root of its running second moment ``v``, and the
gradient of ``B/P`` samples has ``P`` times the noise variance of the gradient
of ``B``. Where noise dominates a coordinate, each local step, and so their
average, is about ``sqrt(P)`` times smaller than DDP's at the same learning
rate (the square-root scaling rule of adaptive methods: Malladi, Lyu,
Panigrahi, Arora, *On the SDEs and Scaling Rules for Adaptive Gradient
Algorithms*, NeurIPS 2022). Where the signal dominates, the two agree.

The rule (``adaptive_scaling="global_batch"``), per coordinate, right after a
local step of an Adam-family optimizer (``torch.optim.Adam``, ``AdamW``,
``NAdam``, ``RAdam``: state ``exp_avg``, ``exp_avg_sq``, ``step``), with the
group's ``betas``, ``lr`` and decoupled weight decay ``wd`` (0 when the decay
is coupled, i.e. part of the gradient)::

    m = exp_avg / (1 - beta1^t)          v = exp_avg_sq / (1 - beta2^t)
    s = min(m^2, v)                      # the signal's part of v
    v_P = s + (v - s) / P                # v of a gradient of P times the samples
    c = sqrt(v / v_P)                    # in [1, sqrt(P)]; 1 where v = 0
    d = w_after - (1 - lr * wd) * w_before   # the step's adaptive part
    w <- w_after + (c - 1) * d

The adaptive part becomes ``c * d``: the step Adam takes with ``v_P`` in place
of ``v`` (exactly so when ``eps`` is small against ``sqrt(v)``; where it is not,
as in a coordinate that rarely has a gradient, the step is scaled all the same).
With ``amsgrad`` the ratio is still taken from ``exp_avg_sq``. The decoupled
decay is left as it was. ``m^2`` estimates the squared mean gradient from the
rank's own running mean, whose noise biases it slightly up, so ``c`` errs
towards 1 (no scaling). A parameter whose step was skipped (its ``step`` did
not advance: no gradient, or a precision plugin that skipped the step) is left
alone, and so are RAdam's first, unrectified steps (``rho_t <= 5``), which
divide by no second moment: their average already is DDP's step.

Main thread only, no collective: each rank rescales its own step from its own
optimizer state, before the step's model goes to the group average. One
parameter-sized buffer per optimizer (the weights before the step) is kept and
reused; the factors take a second one while a step is rescaled.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_partial.strategies.prediction import copy_weights

__all__ = ["ADAPTIVE_SCALINGS", "GlobalBatchScaling", "check_scaling", "resolve", "resolve_all", "signal_part"]

#: ``adaptive_scaling`` values: ``"auto"`` (``"global_batch"`` for an Adam-family optimizer on more than
#: one rank, ``"none"`` otherwise), ``"global_batch"`` (refused for other optimizers), ``"none"``.
ADAPTIVE_SCALINGS: tuple[str, ...] = ("auto", "global_batch", "none")

#: The optimizers whose state the rule reads (``exp_avg``, ``exp_avg_sq``, ``step``; groups with ``betas``).
ADAM_FAMILY: tuple[type[Optimizer], ...] = (torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam, torch.optim.RAdam)


def check_scaling(value: object, *, owner: str) -> str:
    """Validates a strategy's ``adaptive_scaling`` at construction; returns it."""
    if not isinstance(value, str) or value not in ADAPTIVE_SCALINGS:
        raise ValueError(
            f"{owner}: unknown adaptive_scaling {value!r}: expected one of {', '.join(ADAPTIVE_SCALINGS)}"
        )
    return value


def resolve(value: str, optimizer: Optimizer, *, world_size: int, owner: str) -> bool:
    """Whether the rule applies to ``optimizer``'s steps; raises ``ValueError`` naming ``adaptive_scaling``.

    ``"global_batch"`` needs an Adam-family optimizer (other optimizers keep no
    second moment that the rule could read); ``"auto"`` applies the rule to
    those and leaves SGD alone (its averaged local steps already are DDP's).
    With one rank there is nothing to scale.
    """
    adam = isinstance(optimizer, ADAM_FAMILY)
    if value == "global_batch" and not adam:
        raise ValueError(
            f"{owner}: adaptive_scaling='global_batch' reads Adam's moments (exp_avg, exp_avg_sq), which "
            f"{type(optimizer).__name__} does not keep: use one of {', '.join(c.__name__ for c in ADAM_FAMILY)}, "
            "or adaptive_scaling='auto' or 'none'"
        )
    if value not in ("auto", "global_batch"):
        return False
    return adam and world_size > 1


def resolve_all(value: str, optimizers: Sequence[Optimizer], *, world_size: int, owner: str) -> set[int]:
    """The indices of the optimizers whose steps the rule rescales (a strategy's set-up)."""
    return {i for i, opt in enumerate(optimizers) if resolve(value, opt, world_size=world_size, owner=owner)}


def _in_float32(tensors: list[Tensor]) -> list[Tensor]:
    """Half-precision state (precision="16-true"/"bf16-true") as float32: ``m^2`` and the floors
    computed from it would under- or overflow in float16."""
    if tensors and tensors[0].dtype in (torch.float16, torch.bfloat16):
        return [x.float() for x in tensors]
    return tensors


def signal_part(exp_avg: list[Tensor], second: list[Tensor], *, t: float, betas: Sequence[float]) -> list[Tensor]:
    """``s' = min(m^2 (1 - beta2^t) / (1 - beta1^t)^2, v)`` per coordinate (new tensors, half precision in float32).

    The part of a raw (not bias-corrected) second moment ``v`` that the squared mean
    gradient explains, from the raw first moment ``m`` after ``t`` steps: the bias-corrected
    ``min(m_hat^2, v_hat)`` in ``v``'s units. The rest, ``v - s'``, is the gradients' noise.
    Shared by the local steps' rescaling and by ``finish="gradients"``'s second-moment
    correction (:mod:`~lightning_partial.strategies.gradient_finish`).
    """
    beta1, beta2 = float(betas[0]), float(betas[1])
    m = _in_float32(exp_avg)
    s = torch._foreach_mul(m, m)
    torch._foreach_mul_(s, (1.0 - beta2**t) / (1.0 - beta1**t) ** 2)
    torch._foreach_minimum_(s, _in_float32(second))
    return s


def radam_rectified(t: float, beta2: float) -> bool:
    """Whether RAdam's step ``t`` (from 1) divides by the root of its second moment (``rho_t > 5``, as
    ``torch.optim.RAdam``); before that (the first 5 steps at ``beta2 = 0.999``) it steps by the first moment
    alone, which the rule must not scale."""
    rho_inf = 2.0 / (1.0 - beta2) - 1.0
    rho_t = rho_inf - 2.0 * t * beta2**t / (1.0 - beta2**t)
    return rho_t > 5.0


def _steps(optimizer: Optimizer, params: Sequence[Tensor]) -> list[Optional[float]]:
    """Each parameter's optimizer step count (``None`` before its first step)."""
    counts: list[Optional[float]] = []
    for p in params:
        state = optimizer.state.get(p)
        counts.append(float(state["step"]) if state and "step" in state else None)
    return counts


class GlobalBatchScaling:
    """The weights before each optimizer's step, and the rescaling of the step after it.

    Use, per step of optimizer ``index`` (the raw ``torch.optim`` optimizer) with parameters ``params``::

        scaling.begin(index, optimizer, params)     # after the closure, before optimizer.step()
        optimizer.step()
        scaling.finish(index, optimizer, params)    # the adaptive part of each step times c
    """

    def __init__(self, world_size: int) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self._before: dict[int, list[Tensor]] = {}
        self._steps: dict[int, list[Optional[float]]] = {}

    def begin(self, index: int, optimizer: Optimizer, params: Sequence[Tensor]) -> None:
        """Copies the weights (into the optimizer's reused buffer) and notes each parameter's step count."""
        self._before[index] = copy_weights(params, self._before.get(index))
        self._steps[index] = _steps(optimizer, params)

    @torch.no_grad()
    def finish(self, index: int, optimizer: Optimizer, params: Sequence[Tensor]) -> None:
        """After ``optimizer.step()``: ``w <- w_after + (c - 1) * d`` for each parameter that stepped.

        The parameters that share a step count and a parameter group are rescaled
        together with ``torch._foreach_*`` ops (the model's size in a dozen passes,
        without a Python call per parameter and operation).
        """
        before, steps = self._before.get(index), self._steps.pop(index, None)
        if before is None or steps is None:
            return  # begin() did not run: the closure was not called, so there was no step to scale
        group_of = {id(p): (i, g) for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
        batches: dict[tuple[int, float, torch.dtype, torch.device], list[tuple[Tensor, Tensor, dict]]] = {}
        for p, w_before, step_before in zip(params, before, steps):
            state = optimizer.state.get(p)
            found = group_of.get(id(p))
            if not state or found is None or "exp_avg_sq" not in state:
                continue
            t = float(state["step"])
            if step_before is not None and t <= step_before:
                continue  # this step skipped the parameter
            key = (found[0], t, p.dtype, p.device)
            batches.setdefault(key, []).append((p.detach(), w_before, state))
        for (group_index, t, _, _), members in batches.items():
            group = optimizer.param_groups[group_index]
            if isinstance(optimizer, torch.optim.RAdam) and not radam_rectified(t, float(group["betas"][1])):
                continue  # RAdam's first steps divide by no second moment: the averaged local steps are DDP's
            weights = [w for w, _, _ in members]
            moves = [b for _, b, _ in members]  # the weights before: becomes d in place
            c = self._factors([st["exp_avg"] for _, _, st in members],
                              [st["exp_avg_sq"] for _, _, st in members], t=t, betas=group["betas"])
            # torch < 2.7 has no "decoupled_weight_decay" key: there AdamW is the decoupled one.
            decoupled = group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW))
            decay = float(group["lr"]) * float(group["weight_decay"]) if decoupled else 0.0
            torch._foreach_mul_(moves, -(1.0 - decay))
            torch._foreach_add_(moves, weights)  # d = w_after - (1 - lr wd) w_before
            torch._foreach_sub_(c, 1.0)
            torch._foreach_addcmul_(weights, moves, [x.to(w.dtype) for x, w in zip(c, weights)])

    def _factors(self, exp_avg: list[Tensor], exp_avg_sq: list[Tensor], *, t: float,
                 betas: Sequence[float]) -> list[Tensor]:
        """``c = sqrt(v / v_P)`` per coordinate of each tensor (new tensors), from the moments after ``t`` steps.

        With the bias corrections folded into one factor: for raw moments ``m``, ``v``
        and ``s' = min(m^2 (1 - beta2^t) / (1 - beta1^t)^2, v)``,
        ``c^2 = P v / (v + (P - 1) s')``, the same ratio as with the corrected ones.
        """
        world = self.world_size
        exp_avg, exp_avg_sq = _in_float32(exp_avg), _in_float32(exp_avg_sq)
        c = signal_part(exp_avg, exp_avg_sq, t=t, betas=betas)  # s'
        torch._foreach_mul_(c, float(world - 1))
        torch._foreach_add_(c, exp_avg_sq)  # v + (P - 1) s'  (>= v)
        # v = 0 (a coordinate that never had a gradient) gives 0/0; the floor makes it 0, then c = 1 below.
        torch._foreach_clamp_min_(c, torch.finfo(c[0].dtype).tiny if c else 0.0)
        torch._foreach_reciprocal_(c)
        torch._foreach_mul_(c, exp_avg_sq)
        torch._foreach_mul_(c, float(world))
        torch._foreach_sqrt_(c)
        torch._foreach_clamp_min_(c, 1.0)
        torch._foreach_clamp_max_(c, world**0.5)
        return c

    def factor(self, exp_avg: Tensor, exp_avg_sq: Tensor, *, t: float, betas: Sequence[float]) -> Tensor:
        """``c = sqrt(v / v_P)`` per coordinate of one tensor (a new tensor), from the moments after ``t`` steps."""
        return self._factors([exp_avg], [exp_avg_sq], t=t, betas=betas)[0]
