"""Lightning benchmark: eager-SGD against DDP, post-local SGD and a no-communication bound under load imbalance.

One invocation runs, on 4 CPU ranks (``Trainer(accelerator="cpu", devices=4)``,
Lightning's popen launcher, gloo over loopback), every configuration below on
the same task, from the same seed, for the same number of steps and samples
per rank:

=================================  ==========================================================  =========
configuration                      strategy                                                    imbalance
=================================  ==========================================================  =========
``ddp_balanced``                   ``strategy="ddp"``                                          no
``eager_sgd_balanced``             ``strategy="eager_sgd"`` (solo, max_staleness=2)            no
``ddp_imbalanced``                 ``strategy="ddp"``                                          yes
``post_local_sgd_imbalanced``      post-local SGD (``baselines.PostLocalSGDStrategy``)         yes
``eager_sgd_imbalanced``           ``strategy="eager_sgd"`` (solo, max_staleness=2)            yes
``eager_sgd_majority_imbalanced``  ``strategy="eager_sgd_majority"``                           yes
``eager_sgd_unbounded_imbalanced`` ``EagerSGDStrategy(max_staleness=None)``                    yes
``eager_sgd_contrib_imbalanced``   ``EagerSGDStrategy(normalize="contributors")``              yes
``eager_sgd_s1_imbalanced``        ``EagerSGDStrategy(max_staleness=1)``                       yes
``wagma_sgd_imbalanced``           ``strategy="wagma_sgd"`` (S=2, tau=10)                      yes
``ds_sync_imbalanced``             ``strategy="ds_sync"`` (G=2, max_staleness=4)               yes
``no_comm_imbalanced``             every rank alone (``baselines.NoCommStrategy``): the bound  yes
=================================  ==========================================================  =========

The staleness-rule study (``docs/staleness.md``) adds configurations that run
only when ``--only`` names them: ``eager_sgd_rule_none_imbalanced`` (the
paper's ``staleness_rule="none"`` at the default bound),
``eager_sgd_unbounded_none_imbalanced`` (the paper's solo: unbounded, rule
``none``), ``eager_sgd_inverse_imbalanced``, ``eager_sgd_unbounded_inverse_imbalanced``,
``eager_sgd_s4_inverse_imbalanced``, ``eager_sgd_s6_inverse_imbalanced``,
``eager_sgd_momentum_imbalanced``, ``eager_sgd_unbounded_momentum_imbalanced``,
``eager_sgd_s4_momentum_imbalanced`` (rule ``"momentum"``),
``eager_sgd_unbounded_drop_imbalanced`` (fresh-only rounds) and
``eager_sgd_backup_imbalanced`` (``strategy="eager_sgd_backup"``: a round waits
for 3 of the 4 ranks). The strategy's
default rule is ``"auto"``: ``"inverse"`` under momentum. ``--optimizer adamw``
trains every configuration with AdamW (``betas=(--momentum, 0.999)``) instead of SGD.

**Task.** 10-class classification of ``x ~ N(0, I_32)`` labelled by a fixed
random teacher MLP (32-64-10, tanh; ~78% is reachable in a few hundred
steps); 131,072 training and 8,192 held-out samples, generated from the seed
on every rank. The student is an MLP 32-512-512-512-10 (ReLU, no buffers,
0.55 M parameters: a 2.1 MB gradient), trained with SGD (lr 0.05, momentum
0.9; DDP reaches the same accuracy with lr 0.1, but a one-step-stale gradient
costs several points more there) and a cosine learning-rate decay to 0 over
the ``--steps`` (``--schedule constant`` keeps lr fixed: then the fit ends
mid-descent and the comparison of accuracies measures how far each strategy
got, where stale gradients under momentum 0.9 cost unbounded solo
eager-SGD 6-18 points); per-rank batch ``--batch-size`` (384: about 20-25 ms of
single-thread forward + backward + step on this machine).

**Imbalance.** ``lightning_partial.callbacks.LoadImbalance``: at every batch,
1 of the 4 ranks, drawn with a shared seed (identical on every rank), sleeps
``D`` before its forward pass. ``D = 2 x`` the mean per-step compute time of a
rank *as it runs in these fits*: 4 ranks share 2 cores here, so a rank's step
takes at least twice its single-process time. The parent calibrates it by
running the model's forward + backward + SGD step (``torch.set_num_threads(N)``, ``--threads``)
in 4 concurrent processes (median of 5 short rounds; the single-process figure
is reported beside it); ``--delay-ms`` overrides it. A sleeping rank frees CPU
for the other three, so on this machine the fast ranks compute faster while a
straggler sleeps; that is a property of the shared CPU, not of the algorithms,
and it affects every imbalanced configuration alike.

**Threads.** ``--threads N`` (default 1) gives every rank, and each
calibration process (which models the ranks as they run), ``N`` intra-op
threads (``OMP_NUM_THREADS``, ``MKL_NUM_THREADS``, ``torch.set_num_threads``).
With 1 thread per rank and fewer cores than ranks (4 ranks on 2 cores here),
gloo's CPU per collective comes out of the ranks' compute; on a machine with
at least ``4 x N`` cores plus a few for the communication threads (e.g. 16
cores, ``--threads 3``) it no longer does. The injected imbalance is a fixed
sleep of ``D`` (``LoadImbalance(delay_ms=...)``), whatever the thread count:
the callback measures compute only for ``speed`` factors, which are not used
here. ``threads`` is recorded in the JSON (``settings`` and ``environment``).

**Measurements** (per rank, then summarised): the wall time of the training
steps, from the rank's first ``on_train_batch_start`` (before the injected
delay) to the end of the strategy's ``on_train_end`` (after eager-SGD's final
flush and post-local SGD's final average), so Lightning's start-up is
excluded; steps per second (mean over ranks and rank 0's); total samples per
second (sum over ranks); ratios to DDP under the same balance condition and to
the no-communication bound; the training loss (rank 0's last 20 batches, and
rank 0's final model on 8,192 training samples) and held-out accuracy of rank
0's final model, evaluated after the fit. Two checks per fit:

* a parameter digest (float64 sum) after each of the first ``--digest-steps``
  optimizer steps, compared across ranks: the replicas must be identical after
  every step under DDP and eager-SGD; under post-local SGD after the warm-up
  steps and right after every averaging step only; under WAGMA-SGD after every
  10th step (its global average); under DS-Sync (no periodic global average)
  and the bound never;
* the calls into ``torch.distributed`` collectives on the default group, per
  step (Python-level: Lightning's per-batch broadcast, DDP comm hooks, the
  model averager; DDP's C++ gradient allreduce without a hook is not seen).

For eager-SGD, the engine's per-round statistics (fresh gradients,
contributions, staleness, time blocked in ``arrive``) are summarised too.
Also per fit: the CPU time of every rank's process (all its threads) per
sample, over the same interval, and the share of the machine's CPU time the
hypervisor stole meanwhile (``/proc/stat``). With 4 ranks on 2 cores the fits
are CPU-bound, so a strategy's throughput relative to the bound is roughly
at most the bound's CPU per sample over the strategy's (roughly: CPU time per
sample itself varies with contention). This machine is a VM whose
host is shared: a fit during which more than ``--max-steal`` (5%) of the CPU
was stolen runs again, up to ``--steal-retries`` (2) more times.

**Baselines** (see ``benchmarks/baselines.py``): post-local SGD is Lightning's
``DDPStrategy`` with ``PostLocalSGDState`` / ``post_localSGD_hook`` and
``model_averaging_period=4`` (Lightning's ``PeriodicModelAverager`` path), with
the hook registered on CPU too (Lightning registers it only on CUDA), each rank
alone in its post-warm-up subgroup, ``--localsgd-warmup`` steps of plain DDP
first, and one last average at the end of the fit. The bound is DDP with a
no-op comm hook and no averaging. Post-local SGD and the bound have
Lightning's per-batch SIGTERM broadcast (a ``dist.broadcast`` from rank 0 at
every batch: a global synchronisation per step) replaced by a local check, as
eager-SGD has; plain DDP keeps it (it synchronises every step anyway).

Each configuration is one 4-process Lightning fit, run as a subprocess of this
file in worker mode (``--run CONFIG``; Lightning re-runs that command line for
ranks 1-3), in its own process group, killed as a whole on ``--timeout``.

Usage::

    python benchmarks/imbalance.py                                  # every configuration (~10-12 min)
    python benchmarks/imbalance.py --steps 40 --only ddp_balanced,eager_sgd_balanced
    python benchmarks/imbalance.py --repeats 3                      # medians [min-max] of 3 runs
    python benchmarks/imbalance.py --threads 3 --out benchmarks/results/imbalance_16core.json  # 16 cores

The package need not be installed: the fits' processes get the repository's
root on ``PYTHONPATH``.

Writes ``benchmarks/results/imbalance.json`` (every figure, per rank and per
run, plus the environment) and ``benchmarks/results/imbalance.png``. The figures
are only meaningful on an otherwise idle machine: the load average at the
start is recorded in the JSON.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import inspect
import json
import logging
import math
import multiprocessing as mp
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

import torch

# Only the standard library and torch at module level: the calibration processes
# (spawned) and the parent import this file, and importing Lightning costs ~8 s a
# process on this machine. The worker mode imports Lightning itself.

log = logging.getLogger("benchmarks.imbalance")

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
WORLD = 4
IN_DIM, CLASSES = 32, 10
TEACHER_HIDDEN = 64
TRAIN_SAMPLES, TEST_SAMPLES, TRAIN_EVAL_SAMPLES = 131_072, 8_192, 8_192
LAST_LOSSES = 20  # training loss reported as the mean of rank 0's last batches
# Environment variables that would make a worker believe it is a rank started by
# someone else (Lightning reads them to find its cluster environment).
_RANK_VARIABLES = (
    "LOCAL_RANK", "NODE_RANK", "GLOBAL_RANK", "WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RUN_ID", "GROUP_RANK", "LOCAL_WORLD_SIZE",
)


@dataclass(frozen=True)
class Config:
    """One benchmark configuration: which strategy, with or without injected imbalance."""

    name: str
    strategy: str  # "ddp", "eager_sgd", "eager_sgd_majority", "eager_sgd_backup", "post_local_sgd" or "no_comm"
    imbalanced: bool
    label: str
    # Keyword arguments of a configured strategy object (``EagerSGDStrategy(**options)``);
    # empty: the registry name ``strategy`` as a user would write it.
    options: tuple[tuple[str, Any], ...] = ()
    # Run without --only; the staleness-rule study's configurations run only when named.
    default: bool = True


def _study(name: str, *options: tuple[str, Any], note: str = "") -> Config:
    """A configuration of the staleness-rule study: ``EagerSGDStrategy(**options)`` under imbalance, run only
    when ``--only`` names it, labelled by its options."""
    label = "eager-SGD solo, " + ", ".join(f"{key}={value}" for key, value in options) + note
    return Config(name, "eager_sgd", True, label, tuple(options), default=False)


CONFIGS: dict[str, Config] = {
    c.name: c
    for c in (
        Config("ddp_balanced", "ddp", False, "DDP"),
        Config("eager_sgd_balanced", "eager_sgd", False, "eager-SGD solo"),
        Config("ddp_imbalanced", "ddp", True, "DDP"),
        Config("post_local_sgd_imbalanced", "post_local_sgd", True, "post-local SGD"),
        Config("eager_sgd_imbalanced", "eager_sgd", True, "eager-SGD solo"),
        Config("eager_sgd_majority_imbalanced", "eager_sgd_majority", True, "eager-SGD majority"),
        # The strategy's default bounds staleness at 2 rounds; the paper's unbounded solo for contrast.
        Config(
            "eager_sgd_unbounded_imbalanced", "eager_sgd", True, "eager-SGD solo, max_staleness=None",
            (("max_staleness", None),),
        ),
        Config(
            "eager_sgd_contrib_imbalanced", "eager_sgd", True, "eager-SGD solo, normalize=contributors",
            (("normalize", "contributors"),),
        ),
        Config("eager_sgd_s1_imbalanced", "eager_sgd", True, "eager-SGD solo, max_staleness=1", (("max_staleness", 1),)),
        # The staleness-rule study (run when --only names them): the default rule ("auto": "inverse"
        # under momentum) against the paper's "none", at other bounds, and fresh-only rounds.
        _study("eager_sgd_rule_none_imbalanced", ("staleness_rule", "none")),
        _study("eager_sgd_unbounded_none_imbalanced", ("max_staleness", None), ("staleness_rule", "none"),
               note=" (the paper's)"),
        _study("eager_sgd_momentum_imbalanced", ("staleness_rule", "momentum")),
        _study("eager_sgd_unbounded_momentum_imbalanced", ("max_staleness", None), ("staleness_rule", "momentum")),
        _study("eager_sgd_s4_momentum_imbalanced", ("max_staleness", 4), ("staleness_rule", "momentum")),
        _study("eager_sgd_unbounded_inverse_imbalanced", ("max_staleness", None), ("staleness_rule", "inverse")),
        _study("eager_sgd_inverse_imbalanced", ("staleness_rule", "inverse")),
        _study("eager_sgd_s4_inverse_imbalanced", ("max_staleness", 4), ("staleness_rule", "inverse")),
        _study("eager_sgd_s6_inverse_imbalanced", ("max_staleness", 6), ("staleness_rule", "inverse")),
        # Fresh-only rounds: a late gradient is dropped (and counted), the sum divided by the contributors.
        _study(
            "eager_sgd_unbounded_drop_imbalanced",
            ("max_staleness", None), ("late", "drop"), ("normalize", "contributors"), ("staleness_rule", "none"),
        ),
        # One backup worker: a round waits for P - 1 arrivals, the last rank's gradient is carried.
        Config("eager_sgd_backup_imbalanced", "eager_sgd_backup", True, "eager-SGD, 1 backup worker", default=False),
        Config("wagma_sgd_imbalanced", "wagma_sgd", True, "WAGMA-SGD (S=2, tau=10)"),
        Config("ds_sync_imbalanced", "ds_sync", True, "DS-Sync (G=2, max_staleness=4)"),
        Config("no_comm_imbalanced", "no_comm", True, "no communication (bound)"),
    )
}


# ---------------------------------------------------------------------- task and model
def make_task(seed: int) -> dict[str, torch.Tensor]:
    """The synthetic task: inputs and a fixed random teacher's labels (identical on every rank)."""
    g = torch.Generator().manual_seed(seed + 1234)
    w1 = torch.randn(IN_DIM, TEACHER_HIDDEN, generator=g) / math.sqrt(IN_DIM)
    w2 = torch.randn(TEACHER_HIDDEN, CLASSES, generator=g) / math.sqrt(TEACHER_HIDDEN)

    def teacher(x: torch.Tensor) -> torch.Tensor:
        return (torch.tanh(x @ w1) @ w2).argmax(dim=1)

    x_train = torch.randn(TRAIN_SAMPLES, IN_DIM, generator=g)
    x_test = torch.randn(TEST_SAMPLES, IN_DIM, generator=g)
    return {"x_train": x_train, "y_train": teacher(x_train), "x_test": x_test, "y_test": teacher(x_test)}


