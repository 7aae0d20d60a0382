"""The strategies' side of staleness-aware updates: the rule from the optimizer, and the spike.

The rules themselves (:class:`~lightning_partial.collectives.staleness.StalenessWeights`)
are the engine's. A strategy takes ``staleness_rule`` from the user and
resolves it against the optimizer it will feed, at set-up (the optimizer is
not known at construction):

* ``"auto"`` (default): the rule measured best for the way the strategy applies
  late gradients, for an optimizer with momentum (SGD ``momentum > 0``; Adam,
  AdamW and the other optimizers with ``betas``), and ``"none"`` without
  momentum, where a late gradient is not amplified (nothing was measured to
  win there). Where gradients of different staleness share a round
  (``eager_sgd``): ``"inverse"`` (it halves the most common case, a gradient
  one round late, where ``"momentum"`` keeps most of it). Where a whole result
  is late by one round (``abs_sgd``, ``spike=True``): ``"momentum"`` with spike
  compensation under ``torch.optim.SGD`` with momentum, ``torch.optim.Adam`` and
  ``torch.optim.AdamW`` (every result then acts as much as on time; see
  :func:`compensate`), ``"none"`` otherwise. Measured in
  ``docs/staleness.md#why-these-defaults`` (Adam and AdamW:
  ``docs/staleness.md#abs_sgd-under-adamw``).
* ``"momentum"``: the same, but an optimizer without momentum is an error.
* ``"inverse"``, ``"none"``: as the engine defines them.

Every parameter group must have the same coefficient: a gradient's weight is
applied to the whole flat buffer that carries it.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_partial.collectives.staleness import STALENESS_RULES, StalenessWeights

STRATEGY_RULES: tuple[str, ...] = ("auto",) + STALENESS_RULES

#: The Adam-like optimizers whose update :func:`retime_adam` knows (``m / (sqrt(v) + eps)``, bias-corrected),
#: matched by exact type: NAdam's and RAdam's steps are other functions of their moments, and a subclass
#: may change the step.
ADAM_SPIKE: tuple[type[Optimizer], ...] = (torch.optim.Adam, torch.optim.AdamW)


def is_retimed_adam(optimizer: Optimizer) -> bool:
    """Whether :func:`retime_adam` knows ``optimizer``'s update (``torch.optim.Adam`` or ``AdamW`` itself)."""
    return type(optimizer) in ADAM_SPIKE


def check_rule(rule: object, *, owner: str) -> str:
    """Validates a strategy's ``staleness_rule`` at construction; returns it."""
    if not isinstance(rule, str) or rule not in STRATEGY_RULES:
        raise ValueError(f"{owner}: unknown staleness_rule {rule!r}: expected one of {', '.join(STRATEGY_RULES)}")
    return rule


def _group_coefficients(group: dict) -> tuple[str, float, float]:
    """``(kind, mu, dampening)`` of one group: ``"sgd"`` (``momentum``), ``"adam"`` (``betas``) or ``"none"``."""
    if "momentum" in group:
        return "sgd", float(group["momentum"]), float(group.get("dampening", 0.0))
    if "betas" in group:
        return "adam", float(group["betas"][0]), 0.0
    return "none", 0.0, 0.0


def has_momentum(optimizer: Optimizer) -> bool:
    """Whether any parameter group has a momentum coefficient > 0 (``momentum``, or ``betas[0]``)."""
    return any(_group_coefficients(group)[1] > 0 for group in optimizer.param_groups)


def is_adam_like(optimizer: Optimizer) -> bool:
    """Whether every parameter group is Adam-like (``betas``, as :func:`optimizer_momentum`'s ``"adam"``)."""
    return all(_group_coefficients(group)[0] == "adam" for group in optimizer.param_groups)


def optimizer_momentum(optimizer: Optimizer) -> tuple[str, float, float]:
    """``(kind, mu, dampening)`` of ``optimizer``: kind ``"sgd"``, ``"adam"``, ``"other"`` or ``"none"``.

    ``"sgd"``: ``torch.optim.SGD`` (and subclasses) with momentum; ``"adam"``:
    groups with ``betas`` (``mu = beta1``; dampening 0); ``"other"``: another
    optimizer whose groups have ``momentum`` (RMSprop: its update is not SGD's,
    so no plain step re-times it); ``"none"``: no momentum. Raises ``ValueError``
    if the groups disagree.
    """
    per_group = [_group_coefficients(group) for group in optimizer.param_groups]
    kinds = {kind for kind, _, _ in per_group}
    values = {(mu, dampening) for _, mu, dampening in per_group}
    if len(kinds) != 1 or len(values) != 1:
        raise ValueError(
            f"the staleness rule needs one momentum coefficient for all parameter groups of "
            f"{type(optimizer).__name__}, got {sorted(values)}: give every group the same momentum/betas, "
            "or use staleness_rule='inverse' or 'none'"
        )
    (kind,) = kinds
    ((mu, dampening),) = values
    if kind == "sgd" and not isinstance(optimizer, torch.optim.SGD):
        kind = "other"
    return (kind if mu > 0 else "none"), mu, dampening


