"""Errors raised by the partial-collective engine.

Every error names the rank that raises it and the round it concerns, so that
a log of a many-rank job says at once where a job stopped and why.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional


class PartialCollectiveError(RuntimeError):
    """A round could not complete on this rank (a peer died, a collective failed)."""

    def __init__(self, message: str, *, rank: int, round_index: Optional[int]) -> None:
        where = f"rank {rank}" if round_index is None else f"rank {rank}, round {round_index}"
        super().__init__(f"[partial allreduce, {where}] {message}")
        self.rank = rank
        self.round_index = round_index
        #: The message without its prefix: for an error that quotes this one under a prefix of its own.
        self.detail = message


def detail(err: BaseException) -> str:
    """``err``'s message without the ``[partial allreduce, ...]`` prefix where it has one (quoted in another's)."""
    return err.detail if isinstance(err, PartialCollectiveError) else str(err)


class PartialCollectiveTimeout(PartialCollectiveError, TimeoutError):
    """A blocking wait of the engine exceeded ``PartialAllreduceConfig.timeout``."""


class EngineClosedError(PartialCollectiveError):
    """The engine was used after :meth:`PartialAllreduce.close`."""


def error_kind(err: BaseException) -> type[PartialCollectiveError]:
    """:class:`PartialCollectiveTimeout` if torch's ``err`` reports a timeout, else :class:`PartialCollectiveError`."""
    text = str(err).lower()
    return PartialCollectiveTimeout if ("timed out" in text or "timeout" in text) else PartialCollectiveError


@contextlib.contextmanager
def naming_failure(
    what: str, *, rank: int, round_index: Optional[int], last: bool = False,
    verdict: Optional[Callable[[BaseException], Optional[BaseException]]] = None,
) -> Iterator[None]:
    """Around a collective of the caller's own thread: its failure raised as :class:`PartialCollectiveError`.

    gloo's error (a peer that died, or did not come within the group's timeout) names
    the peer's address but neither this rank nor the round, and says nothing of what
    the collective was for: the message reads "``what`` failed (...)", with ``round_index``
    (the round the collective belongs to; with ``last``, the last one the caller applied, and the
    message says "``what`` after the last round failed") in its prefix.
    A timeout raises :class:`PartialCollectiveTimeout` (:func:`error_kind`), as the engine's
    own collectives do. An error that names them already passes unchanged. ``verdict``: asked
    with torch's error after a failure, a liveness verdict naming the rank that is gone
    (``None``: none is out); the message then gives it first, as the engine's own failures do.
    """
    try:
        yield
    except PartialCollectiveError:
        raise
    except RuntimeError as err:
        after = " after the last round" if last and round_index is not None else ""
        found = verdict(err) if verdict is not None else None
        if found is not None:
            raise error_kind(err)(
                f"{what}{after} failed: {detail(found)} (then: {type(err).__name__}: {err})", rank=rank,
                round_index=round_index,
            ) from err
        raise error_kind(err)(
            f"{what}{after} failed (a peer that died, or did not come within the group's timeout; or the backend's"
            f" own error): {type(err).__name__}: {err}",
            rank=rank, round_index=round_index,
        ) from err