def cosine_factor(step: int, *, steps: int) -> float:
    """The learning-rate factor at optimizer step ``step`` of ``steps``: cosine from 1 to 0."""
    return 0.5 * (1.0 + math.cos(math.pi * min(step, steps) / steps))


def build_mlp(width: int, depth: int) -> torch.nn.Sequential:
    """The student: ``depth`` hidden ReLU layers of ``width``; no buffers (DDP would broadcast them per step)."""
    layers: list[torch.nn.Module] = []
    fan_in = IN_DIM
    for _ in range(depth):
        layers += [torch.nn.Linear(fan_in, width), torch.nn.ReLU()]
        fan_in = width
    layers.append(torch.nn.Linear(fan_in, CLASSES))
    return torch.nn.Sequential(*layers)


class BatchDataset(torch.utils.data.Dataset):
    """Tensor dataset that indexes a whole batch at once (``__getitems__``).

    The default per-sample fetch and collate would cost a few ms per batch of
    Python, in every configuration alike, diluting the differences measured.
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]

    def __getitems__(self, indices: list[int]) -> list[torch.Tensor]:
        idx = torch.as_tensor(indices)
        return [self.x[idx], self.y[idx]]


def batch_collate(batch: list[torch.Tensor]) -> list[torch.Tensor]:
    """``collate_fn`` for :class:`BatchDataset`: the batch is already stacked."""
    return batch


@torch.no_grad()
def evaluate(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """Mean cross-entropy and accuracy of ``net`` on ``(x, y)``."""
    net.eval()
    loss_sum, correct = 0.0, 0
    for start in range(0, len(x), 2048):
        logits = net(x[start : start + 2048])
        target = y[start : start + 2048]
        loss_sum += torch.nn.functional.cross_entropy(logits, target, reduction="sum").item()
        correct += int((logits.argmax(dim=1) == target).sum())
    net.train()
    return loss_sum / len(x), correct / len(x)


def cpu_ticks() -> tuple[int, int] | None:
    """Machine-wide (steal, total) CPU ticks from ``/proc/stat``; ``None`` where there is none.

    Steal is time the hypervisor gave this VM's virtual CPUs to someone else: a
    fit that loses much of it measures the host, not the strategy.
    """
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (fields[7] if len(fields) > 7 else 0), sum(fields[:8])


def steal_between(start: tuple[int, int] | None, end: tuple[int, int] | None) -> float | None:
    """The share of the machine's CPU stolen between two :func:`cpu_ticks` readings (``None`` if unknown)."""
    if not start or not end:
        return None
    return (end[0] - start[0]) / max(end[1] - start[1], 1)


