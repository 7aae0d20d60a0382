"""Errors raised by the partial-collective engine.

Every error names the rank that raises it and the round it concerns, so that
a log of a many-rank job says at once where a job stopped and why.
"""

from __future__ import annotations

from typing import Optional


class PartialCollectiveError(RuntimeError):
    """A round could not complete on this rank (a peer died, a collective failed)."""

    def __init__(self, message: str, *, rank: int, round_index: Optional[int]) -> None:
        where = f"rank {rank}" if round_index is None else f"rank {rank}, round {round_index}"
        super().__init__(f"[partial allreduce, {where}] {message}")
        self.rank = rank
        self.round_index = round_index


class PartialCollectiveTimeout(PartialCollectiveError, TimeoutError):
    """A blocking wait of the engine exceeded ``PartialAllreduceConfig.timeout``."""


class EngineClosedError(PartialCollectiveError):
    """The engine was used after :meth:`PartialAllreduce.close`."""
