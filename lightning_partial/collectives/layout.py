"""Flattening a list of tensors into one contiguous buffer per (dtype, device)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor


@dataclass(frozen=True)
class _Bucket:
    dtype: torch.dtype
    device: torch.device
    indices: tuple[int, ...]
    shapes: tuple[torch.Size, ...]
    numel: int
    capacity: int  # elements of a flat buffer: numel, plus the layout's tail on the first bucket


class TensorLayout:
    """The fixed structure of what a rank contributes every round.

    Tensors are grouped by dtype and device; each group travels as one flat
    buffer (one collective per group). The layout is fixed by the first
    round: a later round whose tensors differ in number, shape, dtype or
    device is an error, because the collective sequence must be identical on
    every rank and in every round.

    ``tail`` extra elements follow the data in the first bucket's buffers: the
    engine carries its round header there, so that one collective moves both
    (see ``PartialAllreduce``). :meth:`unflatten` and :meth:`data` never show it.
    """

    def __init__(self, tensors: Sequence[Tensor], *, tail: int = 0) -> None:
        if len(tensors) == 0:
            raise ValueError("a partial allreduce needs at least one tensor")
        if tail < 0:
            raise ValueError(f"tail must be >= 0, got {tail}")
        groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
        for i, t in enumerate(tensors):
            if not isinstance(t, Tensor):
                raise ValueError(f"tensor {i} is a {type(t).__name__}, not a torch.Tensor")
            groups.setdefault((t.dtype, t.device), []).append(i)
        self.signature: tuple[tuple[torch.Size, torch.dtype, torch.device], ...] = tuple(
            (t.shape, t.dtype, t.device) for t in tensors
        )
        self.tail = tail
        self.buckets: tuple[_Bucket, ...] = tuple(
            _Bucket(
                dtype=dtype,
                device=device,
                indices=tuple(idx),
                shapes=tuple(tensors[i].shape for i in idx),
                numel=(numel := sum(tensors[i].numel() for i in idx)),
                capacity=numel + (tail if k == 0 else 0),
            )
            for k, ((dtype, device), idx) in enumerate(groups.items())
        )
        # Buffers handed back by RoundResult.release(), shared by the caller's
        # and the communication thread.
        self._free: list[list[Tensor]] = []
        self._max_free = 4
        self._lock = threading.Lock()

    def check(self, tensors: Sequence[Tensor], *, rank: int, round_index: int) -> None:
        """Raises ``ValueError`` if ``tensors`` do not match the layout."""
        signature = tuple((t.shape, t.dtype, t.device) for t in tensors)
        if signature != self.signature:
            raise ValueError(
                f"rank {rank}, round {round_index}: the tensors changed since the first round "
                f"(expected {len(self.signature)} tensors {_describe(self.signature)}, "
                f"got {len(signature)} tensors {_describe(signature)}); the layout must stay fixed"
            )

    def flatten(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        """Copies ``tensors`` into flat buffers, one per bucket (recycled ones if any)."""
        out = self._take()
        for buf, b in zip(out, self.buckets):
            torch.cat([tensors[i].detach().reshape(-1) for i in b.indices], out=buf[: b.numel])
        return out

    def zeros(self) -> list[Tensor]:
        return [buf.zero_() for buf in self._take()]

    def recycle(self, flats: list[Tensor]) -> None:
        """Gives buffers back for reuse: fresh 4 MB buffers cost page faults every round.

        Host buffers only: a CUDA buffer may still be read by a stream the pool
        cannot see, and the caching allocator already recycles device memory.
        """
        if any(f.is_cuda for f in flats):
            return
        with self._lock:
            if len(self._free) < self._max_free:
                self._free.append(flats)

    def _take(self) -> list[Tensor]:
        with self._lock:
            if self._free:
                return self._free.pop()
        return [torch.empty(b.capacity, dtype=b.dtype, device=b.device) for b in self.buckets]

    def tail_of(self, flats: Sequence[Tensor]) -> Tensor:
        """The tail of the first bucket's buffer (a view)."""
        b = self.buckets[0]
        return flats[0][b.numel : b.capacity]

    def data(self, flats: Sequence[Tensor]) -> list[Tensor]:
        """Views of the buffers without the tail (what a checkpoint keeps)."""
        return [f[: b.numel] for f, b in zip(flats, self.buckets)]

    def from_data(self, data: Sequence[Tensor]) -> list[Tensor]:
        """New buffers (zero tail) holding copies of :meth:`data` views, on the layout's devices."""
        out = []
        for d, b in zip(data, self.buckets):
            buf = torch.zeros(b.capacity, dtype=b.dtype, device=b.device)
            buf[: b.numel].copy_(d)
            out.append(buf)
        return out

    def unflatten(self, flats: Sequence[Tensor]) -> list[Tensor]:
        """Views of ``flats`` shaped like the original tensors, in their order."""
        out: list[Tensor] = [None] * len(self.signature)  # type: ignore[list-item]
        for bucket, flat in zip(self.buckets, flats):
            offset = 0
            for i, shape in zip(bucket.indices, bucket.shapes):
                n = shape.numel()
                out[i] = flat[offset : offset + n].view(shape)
                offset += n
        return out


def _describe(signature: Sequence[tuple[torch.Size, torch.dtype, torch.device]]) -> str:
    shown = ", ".join(f"{tuple(s)}:{str(d).replace('torch.', '')}@{dev}" for s, d, dev in signature[:4])
    return f"[{shown}{', ...' if len(signature) > 4 else ''}]"