def add_steal_arguments(parser: argparse.ArgumentParser) -> None:
    """``--max-steal`` and ``--steal-retries``, read by :func:`retry_while_stolen`."""
    parser.add_argument("--max-steal", type=float, default=0.05,
                        help="a fit during which the host stole more than this share of the CPU is run again")
    parser.add_argument("--steal-retries", type=int, default=2, help="at most this many times (then kept, flagged)")


def retry_while_stolen(fit: Callable[[int], dict | None], args: argparse.Namespace, label: str) -> dict | None:
    """``fit(attempt)`` again while the hypervisor stole more than ``args.max_steal`` of the CPU during it.

    A fit that lost much of the CPU to other tenants of the host measures the
    host. At most ``args.steal_retries`` more attempts; the last one is kept
    whatever its steal (the JSON keeps the stolen share and ``attempts``).
    ``fit`` returns a run with ``steal_fraction`` (``None`` or NaN: unknown,
    kept), or ``None`` for a failed fit (not retried).
    """
    for attempt in range(args.steal_retries + 1):
        run = fit(attempt)
        if run is None:
            return None
        steal = run["steal_fraction"]
        if steal is None or not steal > args.max_steal or attempt == args.steal_retries:
            run["attempts"] = attempt + 1
            return run
        log.warning("%s: the hypervisor stole %.0f%% of the CPU during the fit: running it again", label, steal * 100)
    raise AssertionError("unreachable: the last attempt is always kept")


def parameter_digest(params: list[torch.nn.Parameter]) -> float:
    """float64 sum of every parameter: equal on bit-identical replicas, different otherwise (almost surely)."""
    with torch.no_grad():
        return float(sum(p.detach().double().sum() for p in params))


# ---------------------------------------------------------------------- calibration
def set_threads(threads: int) -> None:
    """``threads`` intra-op threads in this process (and in the processes it starts, through the environment)."""
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


def thread_environment(threads: int) -> dict[str, str]:
    """Environment of a fit's processes: ``threads`` intra-op threads, and the repository's root importable.

    The root on ``PYTHONPATH``: a plain checkout where ``lightning_partial`` is
    not installed works too (a script's own folder, not the working directory,
    is what Python puts on ``sys.path``); Lightning's launcher hands the
    environment on to ranks 1-3.
    """
    path = os.environ.get("PYTHONPATH", "")
    return {
        "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
        "PYTHONPATH": str(REPO) + (os.pathsep + path if path else ""),
    }


def _calibration_process(
    batch_size: int, width: int, depth: int, steps: int, rounds: int, barrier: Any, queue: Any, threads: int = 1
) -> None:
    """One calibration process: mean wall time of forward + backward + SGD step, ``threads`` threads, per round."""
    set_threads(threads)
    torch.manual_seed(0)
    net = build_mlp(width, depth)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch_size, IN_DIM)
    y = torch.randint(0, CLASSES, (batch_size,))

    def step() -> None:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        optimizer.step()

    for _ in range(5):  # warm-up: allocator, first-touch page faults
        step()
    means = []
    for _ in range(rounds):
        barrier.wait()  # concurrent processes time the same interval of machine time
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        means.append((time.perf_counter() - t0) / steps)
    queue.put(means)


def calibrate(
    batch_size: int, width: int, depth: int, steps: int = 15, rounds: int = 5, timeout: float = 120.0,
    threads: int = 1,
) -> dict[str, Any]:
    """Per-step compute time, alone and with ``WORLD`` processes competing for the cores as the ranks do.

    Each figure is the median over ``rounds`` short rounds (mean over the
    processes within a round): on a shared machine one burst of someone
    else's load would otherwise set ``D`` for the whole benchmark.
    """
    ctx = mp.get_context("spawn")
    result: dict[str, Any] = {}
    for procs, key in ((1, "single_process"), (WORLD, "concurrent")):
        barrier, queue = ctx.Barrier(procs), ctx.Queue()
        workers = [
            ctx.Process(
                target=_calibration_process,
                args=(batch_size, width, depth, steps, rounds, barrier, queue, threads),
                daemon=True,
            )
            for _ in range(procs)
        ]
        for w in workers:
            w.start()
        try:
            per_process = [queue.get(timeout=timeout) for _ in workers]
        finally:
            for w in workers:
                w.join(timeout=10)
                if w.is_alive():
                    w.kill()
        per_round = [statistics.fmean(p[i] for p in per_process) * 1e3 for i in range(rounds)]
        result[f"{key}_ms"] = statistics.median(per_round)
        result[f"{key}_rounds_ms"] = [round(x, 2) for x in per_round]
    result["concurrent_processes"] = WORLD
    result["threads_per_process"] = threads
    result["cores"] = os.cpu_count() or 0
    return result


