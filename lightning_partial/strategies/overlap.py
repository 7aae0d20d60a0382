"""Overlapped rounds: a step's round runs while the next step computes (``eager_sgd``'s ``overlap``).

Without overlap, a step hands its gradient to the engine after backward and
waits for its round (``PartialAllreduce.arrive``): the round's store traffic,
hand-off and allreduce are on every step's critical path. With overlap, step
``r`` submits its gradient to round ``r`` (``submit``) and applies the result of
round ``r - 1``, which ran during step ``r``'s forward and backward
(``collect``): each round's result is applied one step after it was computed,
as ``abs_sgd``'s are, and the strategy treats that step as ``abs_sgd`` does:
weight prediction (on by default) computes each gradient at the weights it will
be applied to, and under ``staleness_rule="auto"`` or ``"momentum"`` with SGD
momentum, Adam or AdamW the step is re-timed through the optimizer's momentum
(spike compensation, :func:`~lightning_partial.strategies.compensation.compensate`;
a fresh optimizer's first step is on time). The engine's own rule still weighs
gradients carried from earlier rounds.

:class:`InFlight` is the state this adds from step to step (main thread only),
per optimizer index: the round the last step submitted, or a result already
taken from the engine (a checkpoint takes it, so that the cut is consistent:
see :mod:`~lightning_partial.strategies.checkpoint`). It follows the strategy's
fit-state protocol: saved in checkpoints (the held result, identical on every
rank), kept from a checkpoint loaded to fit, reset at train start.

What a fit gives up by it: its first step applies nothing (no round is
complete yet: the optimizer sees no gradient, so it leaves the weights and its
state alone), and the last submitted round is applied at the end of fit, with
its own optimizer step before the final flush's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch
from torch import Tensor

from lightning_partial.collectives import EngineClosedError, RoundResult
from lightning_partial.strategies.checkpoint import IN_FLIGHT_KEY, CheckpointMismatchError
from lightning_partial.strategies.fit_state import CheckpointedState

__all__ = ["IN_FLIGHT_KEY", "InFlight", "Landed"]


class _Collects(Protocol):
    def collect(self, round_index: int) -> RoundResult: ...


@dataclass
class Landed:
    """A round's result to apply: the engine's tensors, and its result where this fit took it (else ``None``:
    restored from a checkpoint, with no statistics)."""

    tensors: list[Tensor]
    result: Optional[RoundResult]
    # Every parameter known to be used (this rank's fresh gradient, with every parameter's, is in the round).
    known_used: bool
    # Optimizer updates between the step that computed the round's fresh gradients and this one: 1, or 0
    # where the step between applied nothing (a fit's first step); what the step's re-timing uses.
    delay: int = 1

    def release(self) -> None:
        if self.result is not None:
            self.result.release()


@dataclass
class _Submitted:
    engine: _Collects
    round_index: int
    all_present: bool  # the submitting step had a gradient for every parameter


class InFlight(CheckpointedState):
    """Per optimizer index, the round submitted by the last step and not applied yet (see the module docstring).

    Args:
        extra: tensors the engine carries per round beyond one per parameter (``find_unused_parameters``: 1),
            checked against a resumed checkpoint's results.
    """

    checkpoint_key = IN_FLIGHT_KEY

    def __init__(self, *, extra: int = 0) -> None:
        self._extra = extra
        self._submitted: dict[int, _Submitted] = {}
        self._held: dict[int, Landed] = {}
        # Per optimizer index: whether the last step applied a result (an optimizer update came after the
        # gradients it submitted were computed).
        self._applied: dict[int, bool] = {}
        self._resumed: Optional[dict[int, dict[str, Any]]] = None

    def submitted(self, index: int, engine: _Collects, round_index: int, *, all_present: bool) -> None:
        """Records that this step submitted ``round_index`` to ``engine`` (applied by the next step)."""
        assert index not in self._submitted and index not in self._held, "take() the earlier round first"
        self._submitted[index] = _Submitted(engine, round_index, all_present)

    def take(self, index: int, rank: int) -> Optional[Landed]:
        """The earlier round's result (waiting for it if needed), or ``None`` if there is none (a fit's first step).

        The caller applies what it returns with one optimizer step, or applies nothing.
        """
        landed = self._held.pop(index, None)
        if landed is None:
            pending = self._submitted.pop(index, None)
            if pending is not None:
                result = pending.engine.collect(pending.round_index)
                landed = Landed(result.tensors, result, pending.all_present and rank in result.stats.fresh)
        if landed is not None:
            landed.delay = 1 if self._applied.get(index, True) else 0
        self._applied[index] = landed is not None
        return landed

    def settle(self, rank: int) -> None:
        """Takes every submitted round's result now (held for the next step): nothing is in flight afterwards.

        A round that will never run (its engine stopped at an earlier round: a stop request) is
        forgotten here: its deposit is still in the engine's send buffer, which the engine's own
        state saves as a carried gradient.
        """
        for index in sorted(self._submitted):
            pending = self._submitted[index]
            try:
                result = pending.engine.collect(pending.round_index)
            except EngineClosedError:
                del self._submitted[index]
                continue
            del self._submitted[index]
            self._held[index] = Landed(result.tensors, result, pending.all_present and rank in result.stats.fresh)

    # -------------------------------------------------- fit and checkpoints
    def reset(self, params: dict[int, list[torch.nn.Parameter]]) -> None:
        """At train start: nothing from a previous fit; a resumed checkpoint's results on the parameters' devices.

        Raises ``CheckpointMismatchError`` where a saved result does not fit the parameters (another
        model, or ``find_unused_parameters`` changed since the save).
        """
        for landed in self._held.values():
            landed.release()
        self._submitted, self._held, self._applied = {}, {}, {}
        resumed, self._resumed = self._resumed, None
        for index, saved in (resumed or {}).items():
            tensors, applied = saved["tensors"], bool(saved["applied"])
            own = params.get(index)
            if not own:
                continue
            if len(tensors) != len(own) + self._extra or any(
                t.shape != p.shape for t, p in zip(tensors, own)
            ):
                raise CheckpointMismatchError(
                    f"eager_sgd overlap: the checkpoint holds optimizer {index}'s round result not yet applied, "
                    f"{len(tensors)} tensors that do not fit its {len(own)} parameters "
                    f"(with find_unused_parameters={bool(self._extra)}): resume with the model and options it "
                    "was saved with"
                )
            device = own[0].device
            self._held[index] = Landed([t.to(device) for t in tensors], None, known_used=False)
            self._applied[index] = applied

    def save(self, checkpoint: dict[str, Any]) -> None:
        """Adds the results not yet applied to ``checkpoint`` (host copies); call :meth:`settle` first."""
        assert not self._submitted, "settle() before save()"
        if self._held:
            checkpoint[IN_FLIGHT_KEY] = {
                i: {"tensors": [t.detach().cpu().clone() for t in landed.tensors],
                    "applied": self._applied.get(i, True)}
                for i, landed in self._held.items()
            }
