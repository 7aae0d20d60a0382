"""ABS-SGD against DDP under persistent heterogeneity (speed factors 1, 1, 0.5, 0.25), one invocation.

Two tasks (``--model``):

* ``cnn`` (default): a small convolutional network (three 3x3 convolutions of
  32, 32 and 64 channels, the last two of stride 2, each followed by group
  norm and ReLU, global average pooling, a linear head; 29,546 parameters, no
  buffers) on the recipes' built-in class images
  (``recipes.data.images.ClassImages``: 10 classes, 3x16x16, noise 1.0).
  Like the paper's ResNet-18 it does much computation per parameter: one
  round's allreduce carries 118 KB for 18 ms of computation per 128-sample
  micro-batch.
* ``mlp``: the imbalance benchmark's task and model (``benchmarks/imbalance/task.py``:
  teacher-labelled 10-class data, MLP 32-512-512-512-10); plain SGD lr 0.15. It
  does about one multiply-add per parameter and sample: one round's allreduce
  (2.2 MB, about 6.5 ms of a rank's CPU on loopback) costs more CPU than a
  128-sample micro-batch (5.5 ms), and on 2 shared cores that CPU is taken from
  the computation.

The optimizer (every configuration the same): SGD with momentum 0.9
(``--momentum``) at ``lr = (1 - momentum) x`` plain SGD's rate (0.4 for
``cnn``, 0.15 for ``mlp``: 0.04 and 0.015 at momentum 0.9; ``--lr``
overrides it), or ``--optimizer adamw``.

Three configurations, each a 4-process CPU fit, each over **one epoch of the same dataset**
(``--steps x 4 x --batch-size`` samples; ``--abs-epochs N``: ``abs_sgd`` trains N), with
``LoadImbalance(speed=(1, 1, 0.5, 0.25))`` (a rank with factor ``f`` sleeps so
that its batches take ``1/f`` as long):

* ``ddp``: ``--steps`` synchronous steps of ``--batch-size`` per rank;
* ``abs_sgd``: ``ABSSGDStrategy()`` at its defaults (every fast rank's
  micro-batch starts a round, one optimizer step per global batch, the
  linear scaling rule, weight prediction, the staleness rule ``"auto"``);
  ``--target-samples``, ``--reference-samples``, ``--step-samples``,
  ``--no-weight-prediction``, ``--staleness-rule``, ``--final-sync``, ``--delay`` and
  ``--no-overlap-arrival`` set the strategy's options (``--target-samples 256 --reference-samples none --step-samples none
  --no-weight-prediction --staleness-rule none``: the paper's rules at the
  benchmark's earlier round size), ``--abs-batch-size`` its own micro-batch,
  ``--adaptive`` adds ``AdaptiveBatchSize`` (``--window``, ``--first-window``,
  ``--slices``, ``--arrival``: its options). An epoch ends when the ranks
  together have drawn the dataset's samples;
* ``no_comm``: every rank trains alone on its shard. The bound: the ranks'
  summed samples/s while all four train (:func:`concurrent_speed`; the sum of
  each rank's speed over its own interval, the earlier definition, is
  reported beside it).

Reported: samples/s (all ranks), ratios to DDP and to the bound, rank 0's
training loss at the end, the held-out accuracy, and the time ABS-SGD takes to
reach DDP's final loss (rank 0's loss averaged over 10 batches, against DDP's
last 10) as a ratio of DDP's training time. ``--thread-cpu`` adds each rank's
CPU seconds by thread (training loop, communication thread, gloo's and the
store's threads) and prints abs_sgd's CPU per round. The share of the wall
time abs_sgd's fastest ranks were blocked in the rounds, in all and in the
rounds before ``AdaptiveBatchSize``'s sizes apply (``abs_fast_wait_share``,
``abs_fast_wait_start_share``), is in every repeat's figures. Writes
``results/heterogeneity.json`` and a PNG beside it.

Under momentum a gradient applied one round late shrinks SGD's stable step
size (on a quadratic of curvature ``l``: ``lr * l < 1`` instead of ``< 2``
without momentum; with momentum 0.9, ``< 0.1`` instead of ``< 3.8``): what the
strategy's weight prediction and staleness rule are for (``--momentum 0``
runs the earlier plain-SGD protocol). ``--target-samples`` trades throughput
(fewer allreduces, each costing CPU on 2 cores) against progress per sample:
with one step per global batch, the rounds per step decide how much of a
step's gradient is a step old (abs_sgd's ``rounds`` beside its
``global_step`` in the JSON). ``--abs-lr`` gives abs_sgd its own learning rate.
The three fits run ``--repeats`` (3) times, interleaved; the report holds
medians, each repeat's figures and the host's steal time per fit, and a fit
during which the host stole more than ``--max-steal`` (5%) of the CPU runs
again (a shared VM's noise moved single runs by up to 50%).

``--threads N`` (default 1) gives every rank ``N`` intra-op threads
(``OMP_NUM_THREADS``, ``MKL_NUM_THREADS``, ``torch.set_num_threads``): on 2
cores the 4 single-thread ranks pay gloo's CPU out of their compute; with 16
cores and ``--threads 3`` they do not. ``LoadImbalance(speed=...)`` measures a
rank's compute as its training thread's CPU time and warns when torch runs
more than one thread. That CPU time still tracks the compute's wall time, though,
as long as the cores are not oversubscribed: the training thread takes its
share of every parallel region and spins at its end barrier. On this machine,
with 2 threads, one process alone: 1.00 of the wall time for both tasks. So
the slowdown is what ``speed`` asks, in wall time, which is what a slower device
shows. With ``--threads`` > 1 each rank checks this before its fit: 20 steps
of its model on one micro-batch, wall time against the training thread's CPU
time (``clock_check`` in the JSON, ``main_cpu_share`` near 1 as it should be;
printed at the end). With ``--thread-cpu`` the role ``other`` then holds the
intra-op threads too. The JSON records ``threads`` and the environment (cores,
versions).

Run from the repository's root; the package need not be installed (the fits
run as ``python -m benchmarks.heterogeneity --run NAME`` in that directory);
matplotlib is optional (without it, no PNG).

``--device-ms-per-sample X`` (default 0) adds ``X`` ms per sample of sleep after every backward, divided by the
rank's speed factor, in every configuration: compute emulated as an accelerator's, during which the host's cores
stay free (``benchmarks.harness.emulated_device``; recorded as ``device_ms_per_sample``).

Run: ``python -m benchmarks.heterogeneity`` (about 3-4 minutes, on an idle machine);
``python -m benchmarks.heterogeneity --threads 3 --out benchmarks/results/heterogeneity_16core.json`` on 16 cores.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import logging
import math
import os
import platform
import statistics
import subprocess
import time
from collections import Counter
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import (
    BARE_TRAINER,
    RESULTS,
    add_device_argument,
    add_steal_arguments,
    cpu_by_role,
    cpu_ticks,
    emulated_device,
    module_command,
    positive_int,
    retry_while_stolen,
    run_in_group,
    set_threads,
    steal_between,
    thread_cpu,
    thread_environment,
)
from benchmarks.imbalance.task import (
    IN_DIM,
    BatchDataset,
    batch_collate,
    build_mlp,
    cosine_factor,
    evaluate,
    make_task,
)

SPEED = (1.0, 1.0, 0.5, 0.25)
CONFIGS = ("ddp", "abs_sgd", "no_comm")
WINDOW = 10
FIT_TIMEOUT_S = 900  # one fit, start-up and every rank's record included
GLOBAL_BATCH = "global_batch"  # ABSSGDStrategy's value for reference_samples and step_samples
MODELS = ("cnn", "mlp")
#: Plain SGD's learning rates; with momentum ``mu`` the default is ``(1 - mu)`` of them (the same effective
#: rate ``lr / (1 - mu)``); ``--lr`` overrides it.
DEFAULT_LR = {"cnn": 0.4, "mlp": 0.15}
#: ``--optimizer adamw``'s default learning rates (``--lr`` overrides them).
ADAMW_LR = {"cnn": 0.003, "mlp": 0.001}
IMAGE_SIZE, IMAGE_NOISE, IMAGE_TEST_SAMPLES = 16, 1.0, 4096


def build_cnn(width: int = 32) -> torch.nn.Sequential:
    """The ``cnn`` task's model: 3x3 convolutions (``width``, ``width`` stride 2, ``2 * width`` stride 2), each
    followed by group norm (8 groups) and ReLU, global average pooling, a linear head.

    Group norm, not batch norm: it has no buffers (DDP would broadcast them every step), and it is what makes
    SGD on this network stable with a gradient applied one round late (without it the loss spiked and the
    ReLUs died in abs_sgd's runs, and DDP's loss oscillated).
    """
    nn = torch.nn

    def block(cin: int, cout: int, stride: int) -> list[torch.nn.Module]:
        return [nn.Conv2d(cin, cout, 3, padding=1, stride=stride), nn.GroupNorm(8, cout), nn.ReLU()]

    return nn.Sequential(*block(3, width, 1), *block(width, width, 2), *block(width, 2 * width, 2),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * width, 10))


def image_task(seed: int, train_samples: int, workdir: Path) -> dict[str, torch.Tensor]:
    """The ``cnn`` task's data (the recipes' built-in class images), made once per invocation and cached in
    ``workdir``: generating them sample by sample takes seconds, which every rank of every fit would repeat."""
    path = workdir / f"images.seed{seed}.n{train_samples}.pt"
    if path.exists():
        return torch.load(path)
    from recipes.data.images import ClassImages

    images = ClassImages(train_samples + IMAGE_TEST_SAMPLES, num_classes=10, image_size=IMAGE_SIZE,
                         noise=IMAGE_NOISE, seed=seed)
    pairs = [images[i] for i in range(len(images))]
    x = torch.stack([image for image, _ in pairs])
    y = torch.tensor([label for _, label in pairs])
    task = {"x_train": x[:train_samples], "y_train": y[:train_samples],
            "x_test": x[train_samples:], "y_test": y[train_samples:]}
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # each process its own: several may build it at once
    torch.save(task, tmp)
    tmp.rename(path)  # atomic: nobody reads a partial file
    return task


def clock_check(args: argparse.Namespace, steps: int = 20) -> dict[str, float]:
    """Wall time against the training thread's CPU time over ``steps`` forward + backward + SGD steps of a
    throwaway copy of the model on one random micro-batch (after 5 warm-up steps).

    ``LoadImbalance(speed=...)`` sleeps in proportion to the training thread's CPU time: with several
    intra-op threads that is the compute's wall time only while the training thread stays busy (its share of
    each parallel region, then spinning at the barrier). ``main_cpu_share`` near 1 says the emulated
    slowdown is the one asked for.
    """
    net = build_mlp(512, 3) if args.model == "mlp" else build_cnn()
    shape = (IN_DIM,) if args.model == "mlp" else (3, IMAGE_SIZE, IMAGE_SIZE)
    x = torch.randn(micro_batch(args, args.run), *shape)
    y = torch.randint(0, 10, (len(x),))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)

    def step() -> None:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        optimizer.step()

    for _ in range(5):
        step()
    wall, main, process = time.perf_counter(), time.thread_time(), time.process_time()
    for _ in range(steps):
        step()
    wall, main, process = (time.perf_counter() - wall, time.thread_time() - main, time.process_time() - process)
    return {"step_wall_ms": wall / steps * 1e3, "step_main_cpu_ms": main / steps * 1e3,
            "step_process_cpu_ms": process / steps * 1e3, "main_cpu_share": main / wall}


def run_worker(args: argparse.Namespace) -> int:
    set_threads(args.threads)
    # Before the fit (and the seed): rank 0 alone, then ranks 1-3 while rank 0 waits for them.
    checked = clock_check(args) if args.threads > 1 else None
    import lightning as L
    from lightning.pytorch.plugins.environments import LightningEnvironment

    import lightning_partial
    from lightning_partial.callbacks import AdaptiveBatchSize, LoadImbalance

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    L.seed_everything(args.seed, verbose=False)
    n = train_samples(args)
    task = make_task(args.seed) if args.model == "mlp" else image_task(args.seed, n, args.workdir)
    dataset = BatchDataset(task["x_train"][:n], task["y_train"][:n])
    loader = torch.utils.data.DataLoader(dataset, batch_size=micro_batch(args, args.run), shuffle=True, drop_last=True,
                                         collate_fn=batch_collate)

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = build_mlp(512, 3) if args.model == "mlp" else build_cnn()
            self.trace: list[tuple[float, float, int]] = []  # (time, loss, samples)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.cross_entropy(self.net(x), y)
            self.trace.append((time.perf_counter(), float(loss.detach()), len(x)))
            return loss

        def configure_optimizers(self):
            lr = args.abs_lr if args.run == "abs_sgd" and args.abs_lr is not None else args.lr
            if args.optimizer == "adamw":
                # beta1 = --momentum, as the imbalance benchmark's: the coefficient the staleness rule reads.
                optimizer: torch.optim.Optimizer = torch.optim.AdamW(self.parameters(), lr=lr,
                                                                     betas=(args.momentum, 0.999), weight_decay=0.01)
            else:
                optimizer = torch.optim.SGD(self.parameters(), lr=lr, momentum=args.momentum)
            if args.lr_schedule == "constant":
                return optimizer
            # To 0 over DDP's steps (--steps), per optimizer step: abs_sgd steps it per optimizer step, not per
            # micro-batch; each no-communication rank takes as many steps over its shard.
            cosine = torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(cosine_factor, steps=args.steps))
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": cosine, "interval": "step"}}

    class Clock(L.Callback):
        t_start = t_end = None
        ticks = None  # the machine's (steal, total) CPU ticks at the first batch
        cpu_first: dict[int, tuple[str, float]] = {}
        cpu_last: dict[int, tuple[str, float]] = {}
        rounds: list[int]  # abs_sgd: the index of every round this rank saw complete
        waits: list[tuple[int, float]]  # abs_sgd: per result handed, its round and the seconds this rank was
        # blocked before it
        round_times: dict[int, tuple[float, float, bool]]  # abs_sgd: see record_round_times
        round_samples: dict[int, int]  # abs_sgd: every round's samples over all ranks (record_round_times)

        def __init__(self) -> None:
            self.rounds = []
            self.waits = []
            self.round_times = {}
            self.round_samples = {}

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if self.t_start is None:
                self.t_start = time.perf_counter()
                self.ticks = cpu_ticks()
                if args.thread_cpu:
                    self.cpu_first = thread_cpu()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if args.thread_cpu:
                # At every batch: the communication thread and gloo's threads are gone (and their
                # CPU with them) once the fit has ended.
                self.cpu_last = thread_cpu()

    clock = Clock()
    callbacks: list[Any] = [clock, LoadImbalance(speed=args.speed, log=False)]
    if args.device_ms_per_sample > 0:
        callbacks.append(emulated_device(args.device_ms_per_sample, args.speed))
    if args.run == "abs_sgd":
        if args.interval is not None:  # the "time" trigger
            trigger: dict[str, Any] = {"trigger": "time", "interval": args.interval}
        else:
            trigger = {"target_samples": args.target_samples}
        strategy: Any = lightning_partial.ABSSGDStrategy(**trigger, reference_samples=args.reference_samples,
                                                         step_samples=args.step_samples,
                                                         step_boundary=args.step_boundary,
                                                         staleness_rule=args.staleness_rule,
                                                         weight_prediction=args.weight_prediction,
                                                         final_sync=args.final_sync, delay=args.delay,
                                                         overlap_arrival=args.overlap_arrival)
        # Rounds (not optimizer steps): with one step per global batch, rounds per step decide how much of a
        # step's gradient was computed a step earlier.
        strategy.round_listeners.append(lambda index, stats: clock.rounds.append(index))
        # Where a rank's wall time goes beside its work: the seconds its training thread was blocked in the
        # rounds (the allreduce, and the slowest rank in a synchronous round).
        strategy.round_listeners.append(lambda index, stats: clock.waits.append((stats.round_index, stats.wait_time)))
        record_round_times(clock.round_times, clock.round_samples)
        if args.adaptive:
            callbacks.append(AdaptiveBatchSize(window=args.window, first_window=args.first_window, log=False,
                                               arrival=args.arrival, slices=args.slices))
    elif args.run == "no_comm":
        from benchmarks.baselines import NoCommStrategy

        strategy = NoCommStrategy()
    else:
        strategy = "ddp"
    model = Net()
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=4, plugins=[LightningEnvironment()],
                        max_epochs=args.abs_epochs if args.run == "abs_sgd" else 1, callbacks=callbacks,
                        **BARE_TRAINER)
    assert lightning_partial  # registers abs_sgd
    trainer.fit(model, loader)
    t_end = time.perf_counter()
    steal = steal_between(clock.ticks, cpu_ticks())
    test_loss, test_acc = evaluate(model.net, task["x_test"], task["y_test"])
    record = {
        "rank": trainer.global_rank,
        "t_start": clock.t_start,
        "t_end": t_end,
        "samples": sum(s for _, _, s in model.trace),
        "batches": len(model.trace),
        "trace": [(round(t - clock.t_start, 4), round(x, 5), n) for t, x, n in model.trace],  # time, loss, samples
        "global_step": trainer.global_step,
        "rounds": len(clock.rounds) if args.run == "abs_sgd" else None,
        "round_wait_s": sum(w for _, w in clock.waits) if args.run == "abs_sgd" else None,
        # The part of it in the rounds before AdaptiveBatchSize's sizes apply: see start_rounds.
        "round_wait_start_s": (None if args.run != "abs_sgd" or (start := start_rounds(callbacks)) is None
                               else sum(w for q, w in clock.waits if q <= start)),
        "round_times": {str(q): t for q, t in clock.round_times.items()} if args.run == "abs_sgd" else None,
        "round_samples": [n for _, n in sorted(clock.round_samples.items())] if args.run == "abs_sgd" else None,
        # abs_sgd: this rank's trained samples per lag, in optimizer steps, at which they were applied.
        "step_lags": strategy.step_lags.histogram(0) if args.run == "abs_sgd" else None,
        "test_loss": test_loss,
        "test_acc": test_acc,
        "steal_fraction": steal,  # of the machine's CPU while this rank trained (/proc/stat is machine-wide)
        "thread_cpu_s": cpu_by_role(clock.cpu_first, clock.cpu_last) if args.thread_cpu else None,
        "clock_check": checked,
        "torch_threads": torch.get_num_threads(),  # as the fit ran: --threads
    }
    path = args.workdir / f"{args.run}.rank{trainer.global_rank}.json"
    path.with_suffix(".tmp").write_text(json.dumps(record))
    path.with_suffix(".tmp").rename(path)  # atomic: the parent reads only complete files
    return 0


def smoothed(trace: list[list[float]], window: int) -> list[tuple[float, float]]:
    """``(time, mean loss per sample over the last batches that hold at least window samples)`` at every batch
    from the first such one on (``trace``: ``(time, loss, samples)`` per batch, each loss a batch mean)."""
    out = []
    for i in range(len(trace)):
        samples = loss = 0.0
        for _, x, n in reversed(trace[: i + 1]):
            samples, loss = samples + n, loss + x * n
            if samples >= window:
                out.append((trace[i][0], loss / samples))
                break
    return out


def train_samples(args: argparse.Namespace) -> int:
    """The dataset: one epoch of DDP's ``--steps`` steps of ``--batch-size`` on each of the 4 ranks."""
    return args.steps * 4 * args.batch_size


