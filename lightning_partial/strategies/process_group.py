"""ProcessGroupStrategy: Lightning's process-group plumbing, with the strategy's own collectives on gloo.

The base of :class:`~lightning_partial.strategies.partial.PartialStrategy`: what a
``ParallelStrategy`` needs to launch the processes and initialise the default
group as ``DDPStrategy`` does, plus the gloo group that the strategy's own
collectives use, for the reason below.

**Invariant: one thread per NCCL communicator while the engines run.** NCCL can
deadlock when kernels of two communicators are launched in different orders on
different ranks, and the main thread and an engine's communication thread
cannot agree on an order: rounds start whenever the fastest rank activates
them. So, from the engines' start (``on_train_start``) to their close, the only
NCCL communicators in use are the engines' own data groups, each driven by its
engine's communication thread alone; the strategy's own collectives
(``barrier``, ``broadcast``, ``reduce`` and with it ``self.log(sync_dist=True)``
and ``reduce_boolean_decision``, ``all_gather``, the checkpoint's gather, the
buffer average, the store's address, ABS-SGD's quiesce) run on
:attr:`PartialStrategy.collective_group`, a gloo group of all ranks made at
set-up (the default group itself when that is gloo), on host copies of their
tensors. The default NCCL group is used by the set-up (the broadcast of the
weights, ``new_group`` for the collective group), before any engine exists, and
by each engine's ``start()``
(``dist.new_group`` and a one-element allreduce that creates its NCCL
communicator), on the main thread, before any round can be activated: rounds
need arrivals, which begin after ``on_train_start``. ``SyncBatchNorm``, which would issue a
default-group collective in every forward pass, is refused unless rounds are
fully synchronous (``mode="sync"``). User code that runs its own collectives
during fit (for example torchmetrics' ``dist_sync``) must pass
``process_group=trainer.strategy.collective_group``, as the strategy does.
In pure ``mode="sync"`` Lightning's per-batch SIGTERM broadcast (and
``SyncBatchNorm``) still use the default group: there each communication thread
enters round ``q`` only after its own rank's ``arrive(q)``, and the caller's
stream waits for round ``q`` before the next batch, so both communicators'
kernels are launched in the same order on every rank.
"""

from __future__ import annotations

import contextlib
import logging
import os
from datetime import timedelta
from typing import Any, Literal, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from typing_extensions import override

from lightning_partial import _compat
from lightning_partial.collectives.checks import check_timedelta
from lightning_partial.collectives.errors import naming_failure

log = logging.getLogger(__name__)


