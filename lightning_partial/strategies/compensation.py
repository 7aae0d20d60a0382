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
  compensation under ``torch.optim.SGD`` with momentum (every result then acts
  as much as on time), ``"none"`` otherwise. Measured in
  ``docs/staleness.md#why-these-defaults``.
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

    ``spike=True``: the caller applies :meth:`StalenessWeights.spike` (a result
    whose contributions share one staleness), which is defined for SGD's update
    only: under ``"auto"`` an optimizer other than SGD with momentum then gets ``"none"`` (Adam
    divides its update by a running scale, so neither a uniform weight nor a
    plain step re-times a late gradient), and ``"momentum"`` is refused.
    """
    if rule in ("inverse", "none"):
        return StalenessWeights(rule=rule)  # type: ignore[arg-type]
    if rule == "auto" and not spike:
        # "inverse" needs no coefficient: the groups may differ.
        return StalenessWeights(rule="inverse") if has_momentum(optimizer) else StalenessWeights()
    kind, mu, dampening = optimizer_momentum(optimizer)
    if rule == "auto":
        if kind == "sgd":
            return _checked_for_spike(StalenessWeights(rule="momentum", momentum=mu, dampening=dampening), optimizer)
        return StalenessWeights()
    if rule == "momentum":
        if kind == "none":
            raise ValueError(
                f"{owner}: staleness_rule='momentum' needs an optimizer with momentum (SGD momentum > 0, or Adam's "
                f"beta1), but {type(optimizer).__name__} has none: use staleness_rule='inverse' or 'none'"
            )
        if spike and kind != "sgd":
            raise ValueError(
                f"{owner}: staleness_rule='momentum' re-times late results with plain SGD steps, which needs "
                f"torch.optim.SGD with momentum, not {type(optimizer).__name__}: use staleness_rule='auto' or 'none'"
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