def default_lr(args: argparse.Namespace) -> float:
    """``--lr``'s default: AdamW's, or plain SGD's scaled by ``1 - momentum`` (the same effective rate)."""
    if args.optimizer == "adamw":
        return ADAMW_LR[args.model]
    return round(DEFAULT_LR[args.model] * (1.0 - args.momentum), 6)


def samples_option(value: str) -> int | str | None:
    """``--reference-samples`` and ``--step-samples``: an integer >= 1, ``global_batch`` or ``none``."""
    if value == GLOBAL_BATCH:
        return value
    if value == "none":
        return None
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, {GLOBAL_BATCH} or none, got {value!r}")
    return number


def micro_batch(args: argparse.Namespace, name: str) -> int:
    """Configuration ``name``'s batch per rank: ``--abs-batch-size`` for abs_sgd if given, else ``--batch-size``."""
    return args.abs_batch_size if name == "abs_sgd" and args.abs_batch_size is not None else args.batch_size


def loss_window(args: argparse.Namespace) -> int:
    """Samples averaged for rank 0's loss curve: ``WINDOW`` batches of ``--batch-size``, the same in every
    configuration (abs_sgd's micro-batches, smaller with ``--abs-batch-size`` or sized by ``AdaptiveBatchSize``,
    are averaged over as many samples: a noisier curve would otherwise reach a loss earlier)."""
    return WINDOW * args.batch_size


