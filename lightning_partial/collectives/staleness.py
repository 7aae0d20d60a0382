"""Staleness-aware weights: how much of a contribution that is ``tau`` rounds late enters an update.

A gradient computed at step ``q`` and applied in round ``r = q + tau`` was
computed on weights that lack ``tau`` rounds of updates. Fed through an
optimizer with momentum ``mu`` as if it were fresh, it enters the momentum
buffer whole and keeps acting for ``1 / (1 - mu)`` steps, all of them late: a
delay of one round with ``mu = 0.9`` shrinks the stable learning rate on a
quadratic by more than an order of magnitude (``benchmarks/stability_model.py``
has the arithmetic). The rules here are one mechanism for every engine that
applies stale gradients (:class:`~lightning_partial.collectives.PartialAllreduce`
weighs each carried gradient by its own staleness before the round's sum;
``abs_sgd`` weighs its one-round-late results as a whole):

``"momentum"`` (``abs_sgd``'s default under SGD with momentum, Adam and AdamW)
    Weight ``mu ** tau``: exactly the share of the gradient that the momentum
    buffer would still hold, had it been applied on time. Applied now, it
    reproduces the on-time trajectory's effect of that gradient from this
    round on; the share ``1 - mu ** tau`` that would already have acted is
    what the delay cost. Where a result is weighed as a whole (``abs_sgd``, as one step late: its pacing
    rank's lag; a slower rank's micro-batches may be older), that share is applied too, at once and outside
    the momentum buffer (:meth:`StalenessWeights.spike`, the *spike
    compensation* of Kosson et al., *Pipelined Backpropagation at Scale*,
    2021): the update then equals the on-time one except that one plain step
    comes ``tau`` rounds late. Where contributions of different staleness are
    summed in one allreduce (``eager_sgd``) the share is not applied and is
    counted per round (``RoundStats.discounted``): applying it takes a second
    part in every round's allreduce, which was measured to cost accuracy
    (``docs/staleness.md#the-staleness-bound``).
``"inverse"`` (``eager_sgd``'s default under an optimizer with momentum)
    Weight ``1 / (1 + tau)`` (Zhang, Gupta, Lian, Liu, *Staleness-aware
    Async-SGD*, 2016); the rest is counted as discounted. Needs no momentum.
    It damps a gradient one round late by half where ``"momentum"`` keeps
    ``mu`` of it: in eager-SGD's solo mode most of a round is one round late
    (only the activator's gradient is fresh), and there the steeper weight
    cost less accuracy (``docs/staleness.md``).
``"none"``
    Weight 1: every gradient is applied whole however late (the papers' rule).

Every rank applies the same weights to the same contributions, so the replicas
stay bit-identical; fresh contributions (``tau = 0``) always have weight 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lightning_partial.collectives.checks import is_finite_number

StalenessRule = Literal["none", "momentum", "inverse"]
STALENESS_RULES: tuple[str, ...] = ("none", "momentum", "inverse")


@dataclass(frozen=True, kw_only=True)
class StalenessWeights:
    """The weight of a contribution by its staleness (see the module docstring).

    Args:
        rule: ``"none"``, ``"momentum"`` or ``"inverse"``.
        momentum: the optimizer's momentum coefficient ``mu`` (SGD's ``momentum``,
            Adam's ``beta1``), in ``(0, 1)``; required by ``"momentum"`` and only
            meaningful there.
        dampening: SGD's ``dampening`` (the buffer takes ``(1 - dampening) * g``);
            it scales the :meth:`spike` so that it matches what the buffer would
            have applied. Only with ``"momentum"``.
    """

    rule: StalenessRule = "none"
    momentum: float = 0.0
    dampening: float = 0.0

    def __post_init__(self) -> None:
        if self.rule not in STALENESS_RULES:
            raise ValueError(f"unknown staleness rule {self.rule!r}: expected one of {', '.join(STALENESS_RULES)}")
        for name in ("momentum", "dampening"):
            value = getattr(self, name)
            if not is_finite_number(value):
                raise ValueError(f"staleness {name} must be a finite number, got {value!r}")
            if not 0.0 <= value < 1.0:
                raise ValueError(f"staleness {name} must be in [0, 1), got {value!r}")
        if self.rule == "momentum" and self.momentum <= 0.0:
            raise ValueError(
                "staleness rule 'momentum' needs the optimizer's momentum coefficient > 0 (SGD momentum, "
                f"Adam beta1), got momentum={self.momentum!r}: use rule 'inverse' or 'none' for an optimizer "
                "without momentum"
            )
        if self.rule != "momentum" and (self.momentum or self.dampening):
            raise ValueError(
                f"staleness momentum/dampening are only meaningful with rule 'momentum' (rule={self.rule!r})"
            )

    @property
    def active(self) -> bool:
        """Whether any staleness changes a weight (``False`` for ``"none"``)."""
        return self.rule != "none"

    def weight(self, staleness: int) -> float:
        """The factor of a contribution ``staleness`` rounds late (1 for a fresh one)."""
        if staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {staleness}")
        if staleness == 0 or self.rule == "none":
            return 1.0
        if self.rule == "momentum":
            return self.momentum**staleness
        return 1.0 / (1.0 + staleness)

    def spike(self, staleness: int) -> float:
        """``"momentum"``: the plain step that the delay withheld, in learning-rate units.

        With SGD (``v <- mu v + (1 - d) g``; ``w <- w - lr v``, Nesterov alike) a
        gradient applied on time has acted with ``(1 - d)(1 + mu + ... + mu^(tau-1))
        = (1 - d)(1 - mu^tau) / (1 - mu)`` by the time it arrives ``tau`` rounds
        late. Applying ``lr * spike * g`` outside the buffer, beside ``weight * g``
        through it, makes the total effect of ``g`` equal to the on-time one. 0 for
        the other rules (what they withhold is discounted, not re-timed).
        """
        if self.rule != "momentum" or staleness <= 0:
            return 0.0
        mu = self.momentum
        return (1.0 - self.dampening) * (1.0 - mu**staleness) / (1.0 - mu)