# ---------------------------------------------------------------------- worker (one 4-process fit)
class CollectiveCounter:
    """Counts Python-level calls into ``torch.distributed`` collectives on the default group while active.

    Sees Lightning's per-batch SIGTERM broadcast, DDP comm hooks' and the model
    averager's allreduces (issued from Python); does not see the allreduces of
    DDP's C++ reducer without a hook, nor the eager-SGD engine's collectives,
    which run on the engine's own groups by design.
    """

    NAMES = (
        "all_reduce", "broadcast", "barrier", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
        "gather", "scatter", "reduce", "all_gather_object", "broadcast_object_list", "gather_object", "all_to_all",
        "monitored_barrier",
    )

    def __init__(self) -> None:
        self.active = False
        self.calls: dict[str, int] = {}

    def install(self) -> None:
        """Wraps the module-level functions (callers that look them up as ``dist.<name>`` are seen)."""
        import torch.distributed as dist

        for name in self.NAMES:
            fn = getattr(dist, name, None)
            if fn is not None:
                setattr(dist, name, self._wrap(name, fn))

    def _wrap(self, name: str, fn: Any) -> Any:
        import torch.distributed as dist

        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self.active:
                try:  # the group may be passed positionally
                    group = signature.bind_partial(*args, **kwargs).arguments.get("group")
                except TypeError:
                    group = kwargs.get("group")
                if group is None or group is dist.group.WORLD:
                    self.calls[name] = self.calls.get(name, 0) + 1
            return fn(*args, **kwargs)

        return wrapper


def _lightning_parts() -> tuple[type, type]:
    """The LightningModule and the recording callback (defined here: Lightning is imported in workers only)."""
    import lightning as L

    class TeacherClassifier(L.LightningModule):
        """The student MLP; records its training loss per batch (CPU: ``item()`` costs no device sync)."""

        def __init__(
            self, width: int, depth: int, lr: float, momentum: float, schedule: str, steps: int, optimizer: str = "sgd"
        ) -> None:
            super().__init__()
            self.net = build_mlp(width, depth)
            self.lr, self.momentum, self.optimizer_name = lr, momentum, optimizer
            self.schedule, self.steps = schedule, steps
            self.losses: list[float] = []

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = torch.nn.functional.cross_entropy(self.net(x), y)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self) -> Any:
            if self.optimizer_name == "adamw":
                # beta1 = --momentum: the coefficient the staleness rule reads.
                optimizer: torch.optim.Optimizer = torch.optim.AdamW(
                    self.parameters(), lr=self.lr, betas=(self.momentum, 0.999), weight_decay=0.01
                )
            else:
                optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)
            if self.schedule == "constant":
                return optimizer
            # Cosine decay to 0 over the fit, stepped per optimizer step: the same on every rank
            # (every strategy here steps once per batch on every rank).
            cosine = torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(cosine_factor, steps=self.steps))
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": cosine, "interval": "step"}}

    class StepRecorder(L.Callback):
        """Per-rank timings: the first batch start, each batch end, the end of the strategy's ``on_train_end``.

        Must come before the imbalance callback in ``callbacks`` so that the
        first injected delay falls inside the measured interval.
        """

        def __init__(self, digest_steps: int, counter: CollectiveCounter) -> None:
            self.digest_steps = digest_steps
            self.counter = counter
            # eager-SGD, per round: (fresh, contributions, max staleness, this rank's wait in arrive (s))
            self.rounds: list[tuple[int, int, int, float]] = []
            self.t_start: float | None = None
            self.t_end: float | None = None
            # CPU seconds of the whole process (compute, communication and gloo threads) over the same interval.
            self.cpu_start: float | None = None
            self.cpu_end: float | None = None
            self.ticks_start: tuple[int, int] | None = None
            self.ticks_end: tuple[int, int] | None = None
            self.step_ends: list[float] = []
            self.collectives_at_batch_end: list[int] = []  # cumulative default-group calls (CollectiveCounter)
            self.digests: list[float] = []

        def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
            if self.t_start is None:
                self.t_start = time.perf_counter()
                self.cpu_start = time.process_time()
                self.ticks_start = cpu_ticks()
                self.counter.active = True

        def on_train_batch_end(
            self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
        ) -> None:
            # After the optimizer step (and post-local SGD's averaging) of this batch.
            self.step_ends.append(time.perf_counter())
            self.collectives_at_batch_end.append(sum(self.counter.calls.values()))
            stats = getattr(trainer.strategy, "round_stats", {}).get(0)
            if stats is not None:
                self.rounds.append((len(stats.fresh), stats.contributions, stats.max_staleness, stats.wait_time))
            if len(self.step_ends) <= self.digest_steps:
                self.digests.append(parameter_digest(list(pl_module.parameters())))

        def wrap_strategy_end(self, strategy: Any) -> None:
            """Stamps the end after the strategy's own ``on_train_end`` (eager-SGD's flush, a final average)."""
            inner = strategy.on_train_end

            def on_train_end() -> None:
                inner()
                self.t_end = time.perf_counter()
                self.cpu_end = time.process_time()
                self.ticks_end = cpu_ticks()
                self.counter.active = False

            strategy.on_train_end = on_train_end

    return TeacherClassifier, StepRecorder


def _make_strategy(config: Config, args: argparse.Namespace) -> Any:
    """The strategy object (or registry name) of ``config``."""
    if config.options:
        import lightning_partial

        if config.strategy == "wagma_sgd":
            return lightning_partial.WAGMAStrategy(**dict(config.options))
        if config.strategy == "ds_sync":
            return lightning_partial.DSSyncStrategy(**dict(config.options))
        mode = "majority" if config.strategy == "eager_sgd_majority" else "solo"
        return lightning_partial.EagerSGDStrategy(**{"mode": mode, **dict(config.options)})
    if config.strategy in ("ddp", "eager_sgd", "eager_sgd_majority", "eager_sgd_backup", "wagma_sgd", "ds_sync"):
        return config.strategy  # registry names, as a user would write them (gloo on CPU)
    from baselines import NoCommStrategy, PostLocalSGDStrategy

    if config.strategy == "post_local_sgd":
        return PostLocalSGDStrategy(
            start_localSGD_iter=args.localsgd_warmup, model_averaging_period=args.averaging_period
        )
    if config.strategy == "no_comm":
        return NoCommStrategy()
    raise ValueError(f"unknown strategy {config.strategy!r}")