def concurrent_speed(ranks: list[dict[str, Any]]) -> float:
    """The no-communication bound: the ranks' summed samples/s while **all of them** train.

    Each rank trains the same number of batches alone, so the fast ranks finish first and the slow ones
    then run on cores nobody else uses. On a shared host (4 ranks on 2 cores) a rank's speed over its own
    interval therefore mixes contended and uncontended spells, and their sum is no throughput the four
    ranks could reach together (abs_sgd exceeded it by up to 1.22x). Counted here: each rank's batches
    whose training step ran in ``[t0, t1)``, from the last rank's first step to the first rank's last step
    (trace times), when all four were computing, as abs_sgd's ranks always are.
    """
    t0 = max(r["t_start"] + r["trace"][0][0] for r in ranks)
    t1 = min(r["t_start"] + r["trace"][-1][0] for r in ranks)
    if t1 <= t0:
        raise ValueError(f"no interval in which every rank trained (from {t0:.3f} to {t1:.3f})")
    total = sum(n for r in ranks for t, _, n in r["trace"] if t0 <= r["t_start"] + t < t1)
    return total / (t1 - t0)


def own_interval_speed(ranks: list[dict[str, Any]]) -> float:
    """The bound's earlier definition: each rank's samples over its own interval, summed."""
    return sum(r["samples"] / (r["t_end"] - r["t_start"]) for r in ranks)