def _warn_if_restarts_share_the_rendezvous_store() -> None:
    """Warns when torchrun may restart the workers on a rendezvous store it shares with them.

    torchrun (c10d rendezvous) lets its workers initialise their default group on its
    own store (``TORCHELASTIC_USE_AGENT_STORE=True``) and keeps that store across
    restarts, so a restarted group can read the addresses of the group that died and
    fail in ``init_process_group`` (gloo: ``connectFullMesh ... Connection refused``;
    NCCL likewise, pytorch/pytorch#135712). ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
    in torchrun's environment gives each attempt a store of its own.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and int(
        os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0
    ) > 0:
        log.warning(
            "torchrun --max-restarts with its rendezvous store shared with the workers: a restarted group may "
            "fail to connect (stale addresses from the attempt that died, pytorch/pytorch#135712). Launch with "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment"
        )


def check_backend(backend: object) -> None:
    """``process_group_backend``: ``None`` (chosen from the device) or a backend ``torch.distributed`` knows, alone or
    per device (``"cpu:gloo,cuda:nccl"``), checked at construction: an unknown one would fail only once every rank
    has started, in ``init_process_group``."""
    if backend is None or backend == "":
        return  # chosen from the device (an empty string, as from a configuration left blank, too)
    known = [b for b in dist.Backend.backend_list if b != dist.Backend.UNDEFINED]
    names = [part.split(":", 1)[-1].strip().lower() for part in backend.split(",")] if isinstance(backend, str) else []
    if not names or not all(names) or any(name not in known for name in names):
        raise ValueError(
            f"process_group_backend must be None or a torch.distributed backend ({', '.join(known)}; or one per"
            f" device, as 'cpu:gloo,cuda:nccl'), got {backend!r}: a third-party backend must be registered"
            " (torch.distributed.Backend.register_backend, usually by importing its package) before the strategy is made"
        )


class ProcessGroupStrategy(ParallelStrategy):
    """Processes and groups as under ``DDPStrategy``; the strategy's own collectives on :attr:`collective_group`.

    Args:
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin:
            Lightning's (the ``Trainer`` sets them; leave them out).
        timeout: bound on process-group set-up and on the strategy's own collectives
            (see :class:`~lightning_partial.strategies.partial.PartialStrategy`).
        process_group_backend: default ``"nccl"`` on CUDA, ``"gloo"`` otherwise.
        start_method: ``"popen"`` (scripts, torchrun, SLURM), ``"spawn"`` or ``"fork"``
            (Lightning's multiprocessing launcher; ``"fork"``: the ranks inherit the
            parent's imports, as ``"ddp_fork"``; CPU, or CUDA not yet initialised).

    Holds no group until ``setup``: it can be pickled (the spawn launcher does), and a
    forked rank inherits none.
    """

    def __init__(
        self,
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        *,
        timeout: timedelta = timedelta(minutes=30),
        process_group_backend: Optional[str] = None,
        start_method: Literal["popen", "spawn", "fork"] = "popen",
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        if start_method not in ("popen", "spawn", "fork"):
            raise ValueError(f"start_method must be 'popen', 'spawn' or 'fork', got {start_method!r}")
        check_timedelta("timeout", timeout)
        check_backend(process_group_backend)
        self._num_nodes = 1
        self._timeout = timeout
        self._process_group_backend = process_group_backend
        self._start_method = start_method
        # Made in setup_distributed, never in __init__: the strategy must stay picklable.
        self._collective_group: Any = None
        self._collective_group_ready = False


    # ------------------------------------------------------------ topology
    @property
    def is_distributed(self) -> bool:
        """Read by Lightning's accelerator connector: inject a ``DistributedSampler`` as under DDP."""
        return True

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._process_group_backend

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            self._launcher = _compat._SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _compat.StopAwareMultiProcessingLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.setup_distributed()

    def setup_distributed(self) -> None:
        _compat.reset_seed()
        self.set_world_ranks()
        self._process_group_backend = (
            self._process_group_backend or _compat._get_default_process_group_backend_for_device(self.root_device)
        )
        assert self.cluster_environment is not None
        _warn_if_restarts_share_the_rendezvous_store()
        _compat._init_dist_connection(self.cluster_environment, self._process_group_backend, timeout=self._timeout)
        self._make_collective_group()

    def _make_collective_group(self) -> None:
        """Every rank, main thread, once: the gloo group of the strategy's own collectives.

        ``None`` stands for the default group when it is gloo already; otherwise a new
        gloo group of all ranks (``dist.new_group``, collective over the default group).
        """
        if self._collective_group_ready or not _compat._distributed_is_initialized():
            return
        if dist.get_backend() != "gloo":
            self._collective_group = dist.new_group(backend="gloo", timeout=self._timeout)
        self._collective_group_ready = True

    @property
    def collective_group(self) -> Any:
        """The process group of the strategy's own collectives: gloo, all ranks (the module docstring's invariant).

        Pass it as ``process_group`` to anything that synchronises during fit
        (e.g. a torchmetrics ``Metric``), so that no NCCL collective on the default
        group runs beside the engines' rounds.
        """
        if not self._collective_group_ready:
            return None
        return self._collective_group if self._collective_group is not None else _compat._group.WORLD

    @staticmethod
    def _is_default(group: Any) -> bool:
        """Whether a caller's ``group`` means the default group (``LightningModule.all_gather`` passes ``WORLD``)."""
        return group is None or group is _compat._group.WORLD

    def _to_host(self, tensor: Tensor) -> Tensor:
        """``tensor`` as the collective group takes it: a host copy when the default group is not gloo."""
        if self._collective_group is None or not tensor.is_cuda:
            return tensor
        return tensor.detach().cpu()

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank


    # ---------------------------------------------------------- collectives
    # Every collective below runs on collective_group (gloo), never on a NCCL default
    # group: see the module docstring's invariant.
    def _last_round(self) -> Optional[int]:
        """The last round this rank applied (``None``: none yet in this process), named by a failed collective."""
        return None

    def _naming_failure(self, what: str) -> contextlib.AbstractContextManager[None]:
        """Around one of the strategy's collectives: a failure raised as ``PartialCollectiveError`` naming this
        rank, ``what`` and the last round (gloo's own error names only the peer's address)."""
        return naming_failure(what, rank=self.global_rank, round_index=self._last_round(), last=True)

    def _before_collective(self, what: str) -> None:
        """Main thread, before each of the strategy's own collectives (``barrier``, ``broadcast``, ``reduce``,
        ``all_gather``), naming it: a subclass refuses one that could not pair on every rank. Nothing here."""

    @override
    def barrier(self, name: Optional[str] = None, *args: Any, **kwargs: Any) -> None:
        if not _compat._distributed_is_initialized():
            return
        self._before_collective("a barrier")
        with self._naming_failure("the strategy's barrier" + (f" {name!r}" if name else "")):
            dist.barrier(group=self.collective_group)

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not _compat._distributed_is_initialized():
            return obj
        self._before_collective("a broadcast")
        box = [obj]
        with self._naming_failure(f"the strategy's broadcast from rank {src}"):
            dist.broadcast_object_list(box, src, group=self.collective_group)
        return box[0]

    @override
    def reduce(
        self, tensor: Tensor, group: Optional[Any] = None, reduce_op: Optional[Union[ReduceOp, str]] = "mean"
    ) -> Tensor:
        if not isinstance(tensor, Tensor):
            return tensor
        if _compat._distributed_is_initialized():
            self._before_collective("a reduce (as self.log(..., sync_dist=True) issues)")

        def sync(t: Tensor, on: Optional[Any]) -> Tensor:
            with self._naming_failure(f"the strategy's reduce ({reduce_op})"):
                return _compat._sync_ddp_if_available(t, on, reduce_op=reduce_op)

        if not self._is_default(group) or not _compat._distributed_is_initialized():
            return sync(tensor, group)
        host = self._to_host(tensor)
        if host is tensor:
            return sync(tensor, self.collective_group)
        if host.dtype in (torch.float16, torch.bfloat16):
            host = host.float()  # what every gloo build reduces
        out = sync(host, self.collective_group)
        with torch.no_grad():
            tensor.copy_(out)  # in place, as DDPStrategy's reduce leaves it
        return tensor

    @override
    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        def gather(t: Tensor, on: Optional[Any]) -> Tensor:
            with self._naming_failure("the strategy's all_gather"):
                return _compat._all_gather_ddp_if_available(t, group=on, sync_grads=sync_grads)

        if _compat._distributed_is_initialized():
            self._before_collective("an all_gather")
        if not self._is_default(group):
            return gather(tensor, group)
        host = tensor.cpu() if self._collective_group is not None and tensor.is_cuda else tensor  # keeps autograd
        return gather(host, self.collective_group).to(tensor.device)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def __getstate__(self) -> dict[str, Any]:
        # A process group cannot be pickled (the spawn launcher pickles the strategy).
        state = super().__getstate__()
        state["_collective_group"], state["_collective_group_ready"] = None, False
        return state
