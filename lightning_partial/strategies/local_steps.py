"""Local steps between model-averaging rounds: ``average_every`` of ``wagma_sgd`` and ``ds_sync``.

With ``average_every=H`` a rank takes ``H - 1`` optimizer steps on its own
gradients alone, and joins its engine's round (the group average of the
models) at every ``H``-th: local SGD (Lin et al., *Don't Use Large Mini-Batches,
Use Local SGD*, ICLR 2020; Lightning's post-local SGD averages every ``H`` steps
too), but with the strategy's wait-avoiding rounds instead of a global
allreduce that waits for every rank. A round costs the same collectives
however many steps it follows, so a rank's communication per trained sample
falls by ``H``; where each collective takes CPU from the ranks' compute (several
ranks per host, CPU collectives) that is most of what separates the fast ranks
from the no-communication bound. Off by default: the main jobs ended 3-7 points below DDP with it
(means of three seeds; ``docs/staleness.md#local-steps-between-rounds``).

Rounds keep their meaning: ``max_staleness``, ``global_every``, ``measure_every``
and the group schedules count rounds, each ``H`` optimizer steps apart. The
synchronous finish (``final_sync``) is placed in optimizer steps, as without
local steps, and keeps the period: its rounds (the first at or after its first
step, the engine's ``sync_from``, and those after it) are synchronous global
averages of every rank's model of that step, as post-local SGD's, so the fit
ends on fresh models without waiting for a straggler at every step (a round
per step in the finish measured 0.76-0.83 of the bound on the imbalance
benchmark, against 0.85-0.94 with the period kept). ``finish="gradients"`` (DDP's step at every step of the finish)
needs a round per step and is refused with ``average_every > 1``.

Every rank takes the same decision at the same optimizer step: the count of
steps since an engine's last round is a per-fit state (identical on every
rank, saved in checkpoints, taken up by a resumed fit before its engines are
built). Main thread only; no collective.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from lightning_partial.strategies.fit_state import CheckpointedState

#: The checkpoint key of the steps each optimizer took since its engine's last round.
LOCAL_STEPS_KEY = "lightning_partial_local_steps"


class LocalSteps(CheckpointedState):
    """Which optimizer steps join their engine's round: every ``every``-th.

    A :class:`~lightning_partial.strategies.fit_state.FitState` (saved, loaded, forgotten as the
    others), but taken up by :meth:`begin` before the engines are built, since where the finish's first
    round falls depends on where in its period each optimizer resumes; :meth:`reset`, which runs after
    the engines are built, leaves it.
    """

    checkpoint_key: ClassVar[str] = LOCAL_STEPS_KEY

    def __init__(self, every: int) -> None:
        self.every = every
        self._since: dict[int, int] = {}  # optimizer index -> its local steps since its engine's last round

    def begin(self) -> None:
        """Every rank, at train start, before the engines are built: a resumed checkpoint's counts, else none."""
        resumed, self._resumed = self._resumed, None
        self._since = {int(i): int(n) for i, n in (resumed or {}).items() if 0 <= int(n) < self.every}

    def reset(self, params: dict[int, list[torch.nn.Parameter]]) -> None:
        """Taken up by :meth:`begin` already (before the engines were built)."""

    def save(self, checkpoint: dict[str, Any]) -> None:
        """Adds the counts to ``checkpoint`` where a period is under way."""
        since = {i: n for i, n in self._since.items() if n}
        if since:
            checkpoint[LOCAL_STEPS_KEY] = since

    def since(self, index: int) -> int:
        """Optimizer ``index``'s local steps since its engine's last round."""
        return self._since.get(index, 0)

    def joins_round(self, index: int) -> bool:
        """Whether optimizer ``index``'s next step joins its engine's round (and then call :meth:`stepped`)."""
        return self.since(index) + 1 >= self.every

    def stepped(self, index: int, *, averaged: bool) -> None:
        """Optimizer ``index`` took a step, which joined its engine's round or not."""
        self._since[index] = 0 if averaged else self.since(index) + 1

    def rounds_in(self, index: int, steps: int) -> int:
        """The rounds optimizer ``index``'s next ``steps`` steps join (the finish's first round, ``steps``
        before its first step, is this many rounds after the next); ``steps < 0``, inside the finish: a round
        index that many below the next (at or below the finish's first round: nothing is begun again)."""
        return (self.since(index) + steps) // self.every if steps >= 0 else steps