def worker_command(args: argparse.Namespace, name: str) -> list[str]:
    """The command line of configuration ``name``'s fit: every option the workers read, as the parent has it."""
    optional = {"--target-samples": args.target_samples, "--interval": args.interval, "--abs-lr": args.abs_lr,
                "--abs-batch-size": args.abs_batch_size}
    return [*module_command("benchmarks.heterogeneity"), "--run", name, "--model", args.model,
            "--workdir", str(args.workdir), "--seed", str(args.seed), "--steps", str(args.steps),
            "--batch-size", str(args.batch_size), "--speed", ",".join(map(str, args.speed)),
            *[item for option, value in optional.items() if value is not None for item in (option, str(value))],
            "--reference-samples", str(args.reference_samples).lower(), "--step-samples", str(args.step_samples).lower(),
            "--step-boundary", args.step_boundary,
            "--adaptive" if args.adaptive else "--no-adaptive", "--arrival", args.arrival, "--slices", str(args.slices),
            "--window", str(args.window),
            *(["--first-window", str(args.first_window)] if args.first_window is not None else []),
            "--lr", str(args.lr),
            "--momentum", str(args.momentum), "--optimizer", args.optimizer, "--staleness-rule", args.staleness_rule,
            "--lr-schedule", args.lr_schedule,
            "--weight-prediction" if args.weight_prediction else "--no-weight-prediction",
            "--abs-epochs", str(args.abs_epochs), "--threads", str(args.threads), "--final-sync", str(args.final_sync),
            "--delay", str(args.delay),
            "--overlap-arrival" if args.overlap_arrival else "--no-overlap-arrival", "--device-ms-per-sample", str(args.device_ms_per_sample),
            *(["--thread-cpu"] if args.thread_cpu else [])]


