"""Weight prediction: a gradient computed at the weights it will be applied to.

A strategy that applies a gradient a round after the step that computed it
(``abs_sgd`` always; ``eager_sgd`` for every gradient that misses its round)
feeds the optimizer a gradient of weights one update old. Linear weight
prediction (SpecTrain, Chen et al. 2018; the linear prediction of Kosson et
al., *Pipelined Backpropagation at Scale*, 2021) computes it instead at
``w + u``, the current weights plus the last step's update ``u``: where the
weights will be when the gradient is applied, if the next update resembles
the last. A gradient that is applied at once (fresh) is then a look-ahead
gradient, as Nesterov's momentum takes one.

Main thread only; no collective. Per optimizer, two parameter-sized buffers:
the last update, and the weights before a step, which restore the weights
exactly after the forward and backward passes (``(w + u) - u`` is not ``w`` in
floating point, and replicas must stay bit-identical) and then become the
step's update in place. The update a step leaves is ``w_after - w_before``,
whatever produced it (the optimizer, clipping, spike compensation). It is
kept negated, ``w_before - w_after``: one pass over the parameters instead of
two (a negation then an addition), and ``w - (w_before - w_after)`` is
``w + u`` bit for bit (IEEE subtraction is the addition of the negation,
and rounding is symmetric), but for the sign of a weight that is zero where
its update is zero. :meth:`WeightPrediction.update` and
checkpoints give ``u`` itself.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional, Sequence

import torch
from torch import Tensor

from lightning_partial.strategies.fit_state import CheckpointedState

__all__ = ["LAST_UPDATE_KEY", "WeightPrediction", "copy_weights"]

#: The checkpoint entry holding the last update per optimizer index (``{index: [tensor per parameter]}``).
LAST_UPDATE_KEY = "lightning_partial_last_update"


def _detached(params: Sequence[Tensor]) -> list[Tensor]:
    return [p.detach() for p in params]


def _flip(tensors: Sequence[Tensor]) -> list[Tensor]:
    """``0 - t`` for each tensor, as new tensors: ``u`` from the kept ``w_before - w_after`` and back. Every zero
    comes out ``+0.0``, the sign ``w_after - w_before`` gives a zero update but where ``w_after`` is ``-0.0`` and
    ``w_before`` ``+0.0`` (a negation would make every zero ``-0.0``)."""
    return [torch.rsub(t.detach(), 0.0) for t in tensors]


def copy_weights(params: Sequence[Tensor], into: Optional[list[Tensor]]) -> list[Tensor]:
    """A copy of ``params``: into the buffers ``into`` when they have the same shapes, else new tensors."""
    if into is None or [b.shape for b in into] != [p.shape for p in params]:
        return [p.detach().clone() for p in params]
    torch._foreach_copy_(into, _detached(params))
    return into


class WeightPrediction(CheckpointedState):
    """The last update per optimizer index, and the prediction and restoring around a gradient's computation.

    Use, per step of optimizer ``index`` with parameters ``params``::

        before = prediction.begin(index, params)      # copy of w
        with prediction.predicted(index, params, before):
            loss = closure()                            # forward/backward at w + u, then w again
        optimizer.step()
        prediction.finish(index, params, before)       # u <- w_after - w_before

    A strategy that computes several gradients per step (``abs_sgd``'s micro-batches)
    calls :meth:`begin`/:meth:`predicted` per gradient and :meth:`release` the copy,
    then :meth:`begin`/:meth:`finish` around each optimizer step.
    """

    checkpoint_key = LAST_UPDATE_KEY

    def __init__(self) -> None:
        self._updates: dict[int, list[Tensor]] = {}  # negated: w_before - w_after
        self._spare: dict[int, list[Tensor]] = {}
        self._resumed: Optional[dict[int, list[Tensor]]] = None

    # ------------------------------------------------------------ the step
    def begin(self, index: int, params: Sequence[Tensor]) -> list[Tensor]:
        """A copy of the weights (in a reused buffer when one is free)."""
        return copy_weights(params, self._spare.pop(index, None))

    @contextlib.contextmanager
    def predicted(self, index: int, params: Sequence[Tensor], before: list[Tensor]) -> Iterator[None]:
        """Inside: the weights are ``before + u`` (``u``: the last update; none before the first step).

        On exit (also on an exception) they are ``before`` again, exactly.
        """
        negated = self._updates.get(index)
        if negated is None:
            yield
            return
        with torch.no_grad():
            torch._foreach_sub_(_detached(params), negated)  # w + u, bit for bit
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(_detached(params), before)

    def finish(self, index: int, params: Sequence[Tensor], before: list[Tensor]) -> None:
        """After the step: ``before`` becomes the step's update ``w_after - w_before`` (exactly; kept negated, in
        place, for the next step)."""
        with torch.no_grad():
            torch._foreach_sub_(before, _detached(params))
        previous = self._updates.get(index)
        self._updates[index] = before
        if previous is not None:
            self._spare[index] = previous

    def release(self, index: int, buffers: list[Tensor]) -> None:
        """Gives back a copy from :meth:`begin` that did not become an update."""
        self._spare[index] = buffers

    def update(self, index: int) -> Optional[list[Tensor]]:
        """The last update ``w_after - w_before`` of optimizer ``index`` (new tensors; ``None`` before its first
        step)."""
        negated = self._updates.get(index)
        return None if negated is None else _flip(negated)

    # -------------------------------------------------- fit and checkpoints
    def reset(self, params: dict[int, list[torch.nn.Parameter]]) -> None:
        """At train start: no update carried from a previous fit, but the one of a checkpoint being resumed."""
        self._updates, self._spare = {}, {}
        resumed, self._resumed = self._resumed, None
        for index, update in (resumed or {}).items():
            own = params.get(index)
            if own is not None and [u.shape for u in update] == [p.shape for p in own]:
                self._updates[index] = _flip([u.to(device=p.device, dtype=p.dtype) for u, p in zip(update, own)])

    def save(self, checkpoint: dict[str, Any]) -> None:
        """Adds the last updates to ``checkpoint`` (host copies), if there are any."""
        if self._updates:
            checkpoint[LAST_UPDATE_KEY] = {
                # To the host first: no second model-sized block on the device while saving.
                i: _flip([n.detach().cpu() for n in negated]) for i, negated in self._updates.items()
            }
