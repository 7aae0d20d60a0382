"""A round's result, and its hand-over from the communication thread to the caller's stream."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from lightning_partial.collectives.layout import TensorLayout
from lightning_partial.collectives.stats import RoundStats


@dataclass(frozen=True, eq=False)
class RoundResult:
    """The result of one round, identical on every rank.

    ``tensors`` are shaped like the engine's tensors and already normalised;
    on CUDA they are ready to use on the caller's current stream. They are
    views of engine-allocated buffers that belong to the caller until it calls
    :meth:`release` (optional: it lets the engine reuse the memory).
    """

    round_index: int
    tensors: list[Tensor]
    stats: RoundStats
    buffers: list[Tensor] = dataclasses.field(default_factory=list, repr=False)
    layout: Optional[TensorLayout] = dataclasses.field(default=None, repr=False, compare=False)
    _released: list[bool] = dataclasses.field(default_factory=list, repr=False, compare=False)

    def release(self) -> None:
        """Hands the buffers back to the engine; ``tensors`` must not be used afterwards.

        Idempotent: a second call does nothing (a buffer is never pooled twice).
        """
        if self._released:
            return
        self._released.append(True)
        if self.layout is not None and self.buffers:
            buffers = list(self.buffers)
            self.buffers.clear()
            self.layout.recycle(buffers)
        self._on_release()

    def _on_release(self) -> None:
        """Called once by :meth:`release`, after the buffers: what else a subclass's result showed."""


def hand_over(result: RoundResult, done: Optional[torch.cuda.Event], device: Optional[torch.device]) -> None:
    """Caller's thread, as it takes ``result``: CUDA tensors become usable on its current stream.

    The communication thread wrote them on the engine's side stream and recorded
    ``done`` there: the caller's stream waits for that event (no host block), and
    the allocator learns that the caller's stream uses the buffers. Nothing on the host.
    """
    if device is None:
        return
    stream = torch.cuda.current_stream(device)  # pragma: no cover - needs GPUs
    assert done is not None  # pragma: no cover - needs GPUs
    stream.wait_event(done)  # pragma: no cover - needs GPUs
    for t in result.tensors:  # pragma: no cover - needs GPUs
        t.record_stream(stream)
