"""Flattening a list of tensors into one contiguous buffer per (dtype, device)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Optional, Sequence

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

    def __init__(self, tensors: Sequence[Tensor], *, tail: int = 0, max_free: int = 4) -> None:
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
        # Buffer sets handed back for reuse (RoundResult.release(), superseded deposits,
        # received models), shared by the caller's and the communication thread. On CUDA
        # each set carries an event recorded on the stream that last used it: whoever
        # takes the set makes its own stream wait for that event first.
        self._free: list[tuple[list[Tensor], Optional[torch.cuda.Event]]] = []
        self.max_free = max_free  # buffer sets kept for reuse
        self._lock = threading.Lock()
        #: Buffer sets allocated so far (pool misses): constant in a steady state.
        self.allocations = 0

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
        """Copies ``tensors`` into flat buffers, one per bucket (recycled ones if any), on the current stream."""
        out = self.take()
        for buf, b in zip(out, self.buckets):
            torch.cat([tensors[i].detach().reshape(-1) for i in b.indices], out=buf[: b.numel])
        return out

    def zeros(self) -> list[Tensor]:
        """A zeroed buffer set, on the current stream."""
        return [buf.zero_() for buf in self.take()]

    def recycle(self, flats: list[Tensor]) -> None:
        """Gives a buffer set back for reuse, from the stream that used it last (the current one).

        Fresh 4 MB host buffers cost page faults every round; fresh device buffers
        cost a caching-allocator block per round and per stream, which on CUDA
        adds up to several model copies held by streams that no longer need them.
        On CUDA an event recorded on the current stream goes with the set: the
        next taker's stream waits for it, so no kernel still reading or writing
        the set on this stream can overlap its next use.
        """
        event: Optional[torch.cuda.Event] = None
        if any(f.is_cuda for f in flats):
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(flats[0].device))
        with self._lock:
            if len(self._free) < self.max_free:
                self._free.append((flats, event))

    def take(self) -> list[Tensor]:
        """A buffer set for use on the current stream: a recycled one (after its event), else a new one."""
        with self._lock:
            entry = None
            if self._free:
                # The most recent set whose last use has completed, else the most recent one:
                # waiting for an event still pending would put the taker's stream behind
                # whatever that stream still runs (a round's exchange in flight).
                ready = next((i for i in range(len(self._free) - 1, -1, -1)
                              if self._free[i][1] is None or self._free[i][1].query()), len(self._free) - 1)
                entry = self._free.pop(ready)
            else:
                self.allocations += 1
        if entry is None:
            return [torch.empty(b.capacity, dtype=b.dtype, device=b.device) for b in self.buckets]
        flats, event = entry
        if event is not None:
            stream = torch.cuda.current_stream(flats[0].device)
            stream.wait_event(event)
            for f in flats:
                # The allocator frees a block only once every stream that used it is done.
                f.record_stream(stream)
        return flats

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