def run_fit(args: argparse.Namespace, name: str) -> dict[str, Any]:
    """One 4-process fit of configuration ``name``; its figures, rank 0's loss curve and the CPU stolen meanwhile."""
    for stale in args.workdir.glob(f"{name}.rank*.json"):
        stale.unlink()
    files = [args.workdir / f"{name}.rank{r}.json" for r in range(4)]
    command = worker_command(args, name)
    rc = run_in_group(command, records=files, timeout=FIT_TIMEOUT_S,
                      env={**os.environ, **thread_environment(args.threads), "PYTHONWARNINGS": "ignore"})
    if rc is None:
        raise subprocess.TimeoutExpired(command, FIT_TIMEOUT_S)
    missing = [f.name for f in files if not f.exists()]
    if rc != 0 or missing:
        raise RuntimeError(f"{name}: the fit exited with {rc}; no record from {missing or 'none missing'}")
    ranks = [json.loads(f.read_text()) for f in files]
    steals = [r["steal_fraction"] for r in ranks if r.get("steal_fraction") is not None]
    wall = max(r["t_end"] for r in ranks) - min(r["t_start"] for r in ranks)
    if name == "no_comm":
        samples_per_s = concurrent_speed(ranks)
        # What the bound was before (each rank's own speed over its own interval), reported beside it.
        own_intervals = own_interval_speed(ranks)
    else:
        samples_per_s = own_intervals = sum(r["samples"] for r in ranks) / wall
    curve = smoothed(ranks[0]["trace"], loss_window(args))
    return {
        "wall_s": wall,
        "samples": [r["samples"] for r in ranks],
        "batches": [r["batches"] for r in ranks],
        "samples_per_s": samples_per_s,
        "samples_per_s_own_intervals": own_intervals,
        "final_loss": curve[-1][1] if curve else None,
        "test_acc": ranks[0]["test_acc"],
        "test_loss": ranks[0]["test_loss"],
        "global_step": ranks[0]["global_step"],
        "rounds": ranks[0].get("rounds"),
        "round_wait_s": [r.get("round_wait_s") for r in ranks],
        "round_wait_start_s": [r.get("round_wait_start_s") for r in ranks],
        "round_timing": round_timing([r.get("round_times") for r in ranks]),
        "round_samples": spread_of(ranks[0].get("round_samples")),
        "step_lags": [r.get("step_lags") for r in ranks],
        "thread_cpu_s": [r.get("thread_cpu_s") for r in ranks],
        "clock_check": [r.get("clock_check") for r in ranks],
        "torch_threads": [r["torch_threads"] for r in ranks],
        "steal_fraction": max(steals) if steals else None,  # the worst rank's training interval
        "curve": curve,
    }


def fast_wait_shares(run: dict[str, Any], speeds: list[float]) -> dict[str, float | None]:
    """abs_sgd: the share of the fit's wall time the fastest ranks' training threads were blocked in the rounds
    (mean over those ranks), in all (``abs_fast_wait_share``) and in the rounds before AdaptiveBatchSize's sizes
    apply (``abs_fast_wait_start_share``, :func:`start_rounds`; ``None`` without the callback)."""
    fastest = [i for i, v in enumerate(speeds) if v == max(speeds)]

    def share(key: str) -> float | None:
        waits = run.get(key) or []
        if len(waits) != len(speeds) or any(waits[i] is None for i in fastest):
            return None
        return statistics.mean(waits[i] for i in fastest) / run["wall_s"]

    return {"abs_fast_wait_share": share("round_wait_s"), "abs_fast_wait_start_share": share("round_wait_start_s")}


def start_rounds(callbacks: list[Any]) -> int | None:
    """The last round run at the loaders' sizes: ``AdaptiveBatchSize``'s first split comes with the result of the
    round that ends its first window (``first_window`` synchronous rounds), and the round after it still holds
    batches fetched before (one micro-batch per rank, in lock-step, a fast rank waiting for the slowest);
    ``None`` without the callback or a split."""
    from lightning_partial.callbacks import AdaptiveBatchSize

    for callback in callbacks:
        if isinstance(callback, AdaptiveBatchSize):
            return next((index + 1 for index, _, _, split in callback.history if split), None)
    return None


def record_round_times(out: dict[int, tuple[float, float, bool]], samples: dict[int, int]) -> None:
    """abs_sgd's worker: records, per round ``q`` this process was handed (the last a
    ``DelayedAllreduce.deposit`` returned), ``(arrived, handed, went_on)`` in ``time.monotonic()`` (one clock
    for every process of the host): when this rank arrived at ``q`` (the call of the deposit that arrived),
    when a deposit returned its result, and whether the arrival went on without waiting for it
    (``overlap_arrival``: the result came with the next deposit, after another micro-batch). In a round whose
    arrival waited, the deposit that returns ``q`` is the one that arrived at it. ``samples``: every round
    handed, its samples over all ranks (its header's counts)."""
    from lightning_partial.collectives.delayed import DelayedAllreduce

    deposit = DelayedAllreduce.deposit
    went_on: dict[int, float] = {}  # rounds this rank arrived at without waiting: the arrival's call time

    def timed(self: DelayedAllreduce, *a: Any, **kw: Any) -> Any:
        called = time.monotonic()
        results = deposit(self, *a, **kw)
        handed = time.monotonic()
        with self._cond:
            on = self._outstanding_overlap()  # the round this deposit arrived at and went on from, if it did
        if on is not None and on not in went_on:
            went_on[on] = called
        if results:
            q = results[-1].round_index
            arrived = went_on.pop(q, None)
            out[q] = (called if arrived is None else arrived, handed, arrived is not None)
            samples.update((r.round_index, sum(r.stats.counts)) for r in results if not r.stats.flush)
        return results

    DelayedAllreduce.deposit = timed  # type: ignore[method-assign]


def spread_of(values: list[int] | None) -> dict[str, float] | None:
    """Quantiles of a list (``None`` when empty): min, 10th percentile, median, 90th, max."""
    if not values:
        return None
    ordered = sorted(values)
    at = lambda f: ordered[min(len(ordered) - 1, int(f * len(ordered)))]  # noqa: E731
    return {"n": len(ordered), "min": ordered[0], "p10": at(0.1), "median": statistics.median(ordered),
            "p90": at(0.9), "max": ordered[-1]}


