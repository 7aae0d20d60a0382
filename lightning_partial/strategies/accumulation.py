"""Round accumulation: ``abs_sgd``'s optimizer steps once per global batch, not once per round.

Under ABS-SGD every rank's micro-batch may start a round, so a round holds a
fraction of the samples a synchronous step takes (about 38 of DDP's 128 in the
main job), and an optimizer stepping per round takes four times as many
steps, each on a quarter of the batch. A linear scaling of the gradient
(``reference_samples``) makes that right for plain SGD; an Adam-like optimizer
normalises the scale away and takes a full step per round.

:class:`RoundAccumulator` adds the round results as they are applied (each
the round's gradient sum over its divisor, rescaled to the step's), until
the rounds hold about ``step_samples`` samples; the optimizer then steps once
on their gradient sum over the step's divisor (``reference_samples`` when
set: the linear scaling rule over the whole step, an asynchronous round
larger than ``reference_samples`` counting as that many samples, its mean
gradient; otherwise the step's samples: the sample-weighted mean). Every
rank receives the same results in the same order, so every rank adds the same
tensors in the same order and steps at the same rounds: replicas stay
bit-identical. Where the step ends (``boundary``): at the round that brings the
samples *nearest* to ``step_samples`` (``"nearest"``, the next round assumed as
large as the last: a step ends at the round after which one more would overshoot
by at least as much as stopping now falls short) or at the first round that
reaches them (``"at_least"``). Rounds come in units of several micro-batches
(about half of DDP's batch under persistent heterogeneity): "at least" then
makes the steps a quarter larger than DDP's and a fifth fewer, and each step is a
round late, so fewer, larger steps cost progress per sample; "nearest" keeps
about DDP's number of steps (docs/staleness.md). Nothing is lost: what is
accumulated when the fit ends is stepped at its end, and checkpoints keep it
(``ACCUMULATED_KEY``).

Main thread only; no collective.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
from torch import Tensor

from lightning_partial.strategies.fit_state import CheckpointedState

__all__ = ["ACCUMULATED_KEY", "BOUNDARIES", "RoundAccumulator", "check_boundary"]

#: Where a step ends: see the module docstring.
BOUNDARIES = ("nearest", "at_least")


def check_boundary(boundary: object, *, owner: str) -> str:
    """Validates a ``step_boundary`` (one of :data:`BOUNDARIES`) at construction; returns it."""
    if not isinstance(boundary, str) or boundary not in BOUNDARIES:
        raise ValueError(f"{owner}: unknown step_boundary {boundary!r}: expected one of {', '.join(BOUNDARIES)}")
    return boundary

#: The checkpoint entry: ``{index: {"sum": [tensor per parameter] or None, "samples": int, "rounds": int,
#: "steps": int}}`` (``sum``: the rounds' gradient sums over ``reference_samples``, or plain sums without it).
ACCUMULATED_KEY = "lightning_partial_accumulated_rounds"


@dataclass
class _Accumulated:
    sum: Optional[list[Tensor]] = None  # the rounds' gradient sums since the last step
    samples: int = 0
    rounds: int = 0
    steps: int = 0  # optimizer steps taken in this fit (LR schedulers' frequency counts them)
    capped: int = 0  # rounds of this fit larger than reference_samples counted as reference_samples (limit)
    spare: Optional[list[Tensor]] = field(default=None, repr=False)  # the last step's buffers, reused


class RoundAccumulator(CheckpointedState):
    """Per optimizer index: the round results added since its last step.

    Args:
        step_samples: the samples of a step (``None``: a step after every round).
        reference_samples: the divisor of a step's gradient sum (``None``: the
            step's samples).
        boundary: ``"nearest"`` (default) or ``"at_least"`` (see the module docstring).
        presence: each result ends with one presence number per parameter tensor (``abs_sgd``'s
            ``find_unused_parameters``), summed with the gradients.
    """

    checkpoint_key = ACCUMULATED_KEY

    def __init__(self, step_samples: Optional[int], reference_samples: Optional[int], *,
                 boundary: str = "nearest", presence: bool = False) -> None:
        self.step_samples = step_samples
        self.reference_samples = reference_samples
        self.boundary = check_boundary(boundary, owner="RoundAccumulator")
        self.presence = presence
        self._state: dict[int, _Accumulated] = {}
        self._resumed: Optional[dict[int, dict[str, Any]]] = None

    def add(self, index: int, tensors: Sequence[Tensor], *, divisor: float, samples: int, limit: bool = True) -> bool:
        """Adds a round's result (``tensors``: its gradient sum over ``divisor``); returns whether a step is due.

        Kept as the sum over the step's divisor: with ``reference_samples`` the results
        (each the round's sum over it) add as they are. ``limit``: a round of more than
        ``reference_samples`` samples counts as that many, its mean gradient (``abs_sgd``'s
        asynchronous rounds, sized by the trigger; its synchronous rounds, sized by the strategy,
        count all their samples).
        """
        state = self._state.setdefault(index, _Accumulated())
        scale = divisor / self.reference_samples if self.reference_samples is not None else divisor
        if limit and self.reference_samples is not None and samples > self.reference_samples:
            # A round larger than the reference batch counts as one: its mean gradient. Its micro-batches were
            # computed at the same weights: more samples refine one gradient, they do not make a longer step
            # along it safe (linear scaling would step samples / reference times its mean).
            scale *= self.reference_samples / samples
            samples = self.reference_samples
            state.capped += 1
        if state.sum is None:
            spare, state.spare = state.spare, None
            if spare is not None and [s.shape for s in spare] == [t.shape for t in tensors]:
                torch._foreach_copy_(spare, list(tensors))
                state.sum = spare
            else:
                state.sum = [t.detach().clone() for t in tensors]
            if scale != 1.0:
                torch._foreach_mul_(state.sum, scale)
        else:
            torch._foreach_add_(state.sum, list(tensors), alpha=scale)
        state.samples += samples
        state.rounds += 1
        if self.step_samples is None or state.samples >= self.step_samples:
            return True
        # "nearest": stopping now falls short by step - s; one more round of about this one's size (r) would
        # overshoot by s + r - step. Decided from the round's global samples: the same on every rank.
        return self.boundary == "nearest" and 2 * state.samples + samples >= 2 * self.step_samples

    def pending(self, index: int) -> int:
        """Rounds added since the last step of optimizer ``index``."""
        state = self._state.get(index)
        return state.rounds if state is not None else 0

    def samples(self, index: int) -> int:
        """Samples in the rounds added since the last step of optimizer ``index``."""
        state = self._state.get(index)
        return state.samples if state is not None else 0

    def take(self, index: int) -> list[Tensor]:
        """The step's gradient (the sum over the step's divisor), in buffers valid until the next :meth:`add`."""
        state = self._state[index]
        if state.sum is None:
            raise RuntimeError(f"optimizer {index}: no round was added since its last step")
        gradient = state.sum
        if self.reference_samples is None:
            torch._foreach_div_(gradient, float(max(state.samples, 1)))  # the sample-weighted mean
        state.sum, state.spare = None, gradient
        state.samples = state.rounds = 0
        state.steps += 1
        return gradient

    def capped(self, index: int) -> int:
        """Rounds of optimizer ``index`` in this fit that held more than ``reference_samples`` samples, each
        counted as that many (its mean gradient)."""
        state = self._state.get(index)
        return state.capped if state is not None else 0

    def steps(self, index: int) -> int:
        """Optimizer steps of optimizer ``index`` in this fit (a resumed fit counts on from its checkpoint's)."""
        state = self._state.get(index)
        return state.steps if state is not None else 0

    # -------------------------------------------------- fit and checkpoints
    def reset(self, params: dict[int, list[torch.nn.Parameter]]) -> None:
        """At train start: nothing accumulated, but what a resumed checkpoint holds."""
        self._state = {}
        resumed, self._resumed = self._resumed, None
        for index, saved in (resumed or {}).items():
            own = params.get(index)
            total = saved.get("sum")
            state = _Accumulated(samples=int(saved.get("samples", 0)), rounds=int(saved.get("rounds", 0)),
                                 steps=int(saved.get("steps", 0)))
            if own is not None and total is not None:
                like = [*own, own[0]] if self.presence else list(own)  # presence: in the first one's dtype
                shapes = [p.shape for p in own] + ([torch.Size([len(own)])] if self.presence else [])
                if [t.shape for t in total] != shapes:
                    hint = "another model's checkpoint?"
                    if len(total) == len(own) + (0 if self.presence else 1):
                        hint = f"saved with find_unused_parameters={not self.presence}: resume with that"
                    raise ValueError(
                        f"abs_sgd: the checkpoint's accumulated rounds for optimizer {index} do not match its "
                        f"parameters' shapes ({hint})"
                    )
                state.sum = [t.to(device=p.device, dtype=p.dtype) for t, p in zip(total, like)]
            self._state[index] = state

    def save(self, checkpoint: dict[str, Any]) -> None:
        """Adds the accumulated rounds (host copies) and the step counts to ``checkpoint``."""
        if self._state:
            checkpoint[ACCUMULATED_KEY] = {
                i: {"sum": None if s.sum is None else [t.detach().cpu().clone() for t in s.sum],
                    "samples": s.samples, "rounds": s.rounds, "steps": s.steps}
                for i, s in self._state.items()
            }
