"""FitState: the per-fit state a strategy keeps beside its engines, and how a checkpoint hands it over.

A strategy's fit states (the overlapped round in flight, the weight
prediction's last updates, ABS-SGD's accumulated rounds) are written into a
checkpoint by ``save``, read back by ``load`` and taken up by the next
``reset`` at train start: a resumed fit goes on where the saved one stopped.
Everything here runs on the caller's (main) thread; no collective.
"""

from __future__ import annotations

from typing import Any, ClassVar, Optional, Protocol

import torch


class FitState(Protocol):
    """Per-fit state a strategy keeps beside its engines (:meth:`PartialStrategy._fit_states`)."""

    def save(self, checkpoint: dict[str, Any]) -> None: ...

    def load(self, checkpoint: dict[str, Any]) -> None: ...

    def forget_loaded(self) -> None: ...

    def reset(self, params: dict[int, list[torch.nn.Parameter]]) -> None: ...


class CheckpointedState:
    """``load`` and ``forget_loaded`` of a :class:`FitState` saved as one dict under :attr:`checkpoint_key`.

    ``load`` keeps the checkpoint's entry in ``_resumed`` (``None`` when the
    checkpoint has none) until the subclass's ``reset`` takes it up;
    ``forget_loaded`` drops it (a checkpoint loaded outside fitting is not for
    a later fit). Subclasses set :attr:`checkpoint_key` and write ``save`` and
    ``reset``.
    """

    checkpoint_key: ClassVar[str]
    _resumed: Optional[dict[Any, Any]] = None

    def load(self, checkpoint: dict[str, Any]) -> None:
        """Keeps ``checkpoint[checkpoint_key]`` for the next ``reset``."""
        saved = checkpoint.get(self.checkpoint_key)
        self._resumed = dict(saved) if isinstance(saved, dict) else None

    def forget_loaded(self) -> None:
        """A checkpoint loaded outside fitting: nothing of it is for a later fit."""
        self._resumed = None