def round_timing(per_rank: list[dict[str, list[Any]] | None]) -> dict[str, Any] | None:
    """Where a round's time goes, over the rounds every rank had handed by a deposit (the synchronous ones
    at ``delay=0``), medians in ms: the *period* between two rounds' first arrivals; the *spread* of the
    ranks' arrivals (a rank that waits for the round waits that long for the last); the *latency* from the
    last arrival to the first result handed to a rank that waited for it (the allreduce and the threads'
    hand-offs; ``None`` where every rank went on, ``overlap_arrival``); *went_on*: the share of arrivals that
    went on without waiting. Records of two items (``(called, returned)``, before arrival marks) read as
    arrivals that waited."""
    if not per_rank or any(not r for r in per_rank):
        return None
    known = [r for r in per_rank if r]
    common = sorted(set.intersection(*(set(map(int, r)) for r in known)))
    if len(common) < 3:
        return None
    times = [[(t[0], t[1], bool(t[2]) if len(t) > 2 else False) for t in (r[str(q)] for r in known)]
             for q in common]
    spread = [max(a for a, _, _ in t) - min(a for a, _, _ in t) for t in times]
    latency = [min(h for _, h, on in t if not on) - max(a for a, _, _ in t) for t in times
               if any(not on for _, _, on in t)]
    first = [min(a for a, _, _ in t) for t in times]
    period = [(b - a) / (q1 - q0) for a, b, q0, q1 in zip(first, first[1:], common, common[1:])]
    went_on = sum(on for t in times for _, _, on in t) / sum(len(t) for t in times)
    return {"rounds": len(common), "period_ms": statistics.median(period) * 1e3,
            "arrival_spread_ms": statistics.median(spread) * 1e3,
            "latency_ms": statistics.median(latency) * 1e3 if latency else None, "went_on": went_on}


def lag_figures(fits: list[list[dict[str, int] | None]]) -> dict[str, Any]:
    """abs_sgd's step lags over its fits (each: per rank, samples per lag): each rank's mean, and the shares by lag.

    The shares over all ranks are the mixture ``benchmarks.stability_model --lags`` reads: which
    part of a step's gradient was computed how many optimizer steps before the weights it was applied to.
    """
    if not fits or any(h is None for fit in fits for h in fit):
        return {}
    hists: list[Counter[int]] = [Counter() for _ in fits[0]]
    for fit in fits:
        for rank, histogram in enumerate(fit):
            for lag, samples in (histogram or {}).items():
                hists[rank][int(lag)] += samples  # JSON keys are strings
    pooled = sum(hists, Counter())
    total = sum(pooled.values())
    return {
        "abs_step_lag_by_rank": [sum(k * n for k, n in h.items()) / max(h.total(), 1) for h in hists],
        "abs_step_lag_shares": [pooled[k] / max(total, 1) for k in range(max(pooled, default=0) + 1)],
    }


