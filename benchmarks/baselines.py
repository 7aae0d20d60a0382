"""Baseline strategies for ``python -m benchmarks.imbalance``: post-local SGD and a no-communication bound on CPU.

Both are :class:`~lightning.pytorch.strategies.DDPStrategy` subclasses, so that
they run exactly the code a Lightning user would run today, with three
changes that CPU ranks need:

* **The DDP communication hook is registered on CPU too.** Lightning's
  ``DDPStrategy._register_ddp_hooks`` only registers a hook when the root
  device is CUDA (a comment from PyTorch 1.8 era; gloo supports comm hooks
  today), so on CPU ``ddp_comm_hook`` would be ignored silently and the run
  would be plain DDP.
* **The hook's state is built after the process group exists.**
  ``PostLocalSGDState(subgroup=None)`` makes the hook call
  ``dist.new_subgroups()`` lazily, which sizes the subgroups by the CUDA
  device count (0 on this machine). We build the subgroups explicitly with
  ``dist.new_subgroups(group_size=...)`` (a collective on every rank, so it
  must run in ``setup``, when every rank is there, not in the middle of a
  backward pass).
* **Lightning's per-batch SIGTERM broadcast is replaced** by
  :func:`lightning_partial._compat.replace_sigterm_broadcast` (as
  ``EagerSGDStrategy`` does): Lightning 2.6 runs a ``dist.broadcast`` from
  rank 0 at every batch, a global synchronisation per step that would make
  both baselines wait for the slowest rank at every step and measure
  Lightning's broadcast rather than the algorithm. The replacement never
  requests a stop (``lambda: False``): a SIGTERM is then *not* coordinated
  across ranks (the benchmark's orchestrator kills the whole process group on
  a time-out instead).

Model averaging every ``model_averaging_period`` steps uses Lightning's own
path (``DDPStrategy.setup`` sees a ``PostLocalSGDState`` and creates a
``PeriodicModelAverager(period, warmup_steps=start_localSGD_iter)``;
``DDPStrategy.optimizer_step`` calls ``average_parameters`` after every
optimizer step).
"""

import logging
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.overrides.distributed import _register_ddp_comm_hook
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.algorithms.ddp_comm_hooks import (
    post_localSGD_hook as post_localSGD,
)
from torch.distributed.algorithms.model_averaging import utils as averaging_utils
from torch.nn.parallel import DistributedDataParallel

from lightning_partial import _compat

log = logging.getLogger(__name__)


def noop_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook that communicates nothing: each rank keeps its local gradient.

    DDP's reducer copies the returned buffer back into ``param.grad``; returning
    the bucket's own buffer leaves the local (unaveraged) gradients in place.
    """
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


class _NoGlobalSyncDDPStrategy(DDPStrategy):
    """DDPStrategy whose comm hook is registered on CPU and without Lightning's per-batch broadcast."""

    def _make_comm_state(self) -> object | None:
        """The hook's state, built on every rank once the default process group exists."""
        return None

    def _register_ddp_hooks(self) -> None:
        # Lightning skips hook registration unless the device is CUDA; gloo on CPU
        # supports DDP comm hooks, so register on every device.
        assert isinstance(self.model, DistributedDataParallel)
        self._ddp_comm_state = self._make_comm_state()
        _register_ddp_comm_hook(
            model=self.model,
            ddp_comm_state=self._ddp_comm_state,
            ddp_comm_hook=self._ddp_comm_hook,
            ddp_comm_wrapper=self._ddp_comm_wrapper,
        )

    def on_train_start(self) -> None:
        super().on_train_start()
        assert self.lightning_module is not None
        trainer = self.lightning_module.trainer
        # Lightning's per-batch dist.broadcast from rank 0 would be a global barrier per
        # step; the baselines must not pay it (see the module docstring).
        if not _compat.replace_sigterm_broadcast(trainer, lambda: False):
            log.warning("Lightning's per-batch SIGTERM broadcast was not found: nothing replaced")


class PostLocalSGDStrategy(_NoGlobalSyncDDPStrategy):
    """Post-local SGD as a Lightning user configures it, made to work on CPU ranks.

    Equivalent to ``DDPStrategy(ddp_comm_state=PostLocalSGDState(None, subgroup,
    start_localSGD_iter), ddp_comm_hook=post_localSGD_hook,
    model_averaging_period=period)``: for the first ``start_localSGD_iter``
    steps gradients are allreduced globally (plain DDP); afterwards each
    rank's gradients are allreduced only within its subgroup (``group_size``
    ranks; ``1``, the default, means each rank alone, i.e. no gradient
    communication), and the parameters are averaged globally (one allreduce of
    the flattened parameters on the default group) after optimizer steps
    ``start_localSGD_iter, start_localSGD_iter + period, ...`` (0-based).

    Args:
        start_localSGD_iter: warm-up steps of global gradient averaging.
        model_averaging_period: steps between two global parameter averages.
        group_size: ranks per local-gradient subgroup after the warm-up.
        average_at_end: average the parameters once more at ``on_train_end``
            so that every rank ends with the same model (as eager-SGD's final
            flush does) and rank 0's model is the consensus that is evaluated.
        **kwargs: passed to :class:`~lightning.pytorch.strategies.DDPStrategy`.
    """

    def __init__(
        self,
        *,
        start_localSGD_iter: int = 8,
        model_averaging_period: int = 4,
        group_size: int = 1,
        average_at_end: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            ddp_comm_hook=post_localSGD.post_localSGD_hook, model_averaging_period=model_averaging_period, **kwargs
        )
        self.start_localSGD_iter = start_localSGD_iter
        self.group_size = group_size
        self.average_at_end = average_at_end

    def _make_comm_state(self) -> object:
        # Collective on the default group (every rank creates every subgroup): runs in
        # setup(), where every rank is; never lazily from inside a backward pass.
        subgroup, _ = dist.new_subgroups(group_size=self.group_size)
        # DDPStrategy.setup() finds this PostLocalSGDState after configure_ddp() and
        # builds the PeriodicModelAverager(period, warmup_steps=start_localSGD_iter).
        return post_localSGD.PostLocalSGDState(
            process_group=None, subgroup=subgroup, start_localSGD_iter=self.start_localSGD_iter
        )

    def on_train_end(self) -> None:
        super().on_train_end()
        if self.average_at_end and self._model_averager is not None:
            assert self.lightning_module is not None
            # One more global parameter average: the replicas end identical.
            averaging_utils.average_parameters(
                iter(list(self.lightning_module.parameters())), dist.group.WORLD
            )


class NoCommStrategy(_NoGlobalSyncDDPStrategy):
    """Every rank trains alone: the throughput bound under imbalance.

    DDP with :func:`noop_hook` and no model averaging: after set-up (rank 0's
    weights broadcast by DDP's constructor) and DDP's one-time bucket rebuild
    after the first iteration, no gradient or parameter crosses ranks. The
    replicas drift apart; the benchmark evaluates rank 0's own model, trained
    on its own quarter of the data only. The model must hold no buffers (DDP
    would broadcast them from rank 0 at every forward); ``broadcast_buffers``
    is set to ``False`` to make sure.
    """

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("broadcast_buffers", False)
        super().__init__(ddp_comm_hook=noop_hook, **kwargs)


__all__ = ["NoCommStrategy", "PostLocalSGDStrategy", "noop_hook"]
