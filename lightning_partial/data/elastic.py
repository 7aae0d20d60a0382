"""ElasticBatchSampler: a rank's batches without an end, with a batch size that may change.

ABS-SGD lets a fast rank take more micro-batches than a slow one, so no rank
may run out of data before the others, and an epoch is defined by *global*
samples (see :mod:`lightning_partial.collectives.delayed`). This sampler gives
rank ``i`` the indices ``i, i + P, i + 2P, ...`` of a permutation drawn from
``(seed, epoch, pass)`` (the shard ``DistributedSampler`` would give it), and
when its shard is used up starts the next pass over a fresh permutation of it
(**Decision**: a fast rank revisits its own shard rather than taking another
rank's, so no coordination is needed; over an epoch every sample is seen about
``epoch share x P`` times). It has no ``len``: Lightning then treats the
loader as unsized and the strategy ends the epoch.

``batch_size`` may be changed between batches (``AdaptiveBatchSize`` does):
the next batch drawn has the new size.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler

from lightning_partial.collectives.checks import check_int


class ElasticBatchSampler(Sampler[list[int]]):
    """Endless batches of rank ``rank``'s shard of ``num_samples`` indices (a ``batch_sampler``)."""

    def __init__(
        self,
        num_samples: int,
        *,
        batch_size: int,
        num_replicas: int,
        rank: int,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        for name, value in (("num_samples", num_samples), ("batch_size", batch_size), ("num_replicas", num_replicas)):
            check_int(name, value, owner="ElasticBatchSampler")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"ElasticBatchSampler: rank must be in 0..{num_replicas - 1}, got {rank!r}")
        if num_samples < num_replicas:
            raise ValueError(f"ElasticBatchSampler: {num_samples} samples cannot feed {num_replicas} ranks")
        self.num_samples = num_samples
        self._batch_size = batch_size
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0

    @property
    def batch_size(self) -> int:
        """This rank's micro-batch size; settable (``AdaptiveBatchSize`` sets it), to an integer >= 1."""
        return self._batch_size

    @batch_size.setter
    def batch_size(self, value: int) -> None:
        # 0 or less would make __iter__ yield empty batches forever.
        check_int("batch_size", value, owner="ElasticBatchSampler")
        self._batch_size = value

    def set_epoch(self, epoch: int) -> None:
        """Called by Lightning at every epoch start (as for ``DistributedSampler``)."""
        self.epoch = epoch

    def _generator(self, rounds: int) -> torch.Generator:
        g = torch.Generator()
        g.manual_seed(((self.seed * 1_000_003 + self.epoch) * 1_000_003 + rounds) & 0x7FFF_FFFF_FFFF_FFFF)
        return g

    def _shard(self, rounds: int) -> list[int]:
        """Pass ``rounds`` over this rank's shard (the same shard every pass of an epoch)."""
        if not self.shuffle:
            return list(range(self.num_samples))[self.rank :: self.num_replicas]
        shard = torch.randperm(self.num_samples, generator=self._generator(0)).tolist()[self.rank :: self.num_replicas]
        if rounds == 0:
            return shard
        order = torch.randperm(len(shard), generator=self._generator(rounds)).tolist()
        return [shard[i] for i in order]

    def __iter__(self) -> Iterator[list[int]]:
        rounds = 0
        shard = self._shard(rounds)
        position = 0
        while True:
            batch: list[int] = []
            while len(batch) < self.batch_size:
                if position == len(shard):
                    rounds += 1
                    shard, position = self._shard(rounds), 0
                take = min(self.batch_size - len(batch), len(shard) - position)
                batch += shard[position : position + take]
                position += take
            yield batch
