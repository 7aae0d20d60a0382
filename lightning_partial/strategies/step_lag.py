"""StepLag: how many optimizer steps late ``abs_sgd`` applies this rank's micro-batches.

Under ``abs_sgd`` a round's result is applied one *round* late, but the
optimizer steps once per global batch of several rounds, so what the update
rule meets is a lag in *optimizer steps*, and it differs by rank: a fast
rank's micro-batch is often applied by the very step that starts from the
weights it was computed on (lag 0), a slow rank's full micro-batch spans
several steps (lag 2 or 3 at a quarter of the speed). Weight prediction
extrapolates by one step whatever the lag; the measured lags say how far that
is from where each gradient is applied (docs/staleness.md, abs_sgd).

The lag of a micro-batch computed on the weights after ``s`` optimizer steps
and applied by step ``t`` (the ``t``-th, which starts from the weights after
``t - 1`` steps) is ``t - 1 - s``: 0 when it is applied to the weights it was
computed on. Measured locally, on the main thread, from what this rank
knows: the round its deposit went into (a deposit goes into the next round
the engine snapshots) and the step that first includes that round's result.
A diagnostic: no collective, not checkpointed (a resumed fit measures the
micro-batches it deposits itself).
"""

from __future__ import annotations

from collections import Counter, deque
from typing import Optional

__all__ = ["StepLag"]


class StepLag:
    """Per optimizer index: the lags of this rank's micro-batches, weighted by their samples."""

    def __init__(self) -> None:
        self._in_flight: dict[int, deque[tuple[int, int, int]]] = {}  # (round, steps before, samples)
        self._samples: dict[int, Counter[int]] = {}
        self._last: dict[int, float] = {}

    def reset(self) -> None:
        """At train start: nothing measured yet."""
        self._in_flight, self._samples, self._last = {}, {}, {}

    def deposited(self, index: int, round_index: int, steps_before: int, samples: int) -> None:
        """A micro-batch computed after ``steps_before`` optimizer steps went into round ``round_index``."""
        self._in_flight.setdefault(index, deque()).append((round_index, steps_before, samples))

    def stepped(self, index: int, through_round: int, steps: int) -> None:
        """Optimizer step number ``steps`` applied the rounds up to ``through_round``: their micro-batches' lags."""
        queue = self._in_flight.get(index)
        total = weighted = 0
        while queue and queue[0][0] <= through_round:
            _, before, samples = queue.popleft()
            lag = steps - 1 - before
            self._samples.setdefault(index, Counter())[lag] += samples
            total += samples
            weighted += lag * samples
        if total:
            self._last[index] = weighted / total

    def last(self, index: int) -> Optional[float]:
        """The mean lag (by samples) of this rank's micro-batches the latest step applied (``None``: none yet)."""
        return self._last.get(index)

    def histogram(self, index: int) -> dict[int, int]:
        """Samples of this rank's applied micro-batches, per lag in optimizer steps."""
        return dict(sorted(self._samples.get(index, Counter()).items()))

    def mean(self, index: int) -> Optional[float]:
        """The mean lag (by samples) over the fit so far (``None``: nothing applied yet)."""
        histogram = self._samples.get(index)
        total = sum(histogram.values()) if histogram else 0
        return sum(lag * n for lag, n in histogram.items()) / total if histogram and total else None
