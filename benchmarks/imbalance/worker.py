"""Worker mode of the imbalance benchmark (``--run CONFIG``): one rank of one 4-process fit.

Lightning's launcher re-runs the worker's command line (``python -m
benchmarks.imbalance --run CONFIG ...``) for ranks 1-3. Lightning is imported
here, inside :func:`run_worker`, never by the parent.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import logging
import math
import threading
import time
from typing import Any

import torch

from benchmarks.harness import (
    BARE_TRAINER,
    cpu_by_role,
    cpu_ticks,
    emulated_device,
    set_threads,
    steal_between,
    thread_cpu,
)
from benchmarks.imbalance.configs import CONFIGS, WORLD, Config
from benchmarks.imbalance.task import (
    TRAIN_EVAL_SAMPLES,
    TRAIN_SAMPLES,
    BatchDataset,
    batch_collate,
    build_mlp,
    cosine_factor,
    evaluate,
    make_task,
    parameter_digest,
)


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


class StepPieces:
    """CPU seconds the training thread spends in each piece of the strategy's per-step work (``--step-pieces``).

    Wraps methods of the engine and the strategies at class level for the whole fit; a call counts only on the
    main thread (the engine's communication thread is measured by role, :func:`benchmarks.harness.cpu_by_role`).
    Figures are inclusive: ``submit`` holds ``flatten`` and ``store``. Off by default, since every
    wrapped call adds two clock reads.
    """

    # (piece, module, class, method); several methods may feed one piece.
    METHODS: tuple[tuple[str, str, str, str], ...] = (
        ("flatten", "lightning_partial.collectives.layout", "TensorLayout", "flatten"),
        ("store", "lightning_partial.collectives.control", "ControlPlane", "arrive"),
        ("store", "lightning_partial.collectives.control", "ControlPlane", "meet_condition"),
        ("store", "lightning_partial.collectives.control", "ControlPlane", "wake"),
        ("submit", "lightning_partial.collectives.engine", "PartialAllreduce", "_submit"),
        ("collect", "lightning_partial.collectives.engine", "PartialAllreduce", "_collect"),
        ("set_gradients", "lightning_partial.strategies.eager_sgd", "EagerSGDStrategy", "_set_gradients"),
        ("prediction_copy", "lightning_partial.strategies.prediction", "WeightPrediction", "begin"),
        ("prediction_update", "lightning_partial.strategies.prediction", "WeightPrediction", "finish"),
    )

    def __init__(self) -> None:
        self.pieces: dict[str, dict[str, float]] = {}

    def _add(self, piece: str, seconds: float) -> None:
        entry = self.pieces.setdefault(piece, {"calls": 0, "cpu_s": 0.0})
        entry["calls"] += 1
        entry["cpu_s"] += seconds

    def install(self) -> None:
        import importlib

        for piece, module, owner, method in self.METHODS:
            cls = getattr(importlib.import_module(module), owner)
            setattr(cls, method, self._timed(piece, getattr(cls, method)))
        # Weight prediction's shift to the predicted weights and the restore, around the closure: the
        # context manager's enter and exit (the closure inside is not counted).
        prediction = importlib.import_module("lightning_partial.strategies.prediction").WeightPrediction
        predicted, pieces = prediction.predicted, self

        class _Timed:
            def __init__(self, cm: Any) -> None:
                self.cm = cm

            def __enter__(self) -> Any:
                start = time.thread_time()
                try:
                    return self.cm.__enter__()
                finally:
                    pieces._add("prediction_shift", time.thread_time() - start)

            def __exit__(self, *exc: Any) -> Any:
                start = time.thread_time()
                try:
                    return self.cm.__exit__(*exc)
                finally:
                    pieces._add("prediction_restore", time.thread_time() - start)

        prediction.predicted = functools.wraps(predicted)(lambda *a, **k: _Timed(predicted(*a, **k)))

    def _timed(self, piece: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if threading.current_thread() is not threading.main_thread():
                return fn(*args, **kwargs)
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self._add(piece, time.thread_time() - start)

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
            # Main-thread CPU seconds in forward and backward (the training step's own compute), to
            # separate it from what a step costs around it: the loop, the optimizer, the strategy.
            self.compute_cpu_s = 0.0
            self._compute_from = 0.0

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            self._compute_from = time.thread_time()
            x, y = batch
            loss = torch.nn.functional.cross_entropy(self.net(x), y)
            self.losses.append(loss.item())
            return loss

        def on_after_backward(self) -> None:
            self.compute_cpu_s += time.thread_time() - self._compute_from

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
            # The same CPU by thread role (main, communication, other: gloo's and the store's threads).
            self.threads_start: dict[int, tuple[str, float]] = {}
            self.threads_end: dict[int, tuple[str, float]] = {}
            self.step_ends: list[float] = []
            self.computed: list[bool] = []
            self.collectives_at_batch_end: list[int] = []  # cumulative default-group calls (CollectiveCounter)
            self.digests: list[float] = []

        def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
            if self.t_start is None:
                self.t_start = time.perf_counter()
                self.cpu_start = time.process_time()
                self.ticks_start = cpu_ticks()
                self.threads_start = thread_cpu()
                self.counter.active = True

        def on_train_batch_end(
            self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
        ) -> None:
            # After the optimizer step (and post-local SGD's averaging) of this batch.
            self.step_ends.append(time.perf_counter())
            self.computed.append(bool(outputs))  # False: a batch eager_sgd's catch_up skipped (no training_step)
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
                # The engine's threads end in on_train_end: their CPU is read before, the rest after.
                before = thread_cpu()
                inner()
                self.t_end = time.perf_counter()
                self.cpu_end = time.process_time()
                self.ticks_end = cpu_ticks()
                self.threads_end = {**before, **thread_cpu()}
                self.counter.active = False

            strategy.on_train_end = on_train_end

    return TeacherClassifier, StepRecorder


def _make_strategy(config: Config, args: argparse.Namespace) -> Any:
    """The strategy object (or registry name) of ``config``."""
    if config.options:
        import lightning_partial

        classes = {"wagma_sgd": lightning_partial.WAGMAStrategy, "ds_sync": lightning_partial.DSSyncStrategy,
                   "abs_sgd": lightning_partial.ABSSGDStrategy}
        if config.strategy in classes:
            return classes[config.strategy](**dict(config.options))
        mode = "majority" if config.strategy == "eager_sgd_majority" else "solo"
        return lightning_partial.EagerSGDStrategy(**{"mode": mode, **dict(config.options)})
    if config.strategy in ("ddp", "eager_sgd", "eager_sgd_majority", "eager_sgd_backup", "wagma_sgd", "ds_sync",
                           "abs_sgd"):
        return config.strategy  # registry names, as a user would write them (gloo on CPU)
    from benchmarks.baselines import NoCommStrategy, PostLocalSGDStrategy

    if config.strategy == "post_local_sgd":
        return PostLocalSGDStrategy(
            start_localSGD_iter=args.localsgd_warmup, model_averaging_period=args.averaging_period
        )
    if config.strategy == "no_comm":
        return NoCommStrategy()
    raise ValueError(f"unknown strategy {config.strategy!r}")


def catches_up(config: Config) -> bool:
    """Whether ``config`` skips batches (eager_sgd's ``catch_up``): its rounds train fewer samples than batches."""
    return dict(config.options).get("catch_up", False) is True


def _stop_after_samples(batches: int) -> Any:
    """A callback that stops the fit once the rounds have summed ``batches`` micro-batches over all ranks.

    Every rank reads the same round header, so every rank stops after the same round. What is still carried
    lands in the final flush (a few batches more).
    """
    import lightning as L

    class StopAfterSamples(L.Callback):
        def __init__(self) -> None:
            self.summed = 0
            self.round = -1
            self.stopped = False  # the samples ended the fit (not max_steps)

        def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            stats = trainer.strategy.round_stats.get(0)
            if stats is None or stats.round_index == self.round:
                return
            self.round = stats.round_index
            self.summed += stats.contributions
            if self.summed >= batches:
                trainer.should_stop = True
                self.stopped = True

    return StopAfterSamples()


def abs_sgd_epochs(steps: int, batch_size: int) -> int:
    """The epochs in which ABS-SGD trains the samples the other configurations train in ``steps`` steps.

    ABS-SGD's ranks draw different numbers of batches and its ``max_steps`` counts rounds of varying size,
    so its fit is bounded by epochs (``steps x 4 x batch_size`` samples, a whole number of epochs).
    """
    samples = steps * WORLD * batch_size
    if samples <= 0:
        raise ValueError(f"abs_sgd needs --steps and --batch-size >= 1, got {steps} and {batch_size}")
    if samples % TRAIN_SAMPLES:
        per_epoch = TRAIN_SAMPLES // math.gcd(TRAIN_SAMPLES, WORLD * batch_size)
        raise ValueError(
            f"abs_sgd trains whole epochs of {TRAIN_SAMPLES} samples: --steps x {WORLD} x --batch-size "
            f"({steps} x {WORLD} x {batch_size} = {samples}) must be a multiple of it, i.e. --steps a multiple "
            f"of {per_epoch} (--steps 256 with --batch-size 384: 3 epochs)"
        )
    return samples // TRAIN_SAMPLES


def run_worker(args: argparse.Namespace) -> int:
    """Worker mode (``--run CONFIG``): one rank of one 4-process fit; writes ``<workdir>/<tag>.rank<R>.json``."""
    t_process = time.perf_counter()
    set_threads(args.threads)
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
    pieces = StepPieces() if args.step_pieces else None
    if pieces is not None:
        pieces.install()
    recorder = StepRecorder(args.digest_steps, counter)
    callbacks: list[Any] = [recorder]
    if args.device_ms_per_sample > 0:
        callbacks.append(emulated_device(args.device_ms_per_sample))
    imbalance = None
    if config.imbalanced:
        # log=False: a per-step self.log costs every imbalanced configuration alike and nothing reads it here.
        imbalance = LoadImbalance(delay_ms=args.delay_ms, stragglers=1, seed=args.seed, log=False,
                                  straggle_at=args.straggle_at)
        callbacks.append(imbalance)
    stop = _stop_after_samples(args.steps * WORLD) if catches_up(config) else None
    if stop is not None:
        callbacks.append(stop)
    if config.strategy == "abs_sgd":
        bounds: dict[str, int] = {"max_epochs": abs_sgd_epochs(args.steps, args.batch_size), "max_steps": -1}
    elif stop is not None:
        bounds = {"max_steps": 3 * args.steps}  # the samples decide (above); this only bounds a runaway fit
    else:
        bounds = {"max_steps": args.steps}
    trainer = L.Trainer(
        strategy=_make_strategy(config, args),
        accelerator="cpu",
        devices=WORLD,
        # Explicit: a SLURM or torchelastic environment around the benchmark must not
        # change how the 4 local ranks are started.
        plugins=[LightningEnvironment()],
        **bounds,
        callbacks=callbacks,
        **BARE_TRAINER,
    )
    recorder.wrap_strategy_end(trainer.strategy)
    trainer.fit(model, loader)
    rank = trainer.global_rank
    if recorder.t_start is None or recorder.t_end is None:
        raise RuntimeError(f"rank {rank}: the fit recorded no training interval")
    if stop is not None and not stop.stopped:
        raise RuntimeError(f"rank {rank}: the catch_up fit ended after {trainer.global_step} rounds with "
                           f"{stop.summed} of {args.steps * WORLD} batches trained: not after the same samples")

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
        "thread_cpu_s": cpu_by_role(recorder.threads_start, recorder.threads_end),
        "compute_cpu_s": model.compute_cpu_s,
        "step_pieces": pieces.pieces if pieces is not None else None,
        "steal_fraction": steal_between(recorder.ticks_start, recorder.ticks_end),
        "startup_s": recorder.t_start - t_process,
        "t_start": recorder.t_start,  # time.perf_counter: CLOCK_MONOTONIC, comparable across processes
        "t_end": recorder.t_end,
        "step_ends_s": [round(t - recorder.t_start, 5) for t in recorder.step_ends],
        "losses": [round(x, 5) for x in model.losses],
        # The batch ends of the computed batches (one per loss): all of them unless catch_up skipped some.
        "loss_ends_s": [round(t - recorder.t_start, 5) for t, c in zip(recorder.step_ends, recorder.computed) if c],
        "digests": recorder.digests,
        "final_digest": parameter_digest(list(model.parameters())),
        "delayed_steps": sum(1 for r in imbalance.records if r.delay_ms > 0) if imbalance is not None else 0,
        "injected_s": imbalance.injected_ms / 1e3 if imbalance is not None else 0.0,
        "test_loss": test_loss,
        "test_acc": test_acc,
        "train_eval_loss": train_loss,
        "train_eval_acc": train_acc,
        "strategy_class": type(trainer.strategy).__name__,
        # The model-averaging strategies' period of the global average, as the fit ran (the replica check's).
        "global_every": getattr(trainer.strategy, "global_every", None),
        # Optimizer steps per round (model averaging's local steps; 1: a round every step).
        "average_every": getattr(trainer.strategy, "average_every", 1),
        # What activates a round (the replica check's: a "sync" round leaves every replica identical).
        "mode": getattr(getattr(trainer.strategy, "partial_config", None), "mode", None),
        "group_size": getattr(trainer.strategy, "group_size", None),  # WAGMA-SGD's S (None: its default)
        # Model averaging's order of the local step and the average (the replica check's; None: no averaging).
        "order": getattr(trainer.strategy, "order", None),
        "torch_threads": torch.get_num_threads(),  # as the fit ran: --threads
        "default_group_collectives": dict(counter.calls),
        "collectives_at_batch_end": recorder.collectives_at_batch_end,
        "collectives_total": sum(counter.calls.values()),
        "rounds": recorder.rounds,
        # Optimizer steps and the last round seen (ABS-SGD: rounds and steps are not batches).
        "optimizer_steps": trainer.global_step,
        "skipped_steps": getattr(trainer.strategy, "skipped_steps", 0),
        "last_round": getattr(getattr(trainer.strategy, "round_stats", {}).get(0), "round_index", None),
    }
    path = args.workdir / f"{args.tag}.rank{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    tmp.replace(path)  # atomic: the parent never reads half a file
    return 0