def run_worker(args: argparse.Namespace) -> int:
    """Worker mode (``--run CONFIG``): one rank of one 4-process fit; writes ``<workdir>/<tag>.rank<R>.json``."""
    t_process = time.perf_counter()
    set_threads(args.threads)
    sys.path.insert(0, str(HERE))  # baselines.py, also when this file runs as a module
    if str(REPO) not in sys.path:  # lightning_partial from a checkout (the parent also sets PYTHONPATH)
        sys.path.append(str(REPO))
    import lightning as L
    from lightning.pytorch.plugins.environments import LightningEnvironment

    import lightning_partial  # noqa: F401 - registers "eager_sgd" and "eager_sgd_majority"
    from lightning_partial.callbacks import LoadImbalance

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    config = CONFIGS[args.run]
    TeacherClassifier, StepRecorder = _lightning_parts()
    L.seed_everything(args.seed, verbose=False)
    task = make_task(args.seed)
    loader = torch.utils.data.DataLoader(
        BatchDataset(task["x_train"], task["y_train"]),
        batch_size=args.batch_size,
        shuffle=True,  # Lightning swaps in a DistributedSampler (seeded by the global seed: same order in every run)
        drop_last=True,
        collate_fn=batch_collate,
    )
    model = TeacherClassifier(args.width, args.depth, args.lr, args.momentum, args.schedule, args.steps, args.optimizer)
    counter = CollectiveCounter()
    counter.install()
    recorder = StepRecorder(args.digest_steps, counter)
    callbacks: list[Any] = [recorder]
    imbalance = None
    if config.imbalanced:
        # log=False: a per-step self.log costs every imbalanced configuration alike and nothing reads it here.
        imbalance = LoadImbalance(delay_ms=args.delay_ms, stragglers=1, seed=args.seed, log=False)
        callbacks.append(imbalance)
    trainer = L.Trainer(
        strategy=_make_strategy(config, args),
        accelerator="cpu",
        devices=WORLD,
        # Explicit: a SLURM or torchelastic environment around the benchmark must not
        # change how the 4 local ranks are started.
        plugins=[LightningEnvironment()],
        max_steps=args.steps,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    recorder.wrap_strategy_end(trainer.strategy)
    trainer.fit(model, loader)
    rank = trainer.global_rank
    if recorder.t_start is None or recorder.t_end is None:
        raise RuntimeError(f"rank {rank}: the fit recorded no training interval")

    test_loss, test_acc = evaluate(model.net, task["x_test"], task["y_test"])
    train_loss, train_acc = evaluate(model.net, task["x_train"][:TRAIN_EVAL_SAMPLES], task["y_train"][:TRAIN_EVAL_SAMPLES])
    steps = len(model.losses)
    record = {
        "config": config.name,
        "rank": rank,
        "steps": steps,
        "samples": steps * args.batch_size,
        "wall_s": recorder.t_end - recorder.t_start,
        "cpu_s": recorder.cpu_end - recorder.cpu_start,  # type: ignore[operator]
        "steal_fraction": steal_between(recorder.ticks_start, recorder.ticks_end),
        "startup_s": recorder.t_start - t_process,
        "t_start": recorder.t_start,  # time.perf_counter: CLOCK_MONOTONIC, comparable across processes
        "t_end": recorder.t_end,
        "step_ends_s": [round(t - recorder.t_start, 5) for t in recorder.step_ends],
        "losses": [round(x, 5) for x in model.losses],
        "digests": recorder.digests,
        "delayed_steps": sum(1 for r in imbalance.records if r.delay_ms > 0) if imbalance is not None else 0,
        "injected_s": imbalance.injected_ms / 1e3 if imbalance is not None else 0.0,
        "test_loss": test_loss,
        "test_acc": test_acc,
        "train_eval_loss": train_loss,
        "train_eval_acc": train_acc,
        "strategy_class": type(trainer.strategy).__name__,
        "torch_threads": torch.get_num_threads(),  # as the fit ran: --threads
        "default_group_collectives": dict(counter.calls),
        "collectives_at_batch_end": recorder.collectives_at_batch_end,
        "collectives_total": sum(counter.calls.values()),
        "rounds": recorder.rounds,
    }
    path = args.workdir / f"{args.tag}.rank{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    tmp.replace(path)  # atomic: the parent never reads half a file
    return 0


# ---------------------------------------------------------------------- parent: orchestration
def _live_group_members(pgid: int) -> list[int]:
    """PIDs of the process group that are still running (zombies excluded)."""
    members = []
    try:
        entries = os.listdir("/proc")
    except OSError:  # no /proc: ask the kernel whether the group has any member at all
        try:
            os.killpg(pgid, 0)
            return [pgid]
        except ProcessLookupError:
            return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": state ppid pgrp ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry))
    return members


def _kill_group(pgid: int) -> None:
    """SIGKILL the whole process group of a fit (rank 0 and the ranks Lightning started)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_fit(config: Config, tag: str, args: argparse.Namespace, delay_ms: float) -> list[dict] | None:
    """Runs one configuration as a 4-process fit in its own process group; returns the 4 rank records."""
    cmd = [
        sys.executable, str(Path(__file__).resolve()), "--run", config.name, "--tag", tag,
        "--workdir", str(args.workdir), "--steps", str(args.steps), "--batch-size", str(args.batch_size),
        "--delay-ms", repr(delay_ms), "--seed", str(args.seed), "--width", str(args.width),
        "--depth", str(args.depth), "--lr", repr(args.lr), "--momentum", repr(args.momentum),
        "--schedule", args.schedule, "--optimizer", args.optimizer,
        "--localsgd-warmup", str(args.localsgd_warmup), "--averaging-period", str(args.averaging_period),
        "--digest-steps", str(args.digest_steps), "--threads", str(args.threads),
    ]
    env = {k: v for k, v in os.environ.items() if k not in _RANK_VARIABLES}
    env.update(thread_environment(args.threads), PYTHONUNBUFFERED="1")
    log_path = args.workdir / f"{tag}.log"
    paths = [args.workdir / f"{tag}.rank{r}.json" for r in range(WORLD)]
    for stale in paths:  # a reused --workdir must not hand back an earlier run's records
        stale.unlink(missing_ok=True)
    t0 = time.monotonic()
    with open(log_path, "w") as log_file:
        # A new session: the fit's ranks (rank 0 and the 3 processes Lightning starts)
        # form one process group that a time-out kills at once.
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=args.timeout)
            # Rank 0 may exit before ranks 1-3 finish writing: wait for them (bounded).
            while rc == 0 and not all(p.exists() for p in paths) and _live_group_members(proc.pid):
                if time.monotonic() - t0 > args.timeout:
                    raise subprocess.TimeoutExpired(cmd, args.timeout)
                time.sleep(0.2)
        except subprocess.TimeoutExpired:
            log.error("%s: no result after %.0f s: killing its process group", tag, args.timeout)
            rc = None
        finally:
            _kill_group(proc.pid)  # leftovers (also on KeyboardInterrupt): nothing outlives its fit
            proc.wait()
    elapsed = time.monotonic() - t0
    if rc != 0 or not all(p.exists() for p in paths):
        tail = log_path.read_text(errors="replace").splitlines()[-40:]
        log.error("%s failed (exit %s after %.0f s); last lines of %s:\n%s", tag, rc, elapsed, log_path, "\n".join(tail))
        return None
    log.info("%s: done in %.0f s (fit, start-up and evaluation)", tag, elapsed)
    return [json.loads(p.read_text()) for p in paths]


def _replica_check(config: Config, ranks: list[dict], args: argparse.Namespace) -> dict[str, Any]:
    """After which of the first optimizer steps all replicas were bit-identical, against what the strategy implies."""
    n = min(len(r["digests"]) for r in ranks)
    identical = [len({r["digests"][i] for r in ranks}) == 1 for i in range(n)]
    if config.strategy == "post_local_sgd":
        w, k = args.localsgd_warmup, args.averaging_period
        expected = [i < w or (i - w) % k == 0 for i in range(n)]
        rule = f"identical after steps 0..{w - 1} (warm-up: global gradient allreduce) and {w}, {w + k}, ... (averaging)"
    elif config.strategy == "no_comm":
        expected = [False] * n
        rule = "never identical (no communication)"
    elif config.strategy == "wagma_sgd":
        expected = [(i + 1) % 10 == 0 for i in range(n)]
        rule = "identical after every 10th step (global average, tau=10); within groups otherwise"
    elif config.strategy == "ds_sync":
        expected = [False] * n
        rule = "identical only after the final average (no periodic global average)"
    else:
        expected = [True] * n
        rule = "identical after every step"
    return {
        "steps_checked": n,
        "identical": "".join("=" if s else "." for s in identical),  # step 0 first; '=' identical
        "expected": "".join("=" if s else "." for s in expected),
        "rule": rule,
        "ok": identical == expected,
    }


def _per_step(cumulative: list[int], total: int) -> dict[str, Any]:
    """Per-step counts from cumulative ones, plus what came after the last batch."""
    steps = [b - a for a, b in zip([0, *cumulative], cumulative)]
    return {"per_step": steps, "after_last_step": total - (cumulative[-1] if cumulative else 0)}


def _round_summary(rounds: list[list[float]]) -> dict[str, Any] | None:
    """Eager-SGD's rounds seen by one rank: fresh gradients, contributions, staleness, time blocked in arrive."""
    if not rounds:
        return None
    fresh, contributions, staleness, wait = zip(*rounds)
    return {
        "rounds": len(rounds),
        "fresh_mean": statistics.fmean(fresh),
        "contributions_mean": statistics.fmean(contributions),
        "contributions_max": max(contributions),
        "staleness_max": max(staleness),
        "staleness_max_mean": statistics.fmean(staleness),
        "wait_ms_mean": statistics.fmean(wait) * 1e3,
        "wait_ms_total": sum(wait) * 1e3,
    }


def summarise_run(config: Config, ranks: list[dict], args: argparse.Namespace) -> dict[str, Any]:
    """Figures of one fit from its 4 rank records."""
    ranks = sorted(ranks, key=lambda r: r["rank"])
    r0 = ranks[0]
    steps_per_s = [r["steps"] / r["wall_s"] for r in ranks]
    return {
        "steps_per_rank": [r["steps"] for r in ranks],
        "samples_per_rank": [r["samples"] for r in ranks],
        "wall_s_per_rank": [r["wall_s"] for r in ranks],
        "startup_s_per_rank": [r["startup_s"] for r in ranks],
        "steps_per_s_per_rank": steps_per_s,
        "steps_per_s_mean": statistics.fmean(steps_per_s),
        "steps_per_s_rank0": steps_per_s[0],
        "step_ms_mean": statistics.fmean(r["wall_s"] / r["steps"] for r in ranks) * 1e3,
        "samples_per_s_total": sum(r["samples"] / r["wall_s"] for r in ranks),
        # CPU cost of a sample, all threads of all ranks: on a machine with fewer cores than
        # ranks, throughput is bounded by cores / this.
        "cpu_us_per_sample": sum(r["cpu_s"] for r in ranks) / sum(r["samples"] for r in ranks) * 1e6,
        # Share of the machine's CPU time the hypervisor stole during rank 0's training interval.
        "steal_fraction": r0["steal_fraction"] if r0["steal_fraction"] is not None else float("nan"),
        "train_loss_last_rank0": statistics.fmean(r0["losses"][-LAST_LOSSES:]),
        "train_loss_last_mean": statistics.fmean(statistics.fmean(r["losses"][-LAST_LOSSES:]) for r in ranks),
        "train_eval_loss_rank0": r0["train_eval_loss"],
        "test_loss_rank0": r0["test_loss"],
        "test_acc_rank0": r0["test_acc"],
        "test_acc_per_rank": [r["test_acc"] for r in ranks],
        "delayed_steps_per_rank": [r["delayed_steps"] for r in ranks],
        "injected_s_per_rank": [r["injected_s"] for r in ranks],
        "replica_check": _replica_check(config, ranks, args),
        "default_group_collectives_rank0": r0["default_group_collectives"],
        # Per step: how many default-group collective calls rank 0 made in it (after the final step:
        # those of on_train_end, e.g. post-local SGD's final average).
        "collectives_per_step_rank0": _per_step(r0["collectives_at_batch_end"], r0["collectives_total"]),
        "eager_rounds_per_rank": [_round_summary(r["rounds"]) for r in ranks],
        "strategy_class": r0["strategy_class"],
        "torch_threads_per_rank": [r["torch_threads"] for r in ranks],
        # Rank 0's loss against its own elapsed training time, for the plot.
        "curve_rank0": {"t_s": r0["step_ends_s"], "loss": r0["losses"]},
    }


# Figures summarised over repeats (median, min, max).
_FIGURES = (
    "steps_per_s_mean", "steps_per_s_rank0", "step_ms_mean", "samples_per_s_total", "train_loss_last_rank0",
    "train_loss_last_mean", "train_eval_loss_rank0", "test_loss_rank0", "test_acc_rank0", "cpu_us_per_sample",
    "steal_fraction",
)


def _reference(results: dict[str, dict], config: Config, strategy: str) -> dict | None:
    """The median figures of ``strategy`` under the same balance condition as ``config``, if it ran."""
    for other in CONFIGS.values():
        if other.strategy == strategy and other.imbalanced == config.imbalanced and other.name in results:
            return results[other.name]["median"]
    return None


def add_ratios(results: dict[str, dict]) -> None:
    """Ratios to DDP (same balance condition) and to the no-communication bound, on the medians."""
    for name, entry in results.items():
        config, med = CONFIGS[name], entry["median"]
        ratios: dict[str, float | None] = {}
        ddp = _reference(results, config, "ddp")
        bound = results.get("no_comm_imbalanced", {}).get("median") if config.imbalanced else None
        ddp_any = ddp or next((results[n]["median"] for n in ("ddp_balanced", "ddp_imbalanced") if n in results), None)
        ratios["throughput_vs_ddp"] = med["samples_per_s_total"] / ddp["samples_per_s_total"] if ddp else None
        ratios["step_time_vs_ddp"] = med["step_ms_mean"] / ddp["step_ms_mean"] if ddp else None
        ratios["throughput_vs_bound"] = med["samples_per_s_total"] / bound["samples_per_s_total"] if bound else None
        # DDP's model does not depend on the injected delays: either DDP run is the accuracy reference.
        ratios["test_acc_minus_ddp_points"] = (med["test_acc_rank0"] - ddp_any["test_acc_rank0"]) * 100 if ddp_any else None
        entry["ratios"] = ratios


def goal_figures(results: dict[str, dict]) -> list[dict[str, Any]]:
    """The figures behind the project's goals, with the goal beside each (reported, never asserted)."""

    def median(name: str, key: str) -> float | None:
        entry = results.get(name)
        return entry["median"][key] if entry and entry.get("runs") else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b is not None else None

    rows = [
        (
            "balanced eager_sgd step time / DDP's",
            ratio(median("eager_sgd_balanced", "step_ms_mean"), median("ddp_balanced", "step_ms_mean")),
            "<= 1.05",
        ),
    ]
    bound = median("no_comm_imbalanced", "samples_per_s_total")
    for name, label in (
        ("eager_sgd_imbalanced", "eager_sgd (solo, max_staleness=2: the default)"),
        ("eager_sgd_unbounded_imbalanced", "eager_sgd (solo, max_staleness=None)"),
    ):
        throughput = median(name, "samples_per_s_total")
        rows += [
            (f"imbalanced {label} throughput / DDP's", ratio(throughput, median("ddp_imbalanced", "samples_per_s_total")), ">= 1.5"),
            (f"imbalanced {label} throughput / post-local SGD's",
             ratio(throughput, median("post_local_sgd_imbalanced", "samples_per_s_total")), "> 1"),
            (f"imbalanced {label} throughput / no-communication bound", ratio(throughput, bound), ">= 0.85"),
            # Not a goal: with fewer cores than ranks the fits are CPU-bound, so the ratio to the
            # bound is roughly at most the inverse of this.
            (f"imbalanced {label} CPU per sample / the bound's",
             ratio(median(name, "cpu_us_per_sample"), median("no_comm_imbalanced", "cpu_us_per_sample")), "(diagnostic)"),
        ]
    for name in ("wagma_sgd_imbalanced", "ds_sync_imbalanced"):
        rows.append((f"{name} throughput / DDP's", ratio(median(name, "samples_per_s_total"),
                     median("ddp_imbalanced", "samples_per_s_total")), ">= 1.5"))
    for name in ("eager_sgd_balanced", "eager_sgd_imbalanced", "eager_sgd_majority_imbalanced",
                 "eager_sgd_unbounded_imbalanced", "eager_sgd_s1_imbalanced", "wagma_sgd_imbalanced",
                 "ds_sync_imbalanced"):
        if name in results and results[name].get("ratios"):
            rows.append(
                (f"{name} test accuracy - DDP's (points)", results[name]["ratios"]["test_acc_minus_ddp_points"], "within +-1")
            )
    return [{"figure": f, "value": v, "goal": g} for f, v, g in rows]


def _fmt(value: float | None, fmt: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, fmt)


def print_table(results: dict[str, dict], repeats: int) -> None:
    """The final table (stdout)."""
    header = (
        f"{'configuration':<31}{'steps/s':>8}{'r0':>7}{'ms/step':>9}{'samples/s':>11}{'xDDP':>7}{'xbound':>8}"
        f"{'loss':>8}{'acc r0':>8}{'dAcc':>7}{'cpu us/s':>9}{'steal':>7}  replicas"
    )
    print(header)
    print("-" * len(header))
    for name in CONFIGS:
        if name not in results:
            continue
        entry = results[name]
        if not entry["runs"]:
            print(f"{name:<31}  failed")
            continue
        med, ratios = entry["median"], entry["ratios"]
        checks = "ok" if all(r["replica_check"]["ok"] for r in entry["runs"]) else "MISMATCH"
        print(
            f"{name:<31}{med['steps_per_s_mean']:>8.2f}{med['steps_per_s_rank0']:>7.2f}{med['step_ms_mean']:>9.1f}"
            f"{med['samples_per_s_total']:>11.0f}{_fmt(ratios['throughput_vs_ddp'], '.2f'):>7}"
            f"{_fmt(ratios['throughput_vs_bound'], '.2f'):>8}{med['train_loss_last_rank0']:>8.3f}"
            f"{med['test_acc_rank0'] * 100:>8.2f}{_fmt(ratios['test_acc_minus_ddp_points'], '+.2f'):>7}"
            f"{med['cpu_us_per_sample']:>9.1f}{med['steal_fraction'] * 100:>6.1f}%  {checks}"
        )
    if repeats > 1:
        print(f"(medians of {repeats} runs; min and max in the JSON)")
    goals = goal_figures(results)
    if goals:
        print()
        width = max(len(g["figure"]) for g in goals)
        for g in goals:
            if g["value"] is not None:  # a configuration left out with --only
                print(f"{g['figure']:<{width}}  {_fmt(g['value'], '.3f'):>7}   goal {g['goal']}")


def plot(results: dict[str, dict], path: Path, delay_ms: float, threads: int = 1) -> None:
    """Throughput normalised to DDP (same balance), test accuracy, and rank 0's loss against time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in CONFIGS if n in results and results[n]["runs"]]
    labels = [("imb. " if CONFIGS[n].imbalanced else "bal. ") + CONFIGS[n].label for n in names]
    colors = ["tab:orange" if CONFIGS[n].imbalanced else "tab:blue" for n in names]
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.2))
    ax = axes[0]
    ratios = [results[n]["ratios"]["throughput_vs_ddp"] or float("nan") for n in names]
    ax.bar(range(len(names)), ratios, color=colors)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(names)), labels, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("total samples/s / DDP (same balance)")
    where = f"{WORLD} CPU ranks x {threads} thread{'s' if threads > 1 else ''}, {os.cpu_count()} cores"
    ax.set_title(f"Throughput, {where} (D = {delay_ms:.0f} ms)", fontsize=10)
    for i, r in enumerate(ratios):
        if not math.isnan(r):
            ax.text(i, r, f"{r:.2f}", ha="center", va="bottom", fontsize=8)
    ax = axes[1]
    accs = [results[n]["median"]["test_acc_rank0"] * 100 for n in names]
    ax.bar(range(len(names)), accs, color=colors)
    ax.set_xticks(range(len(names)), labels, rotation=35, ha="right", fontsize=8)
    low = min(accs)
    ax.set_ylim(max(0.0, low - 5), max(accs) + 2)
    ax.set_ylabel("held-out accuracy of rank 0's model (%)")
    ax.set_title("Accuracy after the fit")
    for i, a in enumerate(accs):
        ax.text(i, a, f"{a:.1f}", ha="center", va="bottom", fontsize=8)
    ax = axes[2]
    for n, label in zip(names, labels):
        curve = results[n]["runs"][0]["curve_rank0"]
        window = 10  # moving average: per-batch losses are noisy
        loss = curve["loss"]
        smooth = [statistics.fmean(loss[max(0, i - window + 1) : i + 1]) for i in range(len(loss))]
        ax.plot(curve["t_s"], smooth, label=label, lw=1.2, ls="-" if CONFIGS[n].imbalanced else "--")
    ax.set_xlabel("rank 0's training time (s)")
    ax.set_ylabel("rank 0's training loss (10-batch mean)")
    ax.set_title("Loss against wall time (first run)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _environment(args: argparse.Namespace, model_parameters: int) -> dict[str, Any]:
    def version(package: str) -> str | None:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return None

    return {
        "torch": torch.__version__,
        "lightning": version("lightning"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "ranks": WORLD,
        "threads_per_rank": args.threads,
        "backend": "gloo",
        "model": f"MLP {IN_DIM}-" + "-".join([str(args.width)] * args.depth) + f"-{CLASSES}",
        "model_parameters": model_parameters,
        "gradient_mbytes": model_parameters * 4 / 2**20,
        "load_average_at_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }


def run_parent(args: argparse.Namespace) -> dict[str, Any]:
    """Parent mode: calibration, every configuration (in subprocesses), summary, table, JSON, plot."""
    selected = (
        [n for n, c in CONFIGS.items() if c.default] if args.only is None
        else [n.strip() for n in args.only.split(",") if n.strip()]
    )
    unknown = [n for n in selected if n not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown configuration(s) {unknown}; choose from {list(CONFIGS)}")
    model_parameters = sum(p.numel() for p in build_mlp(args.width, args.depth).parameters())
    env = _environment(args, model_parameters)
    log.info("load average before the run: %s (the figures assume an otherwise idle machine)", env["load_average_at_start"])

    calibration: dict[str, Any]
    if args.delay_ms is None:
        calibration = calibrate(args.batch_size, args.width, args.depth, threads=args.threads)
        delay_ms = 2.0 * calibration["concurrent_ms"]
        calibration["method"] = (
            f"mean step time (forward + backward + SGD step, batch {args.batch_size}, {args.threads} "
            f"thread{'s' if args.threads > 1 else ''}) of {WORLD} "
            f"concurrent processes on {env['cpus']} cores, as the {WORLD} ranks compete in the fits; D = 2 x that"
        )
    else:
        calibration, delay_ms = {"method": "--delay-ms given"}, args.delay_ms
    calibration["delay_ms"] = delay_ms
    log.info("calibration: %s", {k: round(v, 2) if isinstance(v, float) else v for k, v in calibration.items()})

    cleanup: tempfile.TemporaryDirectory | None = None
    if args.workdir is None:
        cleanup = tempfile.TemporaryDirectory(prefix="imbalance-")
        args.workdir = Path(cleanup.name)
    args.workdir.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {n: [] for n in selected}
    try:
        # Repeats outermost: a drift in the machine's load spreads over every configuration.
        for repeat in range(args.repeats):
            for name in selected:
                def fit(attempt: int, name: str = name, repeat: int = repeat) -> dict | None:
                    ranks = run_fit(CONFIGS[name], f"{name}.{repeat}.{attempt}", args, delay_ms)
                    return None if ranks is None else summarise_run(CONFIGS[name], ranks, args)

                kept = retry_while_stolen(fit, args, name)
                if kept is not None:
                    runs[name].append(kept)
    finally:
        if cleanup is not None and not args.keep_workdir:
            cleanup.cleanup()
        elif args.keep_workdir:
            log.info("worker logs and rank records kept in %s", args.workdir)

    results: dict[str, dict] = {}
    for name, config_runs in runs.items():
        entry: dict[str, Any] = {
            "label": CONFIGS[name].label, "strategy": CONFIGS[name].strategy,
            "imbalanced": CONFIGS[name].imbalanced, "runs": config_runs,
        }
        if config_runs:
            for stat, fn in (("median", statistics.median), ("min", min), ("max", max)):
                entry[stat] = {k: fn(r[k] for r in config_runs) for k in _FIGURES}
        results[name] = entry
    add_ratios({n: e for n, e in results.items() if e["runs"]})
    for entry in results.values():
        for run in entry["runs"]:
            if not run["replica_check"]["ok"]:
                log.warning("replica check failed: %s", run["replica_check"])

    summary = {
        "environment": env,
        "settings": {
            "steps": args.steps, "batch_size": args.batch_size, "repeats": args.repeats, "seed": args.seed,
            "threads": args.threads,
            "max_steal": args.max_steal, "steal_retries": args.steal_retries,
            "lr": args.lr, "momentum": args.momentum, "schedule": args.schedule, "optimizer": args.optimizer,
            "width": args.width, "depth": args.depth,
            "train_samples": TRAIN_SAMPLES, "test_samples": TEST_SAMPLES,
            "post_local_sgd": {
                "start_localSGD_iter": args.localsgd_warmup, "model_averaging_period": args.averaging_period,
                "subgroup": "each rank alone (dist.new_subgroups(group_size=1))", "final_average": True,
            },
            "imbalance": {"stragglers_per_step": 1, "delay_ms": delay_ms, "seed": args.seed},
        },
        "calibration": calibration,
        "notes": [
            (
                "wall time per rank: first on_train_batch_start to the end of the strategy's on_train_end "
                "(after eager-SGD's final flush / post-local SGD's final average); Lightning start-up excluded"
            ),
            (
                "post_local_sgd and no_comm run with Lightning's per-batch SIGTERM broadcast replaced by a local "
                "check (lightning_partial._compat.replace_sigterm_broadcast), as eager_sgd does; ddp keeps it"
            ),
            "ratios are taken between medians; throughput_vs_ddp compares with DDP under the same balance condition",
            "4 ranks share the machine's cores: a sleeping straggler frees CPU for the others",
        ],
        "goals": goal_figures(results),
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    png = args.out.with_suffix(".png")
    written = [str(args.out)]
    if any(e["runs"] for e in results.values()):
        if importlib.util.find_spec("matplotlib") is None:
            log.warning("matplotlib is not installed: no plot (%s)", png)
        else:
            plot(results, png, delay_ms, args.threads)
            written.append(str(png))
    log.info(
        "D = %.1f ms (%s); %d steps x batch %d per rank; model %s (%d parameters)",
        delay_ms, calibration["method"], args.steps, args.batch_size, env["model"], model_parameters,
    )
    log.info("wrote %s", " and ".join(written))
    print_table(results, args.repeats)
    return summary


def positive_int(value: str) -> int:
    """argparse type: an int >= 1 (``--threads``)."""
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {number}")
    return number


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=250, help="training steps per rank in every configuration")
    parser.add_argument("--batch-size", type=int, default=384, help="per-rank batch size")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each configuration; medians are reported")
    parser.add_argument("--only", default=None, help=f"comma-separated subset of {','.join(CONFIGS)}")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "imbalance.json", help="JSON; the PNG goes beside it")
    parser.add_argument("--delay-ms", type=float, default=None, help="straggler delay D (default: 2 x calibrated step)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per fit before its process group is killed")
    parser.add_argument("--threads", type=positive_int, default=1,
                        help="intra-op threads of every rank and calibration process (default 1)")
    parser.add_argument("--seed", type=int, default=0)
    add_steal_arguments(parser)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum, or AdamW's beta1")
    parser.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd",
                        help="SGD with --momentum (default) or AdamW (betas (--momentum, 0.999), weight decay 0.01)")
    parser.add_argument(
        "--schedule", choices=("cosine", "constant"), default="cosine",
        help="learning rate over the fit: cosine decay to 0 per step (default) or constant",
    )
    parser.add_argument("--localsgd-warmup", type=int, default=8, help="post-local SGD: steps of plain DDP first")
    parser.add_argument("--averaging-period", type=int, default=4, help="post-local SGD: steps between averages")
    parser.add_argument("--digest-steps", type=int, default=24, help="steps whose replicas are compared")
    parser.add_argument("--workdir", type=Path, default=None, help="worker logs and rank records (default: a temp dir)")
    parser.add_argument("--keep-workdir", action="store_true", help="keep the temporary worker directory")
    # Worker mode (internal): one 4-process fit; Lightning re-runs this command line for ranks 1-3.
    parser.add_argument("--run", choices=list(CONFIGS), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--tag", default="run", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.run is not None:
        if args.workdir is None or args.delay_ms is None:
            raise SystemExit("--run needs --workdir and --delay-ms")
        return run_worker(args)
    run_parent(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