def resolve(rule: str, optimizer: Optimizer, *, owner: str, spike: bool = False) -> StalenessWeights:
    """The weights for ``rule`` given ``optimizer``; raises ``ValueError`` naming ``staleness_rule``.

    ``spike=True``: the caller re-times a whole late result (:func:`compensate`),
    which is defined for SGD's update and for Adam's and AdamW's: under ``"auto"``
    any other optimizer then gets ``"none"``, and ``"momentum"`` is refused
    (NAdam, RAdam and RMSprop compute their steps otherwise, so neither a weight
    nor a plain step re-times a late gradient there).
    """
    if rule in ("inverse", "none"):
        return StalenessWeights(rule=rule)  # type: ignore[arg-type]
    if rule == "auto" and not spike:
        # "inverse" needs no coefficient: the groups may differ.
        return StalenessWeights(rule="inverse") if has_momentum(optimizer) else StalenessWeights()
    kind, mu, dampening = optimizer_momentum(optimizer)
    retimed = kind == "sgd" or (kind == "adam" and is_retimed_adam(optimizer))
    if rule == "auto":
        if retimed:
            return _checked_for_spike(StalenessWeights(rule="momentum", momentum=mu, dampening=dampening), optimizer)
        return StalenessWeights()
    if rule == "momentum":
        if kind == "none":
            raise ValueError(
                f"{owner}: staleness_rule='momentum' needs an optimizer with momentum (SGD momentum > 0, or Adam's "
                f"beta1), but {type(optimizer).__name__} has none: use staleness_rule='inverse' or 'none'"
            )
        if spike and not retimed:
            raise ValueError(
                f"{owner}: staleness_rule='momentum' re-times late results through the optimizer's own update, "
                "which needs torch.optim.SGD with momentum, torch.optim.Adam or torch.optim.AdamW, not "
                f"{type(optimizer).__name__}: use staleness_rule='auto' or 'none'"
            )
        weights = StalenessWeights(rule="momentum", momentum=mu, dampening=dampening)
        return _checked_for_spike(weights, optimizer) if spike else weights
    raise ValueError(f"{owner}: unknown staleness_rule {rule!r}")


def _checked_for_spike(weights: StalenessWeights, optimizer: Optimizer) -> StalenessWeights:
    """Refuses, at set-up, parameter groups without a numeric ``lr`` (the plain step needs it)."""
    for i, group in enumerate(optimizer.param_groups):
        lr = group.get("lr")
        if isinstance(lr, bool) or not isinstance(lr, (int, float)):
            raise ValueError(
                f"spike compensation needs each parameter group's learning rate as a number, group {i} has "
                f"lr={lr!r}: use staleness_rule='none'"
            )
    return weights


def resolve_all(
    rule: str, optimizers: Sequence[Optimizer], *, owner: str, spike: bool = False
) -> dict[int, StalenessWeights]:
    """:func:`resolve` for each optimizer, by index (a strategy's set-up)."""
    return {i: resolve(rule, opt, owner=owner, spike=spike) for i, opt in enumerate(optimizers)}


@torch.no_grad()
def apply_spike(optimizer: Optimizer, params: Sequence[Tensor], tensors: Sequence[Tensor], coefficient: float) -> None:
    """``p <- p - lr * coefficient * g`` for each parameter, with its group's current learning rate.

    The plain step that :meth:`StalenessWeights.spike` re-times; after
    ``optimizer.step()``, on the same gradients (``maximize`` groups step up).
    """
    if coefficient == 0.0:
        return
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    for p, g in zip(params, tensors):
        group = group_of.get(id(p))
        if group is None:
            continue
        sign = 1.0 if group.get("maximize", False) else -1.0
        p.add_(g.to(p.dtype), alpha=sign * float(group["lr"]) * coefficient)


def gradient_weight(optimizer: Optimizer, weights: StalenessWeights, staleness: int) -> float:
    """The factor of a result ``staleness`` rounds late in the gradient given to ``optimizer.step()``.

    SGD: :meth:`StalenessWeights.weight` (the momentum buffer takes the share it
    would still hold). Adam and AdamW under ``"momentum"``: 1, so that the second
    moment sees the gradient as it is; :func:`retime_adam` moves the first
    moment's share after the step.
    """
    if weights.rule == "momentum" and is_retimed_adam(optimizer):
        return 1.0
    return weights.weight(staleness)


def compensate(optimizer: Optimizer, weights: StalenessWeights, params: Sequence[Tensor],
               grads: Sequence[Tensor], staleness: int) -> None:
    """After ``optimizer.step()`` on a result ``staleness`` rounds late: its spike compensation.

    ``grads`` are the gradients the step used (``p.grad`` as clipped: the result
    times :func:`gradient_weight`). SGD: the plain step
    ``lr * spike / weight * grad`` (:func:`apply_spike`); Adam and AdamW:
    :func:`retime_adam`. Nothing under the rules without a spike.
    """
    spike = weights.spike(staleness)
    if not spike:
        return
    if is_retimed_adam(optimizer):
        retime_adam(optimizer, params, grads, staleness)
    else:
        apply_spike(optimizer, params, grads, spike / weights.weight(staleness))