def run_parent(args: argparse.Namespace) -> dict[str, Any]:
    """``--repeats`` rounds of the three fits, interleaved (a slow spell of the host hits all three); medians.

    A fit during which the hypervisor stole more than ``--max-steal`` of the
    machine's CPU is run again, at most ``--steal-retries`` times (then kept).
    """
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.model == "cnn":
        image_task(args.seed, train_samples(args), args.workdir)  # once, before the fits
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in CONFIGS}
    per_repeat: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        for name in CONFIGS:
            began = time.monotonic()
            kept = retry_while_stolen(lambda attempt, name=name: run_fit(args, name), args, f"{name}.{repeat}")
            assert kept is not None  # run_fit raises on a failed fit
            runs[name].append(kept)
            logging.info("%s.%d: done in %.0f s (host steal %s)", name, repeat, time.monotonic() - began,
                         f"{kept['steal_fraction']:.1%}" if kept["steal_fraction"] is not None else "unknown")
        ddp, abs_, bound = (runs[n][-1] for n in CONFIGS)
        # DDP is deterministic (same loss every repeat); abs_sgd's time to reach it, against this repeat's DDP.
        target = ddp["final_loss"]
        reach = next((t for t, x in abs_["curve"] if x <= target), None) if target is not None else None
        per_repeat.append({
            "abs_vs_ddp_samples_per_s": abs_["samples_per_s"] / ddp["samples_per_s"],
            "abs_vs_bound": abs_["samples_per_s"] / bound["samples_per_s"],
            "abs_vs_bound_own_intervals": abs_["samples_per_s"] / bound["samples_per_s_own_intervals"],
            "ddp_vs_bound": ddp["samples_per_s"] / bound["samples_per_s"],
            "abs_time_to_ddp_final_loss_s": reach,
            "abs_time_to_ddp_final_loss_ratio": reach / ddp["wall_s"] if reach is not None else None,
            "abs_samples_per_step": sum(abs_["samples"]) / max(abs_["global_step"], 1),
            "abs_samples_per_round": sum(abs_["samples"]) / max(abs_["rounds"] or 0, 1),
            "ddp_samples_per_step": sum(ddp["samples"]) / max(ddp["global_step"], 1),
            # Synchronous rounds (delay=0): median ms per round (see round_timing).
            **{f"abs_round_{key}": (abs_["round_timing"] or {}).get(key)
               for key in ("period_ms", "arrival_spread_ms", "latency_ms", "went_on")},
            **fast_wait_shares(abs_, args.speed),
        })

    def median(values: list[Any]) -> Any:
        # None (a repeat that never reached DDP's loss) counts as slower than every repeat that did.
        ordered = sorted(values, key=lambda v: math.inf if v is None else v)
        lo, hi = ordered[(len(ordered) - 1) // 2], ordered[len(ordered) // 2]
        return None if lo is None or hi is None else (lo + hi) / 2

    results: dict[str, Any] = {}
    for name in CONFIGS:
        order = sorted(range(args.repeats), key=lambda i: runs[name][i]["samples_per_s"])
        # Every field of the run with the median throughput (its curve is plotted), and each
        # figure's own median over the repeats beside it.
        results[name] = {**runs[name][order[(args.repeats - 1) // 2]],
                         "median": {key: median([r[key] for r in runs[name]])
                                    for key in ("wall_s", "samples_per_s", "samples_per_s_own_intervals", "final_loss",
                                                "test_acc", "test_loss")},
                         "runs": [{k: v for k, v in r.items() if k != "curve"} for r in runs[name]]}
    summary = {key: median([rep[key] for rep in per_repeat]) for key in per_repeat[0]}
    summary["range"] = {key: [min((rep[key] for rep in per_repeat if rep[key] is not None), default=None),
                              max((rep[key] for rep in per_repeat if rep[key] is not None), default=None)]
                        for key in per_repeat[0]}
    summary["per_repeat"] = per_repeat
    summary.update(lag_figures([r["step_lags"] for r in runs["abs_sgd"]]))
    return {"model": args.model, "seed": args.seed, "optimizer": args.optimizer, "lr": args.lr, "abs_lr": args.abs_lr,
            "momentum": args.momentum, "lr_schedule": args.lr_schedule,
            "staleness_rule": args.staleness_rule, "weight_prediction": args.weight_prediction,
            "speed": args.speed, "target_samples": args.target_samples if args.interval is None else None,
            "interval": args.interval, "reference_samples": args.reference_samples,
            "step_samples": args.step_samples, "step_boundary": args.step_boundary,
            "adaptive": args.adaptive, "arrival": args.arrival, "slices": args.slices, "window": args.window,
            "first_window": args.first_window, "final_sync": args.final_sync, "delay": args.delay,
            "overlap_arrival": args.overlap_arrival,
            "abs_epochs": args.abs_epochs, "steps": args.steps, "batch_size": args.batch_size,
            "abs_batch_size": args.abs_batch_size, "repeats": args.repeats, "threads": args.threads,
            "device_ms_per_sample": args.device_ms_per_sample, "environment": environment(args), "results": results,
            "summary": summary}


def environment(args: argparse.Namespace) -> dict[str, Any]:
    """Where the figures come from: cores, threads per rank, versions, the load before the run."""
    def version(package: str) -> str | None:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return None

    return {"cpus": os.cpu_count(), "ranks": 4, "threads_per_rank": args.threads, "torch": torch.__version__,
            "lightning": version("lightning"), "python": platform.python_version(), "platform": platform.platform(),
            "load_average_at_start": args.load_average}


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    names = list(CONFIGS)
    a.bar(names, [report["results"][n]["samples_per_s"] for n in names], color=["#888", "#2a7", "#ccc"])
    a.set_ylabel("samples/s (all ranks)")
    threads = report.get("threads", 1)
    a.set_title(f"speeds {tuple(report['speed'])}; 4 ranks x {threads} thread{'s' if threads > 1 else ''}, "
                f"{os.cpu_count()} cores", fontsize=9)
    for n in ("ddp", "abs_sgd"):
        curve = report["results"][n]["curve"]
        b.plot([t for t, _ in curve], [x for _, x in curve], label=n)
    if report["results"]["ddp"]["final_loss"] is not None:
        b.axhline(report["results"]["ddp"]["final_loss"], color="#888", linestyle=":")
    b.set_xlabel("seconds")
    b.set_ylabel(f"rank 0 training loss (mean over {WINDOW} batches' samples)")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120, help="DDP steps of the epoch (dataset = steps x 4 x batch)")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--abs-batch-size", type=int, default=None,
                        help="abs_sgd's micro-batch per rank (default: --batch-size); the dataset stays the same")
    parser.add_argument("--seed", type=int, default=0)
    add_steal_arguments(parser)
    parser.add_argument("--repeats", type=int, default=3,
                        help="rounds of the three fits, interleaved; medians are reported (the host is noisy)")
    parser.add_argument("--out", type=Path, default=RESULTS / "heterogeneity.json")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/lightning_partial_heterogeneity"))
    parser.add_argument("--speed", type=lambda v: tuple(float(x) for x in v.split(",")), default=SPEED,
                        help="per-rank speed factors (default 1,1,0.5,0.25)")
    parser.add_argument("--target-samples", type=int, default=None,
                        help="abs_sgd's target_samples (default: the strategy's, its micro-batch: every fast rank's "
                             "micro-batch starts a round; 256 was this benchmark's default before)")
    parser.add_argument("--interval", type=float, default=None,
                        help="abs_sgd with trigger='time' and this interval in seconds (instead of --target-samples)")
    parser.add_argument("--reference-samples", type=samples_option, default=GLOBAL_BATCH,
                        help="abs_sgd's reference_samples: an integer, global_batch (default, the strategy's: the "
                             "linear scaling rule) or none (the paper's sample-weighted mean)")
    parser.add_argument("--step-samples", type=samples_option, default=GLOBAL_BATCH,
                        help="abs_sgd's step_samples: an integer, global_batch (default, the strategy's: one "
                             "optimizer step per global batch) or none (one step per round, the paper's)")
    parser.add_argument("--step-boundary", choices=("nearest", "at_least"), default="nearest",
                        help="abs_sgd's step_boundary (default nearest, the strategy's)")
    parser.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=False,
                        help="abs_sgd with AdaptiveBatchSize (default: no; it costs throughput here, see docs/benchmarks.md)")
    parser.add_argument("--arrival", choices=("count", "samples", "time"), default="samples",
                        help="--adaptive's arrival rule in synchronous rounds (default samples, the callback's: each "
                             "rank once the round holds about its samples, counted in the store; count: the same "
                             "micro-batches on every rank; time: each rank after about the round's time)")
    parser.add_argument("--slices", type=positive_int, default=4,
                        help="--adaptive --arrival samples|time: about how many micro-batches a rank's share is "
                             "cut into (default 4, the callback's)")
    parser.add_argument("--window", type=positive_int, default=8,
                        help="--adaptive: AdaptiveBatchSize's window, the rounds between its updates (default 8, "
                             "the callback's)")
    parser.add_argument("--first-window", type=positive_int, default=None,
                        help="--adaptive: AdaptiveBatchSize's first_window, the rounds run at the loaders' sizes "
                             "before its first split (default: the callback's, min(2, --window); 8 before)")
    parser.add_argument("--abs-epochs", type=int, default=1,
                        help="epochs abs_sgd trains (ddp and no_comm: one; default 1, the same samples; more to see "
                             "when it reaches DDP's final loss)")
    parser.add_argument("--model", choices=MODELS, default="cnn",
                        help="the task: cnn (default; much computation per parameter, as the paper's ResNet-18) or "
                             "mlp (the imbalance benchmark's; an allreduce costs as much CPU as a micro-batch)")
    parser.add_argument("--lr", type=float, default=None,
                        help="the learning rate (SGD's default: (1 - momentum) x 0.4 for cnn, x 0.15 for mlp)")
    parser.add_argument("--abs-lr", type=float, default=None,
                        help="abs_sgd's own learning rate (default: --lr); ddp and no_comm keep --lr")
    parser.add_argument("--momentum", type=float, default=0.9,
                        help="SGD's momentum (default 0.9); with --optimizer adamw, AdamW's beta1")
    parser.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd",
                        help="sgd (default) or adamw (betas (--momentum, 0.999), weight decay 0.01; --lr default "
                             "0.003 for cnn, 0.001 for mlp)")
    parser.add_argument("--lr-schedule", choices=("constant", "cosine"), default="constant",
                        help="constant (default) or cosine to 0 over DDP's --steps optimizer steps, for every configuration")
    parser.add_argument("--weight-prediction", action=argparse.BooleanOptionalAction, default=True,
                        help="abs_sgd's weight_prediction (default: on, the strategy's default; the results "
                             "recorded before the option existed ran without it)")
    parser.add_argument("--staleness-rule", choices=("auto", "momentum", "inverse", "none"), default="auto",
                        help="abs_sgd's staleness_rule (auto: spike compensation under SGD momentum)")
    parser.add_argument("--overlap-arrival", action=argparse.BooleanOptionalAction, default=True,
                        help="abs_sgd's overlap_arrival (default on, the strategy's): with --adaptive --arrival "
                             "samples|time, an arriving rank computes its next micro-batch while the round completes")
    parser.add_argument("--delay", type=lambda v: v if v == "auto" else int(v), choices=["auto", 0, 1], default="auto",
                        help="abs_sgd's delay: 1 (results one round late, the paper's), 0 (synchronous rounds) or "
                             "auto (default: 0 under AdamW or with --adaptive, 1 otherwise)")
    parser.add_argument("--final-sync", type=float, default=0.05,
                        help="abs_sgd's final_sync: the last fraction of the samples in synchronous rounds (0: off)")
    parser.add_argument("--thread-cpu", action="store_true",
                        help="record each rank's CPU seconds by thread (training loop, communication thread, "
                             "gloo and store threads) from /proc; reads /proc at every batch")
    add_device_argument(parser)
    parser.add_argument("--threads", type=positive_int, default=1,
                        help="intra-op threads of every rank (default 1; e.g. 3 on 16 cores)")
    parser.add_argument("--run", choices=CONFIGS, default=None, help=argparse.SUPPRESS)
    return parser


