"""What one round passes between its hooks: the deposits it takes, its context, its collectives, its outcome.

The communication thread builds a :class:`RoundContext` at the round's
snapshot and hands it to each hook of
:class:`~lightning_partial.collectives.runner.RoundRunner` in turn; a hook
returns what the next one needs (the send buffer, a :class:`DataRound`, a
:class:`DataOutcome`) instead of leaving it in an engine field, so no state of
one round outlives it on the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor


@dataclass
class Deposit:
    """Gradients of one or more steps waiting in this rank's send buffer (guarded by the engine's lock)."""

    flats: list[Tensor]
    step: int
    ready: Optional[torch.cuda.Event] = None  # recorded on the producer's stream
    weight: float = 1.0  # set at the round's snapshot: config.staleness.weight(round - step)


@dataclass(frozen=True)
class Issued:
    """A collective in flight: its work, what it is (for errors), and whether NCCL runs it on the side stream.

    ``stream_ordered``: ``wait()`` only orders the side stream after the kernel
    (it does not block this thread); its completion on the GPU is bounded by the
    engine's :class:`~lightning_partial.collectives.nccl.CompletionWatch`.
    """

    work: Any
    what: str
    stream_ordered: bool = False


@dataclass(frozen=True)
class RoundContext:
    """One round as its communication thread took it, passed to every hook of the round.

    Attributes:
        index: the round.
        row: the header with this rank's row filled (zeros elsewhere) before the
            collectives; the header's collective sums it in place.
        deposits: what this rank's send buffer held at the snapshot.
        flush: this rank flushes at this round.
        global_round: every rank takes part in the data collective with the same
            role (the flush, a ``sync_every`` round): known locally, identical on
            every rank.
        began: ``time.monotonic()`` when the thread began waiting for the round.
        activated: ``time.monotonic()`` when it saw the activation.
    """

    index: int
    row: Tensor
    deposits: list[Deposit]
    flush: bool
    global_round: bool
    began: float
    activated: float


@dataclass
class DataRound:
    """The data collectives a round started (:meth:`RoundRunner._start_data`), for :meth:`RoundRunner._finish_data`.

    Subclasses that exchange something else than a global sum extend it with
    what their finish needs (GroupAverage: the group and the receive buffers).
    """

    works: list[Issued] = field(default_factory=list)


@dataclass
class DataOutcome:
    """What a round's data collectives produced: the result's flat buffers and the divisor applied.

    Subclasses extend it with their own statistics (:meth:`stats_fields`).
    """

    flats: list[Tensor]
    divisor: float

    def stats_fields(self) -> dict[str, Any]:
        """Extra :class:`~lightning_partial.collectives.stats.RoundStats` fields of the round."""
        return {}