def compensate_step(optimizer: Optimizer, weights: StalenessWeights, params: Sequence[Tensor], staleness: int) -> None:
    """:func:`compensate` right after ``optimizer.step()``, from each parameter's ``p.grad`` as the step used it
    (clipped: the same direction and scale); parameters without a gradient are left alone."""
    if not weights.spike(staleness):
        return
    stepped = [p for p in params if p.grad is not None]
    compensate(optimizer, weights, stepped, [p.grad for p in stepped], staleness)


@torch.no_grad()
def retime_adam(optimizer: Optimizer, params: Sequence[Tensor], grads: Sequence[Tensor], staleness: int) -> None:
    """Spike compensation for Adam and AdamW, after a step on gradients ``staleness`` (``tau``) rounds late.

    Applied on time, a gradient ``g`` enters Adam's first moment as ``(1 - b1) g``
    and acts through it with a total weight of 1 (in units of ``lr g / (sqrt(v) +
    eps)``, bias-corrected), ``1 - b1^tau`` of it in the ``tau`` steps it missed.
    The step just taken put ``(1 - b1) g`` in the moment. This leaves there what the
    on-time trajectory would still hold, ``(1 - b1) b1^tau g``, and applies now,
    with this step's scale, what it would already have applied, ``1 - b1^tau``::

        exp_avg <- exp_avg - (1 - b1)(1 - b1^tau) g
        w       <- w - lr / (1 - b1^t) * b1 (1 - b1^tau) g / (sqrt(v / (1 - b2^t)) + eps)

    (``b1 (1 - b1^tau)``: the ``1 - b1^tau`` owed, less the ``(1 - b1)(1 - b1^tau)``
    the step already applied through the moment.) ``v`` is ``exp_avg_sq``
    (``max_exp_avg_sq`` with ``amsgrad``), which took ``g`` whole: a late gradient's
    scale is no different. Adam's coupled weight decay is of the current weights
    and is not re-timed; AdamW's decoupled decay is not touched. ``maximize``
    groups: the moment holds ``-g``. Complex parameters: their real views, as
    Adam steps them. A parameter without Adam state is left alone. ``tau`` counts
    the optimizer steps taken since the gradient was computed, this one excluded,
    so it is at most ``t - 1`` (the caller's to know: ``abs_sgd`` passes 0 for a
    fresh optimizer's first step, which it then does not compensate).
    """
    # One pass of foreach operations per parameter group (a Python loop per tensor costs more than the
    # arithmetic on a model of many small tensors; abs_sgd calls this after every step).
    index_of = {id(p): i for i, group in enumerate(optimizer.param_groups) for p in group["params"]}
    members: dict[int, list[tuple[Tensor, Tensor, dict]]] = {}
    for p, g in zip(params, grads):
        i, state = index_of.get(id(p)), optimizer.state.get(p)
        if i is not None and state and "exp_avg" in state:
            if torch.is_complex(p):  # Adam steps a complex parameter's real view, its state is complex too
                state = {k: torch.view_as_real(v) if torch.is_tensor(v) and torch.is_complex(v) else v
                         for k, v in state.items()}
                p, g = torch.view_as_real(p), torch.view_as_real(g)
            members.setdefault(i, []).append((p, g, state))
    for i, entries in members.items():
        group = optimizer.param_groups[i]
        beta1, beta2 = (float(b) for b in group["betas"])
        owed = 1.0 - beta1**staleness
        sign = -1.0 if group.get("maximize", False) else 1.0  # maximize: the moment holds -g
        steps = [float(state["step"]) for _, _, state in entries]
        moments = [state["exp_avg"] for _, _, state in entries]
        torch._foreach_add_(moments, [g.to(m.dtype) for (_, g, _), m in zip(entries, moments)],
                            alpha=-sign * (1.0 - beta1) * owed)
        second = "max_exp_avg_sq" if group.get("amsgrad", False) else "exp_avg_sq"
        # In float32 at least: half-precision state would round the square root and the quotient.
        work = [torch.promote_types(state[second].dtype, torch.float32) for _, _, state in entries]
        denom = torch._foreach_div([state[second].to(w) for (_, _, state), w in zip(entries, work)],
                                   [1.0 - beta2**t for t in steps])  # a new list: the state is not touched
        torch._foreach_sqrt_(denom)
        torch._foreach_add_(denom, float(group["eps"]))
        update = [g.to(w, copy=True) for (_, g, _), w in zip(entries, work)]
        torch._foreach_div_(update, denom)
        lr = float(group["lr"])
        torch._foreach_mul_(update, [sign * lr * beta1 * owed / (1.0 - beta1**t) for t in steps])
        torch._foreach_sub_([p for p, _, _ in entries], [u.to(p.dtype) for (p, _, _), u in zip(entries, update)])