def main() -> int:
    parser = build_parser()
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.lr is None:
        args.lr = default_lr(args)
    if args.run is not None:
        return run_worker(args)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args.load_average = os.getloadavg() if hasattr(os, "getloadavg") else None
    report = run_parent(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    slim = {**report, "results": {k: {kk: vv for kk, vv in v.items() if kk != "curve"}
                                  for k, v in report["results"].items()}}
    args.out.write_text(json.dumps(slim, indent=1))
    if importlib.util.find_spec("matplotlib") is None:
        logging.warning("matplotlib is not installed: no plot (%s)", args.out.with_suffix(".png"))
    else:
        plot(report, args.out.with_suffix(".png"))
    logging.info("wrote %s", args.out)
    def fmt(value: Any, spec: str) -> str:
        return format(value, spec) if value is not None else "-"

    print(f"medians over {report['repeats']} repeats:")
    print(f"{'config':10} {'samples/s':>10} {'x DDP':>7} {'x bound':>8} {'loss':>7} {'test acc':>8} {'wall s':>7}")
    medians = {name: report["results"][name]["median"] for name in CONFIGS}
    for name in CONFIGS:
        m = medians[name]
        print(f"{name:10} {m['samples_per_s']:10.0f} {m['samples_per_s'] / medians['ddp']['samples_per_s']:7.2f} "
              f"{m['samples_per_s'] / medians['no_comm']['samples_per_s']:8.2f} "
              f"{fmt(m['final_loss'], '7.3f'):>7} {m['test_acc']:8.3f} {m['wall_s']:7.1f}")
    abs_cpu = report["results"]["abs_sgd"].get("thread_cpu_s")
    if abs_cpu and all(abs_cpu):
        rounds = report["results"]["abs_sgd"]["rounds"]
        per_round = {role: 1e3 * sum(c[role] for c in abs_cpu) / len(abs_cpu) / max(rounds, 1) for role in abs_cpu[0]}
        print("abs_sgd CPU per rank and round (ms; run with the median throughput): "
              + ", ".join(f"{role} {ms:.2f}" for role, ms in per_round.items()))
    timing = report["results"]["abs_sgd"].get("round_timing")
    if timing:
        latency = timing.get("latency_ms")
        print(f"abs_sgd rounds (run with the median throughput; medians over {timing['rounds']} rounds): one every "
              f"{timing['period_ms']:.1f} ms; the ranks' arrivals spread over {timing['arrival_spread_ms']:.1f} ms; "
              + (f"{latency:.1f} ms from the last arrival to the first waiting rank's result"
                 if latency is not None else "no rank waited for a result")
              + f"; {timing.get('went_on', 0.0):.0%} of the arrivals went on without waiting")
    waited, at_start = (report["summary"].get(k) for k in ("abs_fast_wait_share", "abs_fast_wait_start_share"))
    if waited is not None:
        print(f"abs_sgd's fastest ranks were blocked in the rounds {waited:.1%} of the wall time (median over repeats)"
              + (f", {at_start:.1%} in the rounds before AdaptiveBatchSize's sizes applied" if at_start is not None
                 else ""))
    checks = [c for name in CONFIGS for run in report["results"][name]["runs"] for c in run["clock_check"] if c]
    if checks:
        shares = sorted(c["main_cpu_share"] for c in checks)
        print(f"{len(checks)} rank clock checks ({args.threads} threads): training thread CPU / wall "
              f"min {shares[0]:.2f}, median {shares[len(shares) // 2]:.2f}, max {shares[-1]:.2f} "
              "(near 1: the speed factors' slowdown is as asked)")
    own = medians["no_comm"]["samples_per_s_own_intervals"]
    print(f"bound over each rank's own interval (the earlier definition): {own:.0f} samples/s; "
          f"abs_sgd {medians['abs_sgd']['samples_per_s'] / own:.2f}x it")
    summary = report["summary"]
    print(f"abs_sgd, median [min-max] over {report['repeats']} repeats: "
          + "; ".join(f"{key} {summary[key]:.3g} [{lo:.3g}-{hi:.3g}]" if summary[key] is not None and lo is not None
                      else f"{key} {summary[key]}" for key, (lo, hi) in summary["range"].items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
