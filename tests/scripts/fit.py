"""A small fit on N CPU processes, launched for real by Lightning (tests run this file).

Each rank writes its final parameters to ``<out>/rank<R>.pt``, its pid to
``<out>/pids/rank<R>.pid`` at train start (so a test can signal it),
``<out>/stopped<R>`` (the global step) if the fit ended by SIGTERM, and
``<out>/callbacks<R>.json``: what ``LoadImbalance`` injected per batch, the
``StalenessTracker`` summary (``--track``) and, with ``--spy``, the collectives
issued on the default group while the batches ran. ``--save-at N`` writes
``<out>/mid.ckpt`` after N steps, ``--resume PATH`` resumes from one;
``--batchnorm`` adds a BatchNorm layer (buffers each replica updates);
``--sleep-at BATCH:RANK:SECONDS`` makes one rank sleep inside one training step
(alive, its threads running); ``--sigterm-at BATCH:RANK`` makes one rank send
itself SIGTERM inside one training step, ``--exit-at BATCH:RANK`` call
``sys.exit(0)`` there; ``--unfreeze-at EPOCH`` freezes the first layer before
training and unfreezes it at that epoch (``BaseFinetuning``). ``--strategy-kw``
takes timeouts in seconds.

Imbalance (``lightning_partial.callbacks.LoadImbalance``): ``--imbalance-ms``
(alias ``--straggle-ms``) makes ``--stragglers`` ranks per batch, drawn with a
shared seed, sleep before the forward pass; ``--speed 1,1,0.5,0.25`` slows
ranks persistently. Loggers: ``--csv DIR`` (CSVLogger), ``--wandb DIR``
(``lightning_partial.loggers.wandb_logger``, offline by default).

``--launch fork`` starts the ranks with the strategy's ``start_method="fork"``
(``tests/scripts/launch.py``): they inherit this process's imports, seconds less
per fit than Lightning's script launcher (``popen``, the default), which runs
this file again for every other rank. ``callbacks<R>.json`` and ``rank<R>.pt``
(and ``stopped<R>``) are then written by each rank at ``on_fit_end``, or at
``on_exception`` when SIGTERM stops the fit, and the launching process writes
``<out>/parent.json`` (``trainer.interrupted`` after its ``fit`` returned).
"""

from __future__ import annotations

import sys

if "--spy" in sys.argv:
    # Before Lightning is imported, so that every module it calls through is patched.
    from tests.scripts.exact import install_spy  # the default-group collective counter

    install_spy()

import argparse
import json
import os
import signal
import time
from datetime import timedelta
from dataclasses import asdict
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import BaseFinetuning, EarlyStopping
from lightning.pytorch.loggers import CSVLogger, Logger
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.utils.data import DataLoader, TensorDataset

import lightning_partial  # noqa: F401 - registers the strategies
from lightning_partial.callbacks import AdaptiveBatchSize, GroupRotation, LoadImbalance, StalenessTracker
from lightning_partial.callbacks.adaptive_batch_size import ARRIVALS
from tests.scripts.launch import AtFitEnd, add_launch_option, registry_name, release_default_group


class Regressor(L.LightningModule):
    def __init__(self, batchnorm: bool = False, unused: bool = False, rank0_only: bool = False) -> None:
        super().__init__()
        norm = [torch.nn.BatchNorm1d(16)] if batchnorm else []  # buffers that each replica updates itself
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), *norm, torch.nn.Tanh(), torch.nn.Linear(16, 1))
        # --unused: a layer no rank ever uses, and one that only rank 0 uses (on odd batches).
        self.unused = torch.nn.Linear(8, 1) if unused else None
        self.rank0_only = torch.nn.Linear(8, 1) if unused or rank0_only else None
        self.pid_dir: Path | None = None
        self.step_scheduler = False
        self.momentum = 0.0
        self.weight_decay = 0.0
        self.optimizer = "sgd"
        self.sync_dist = False
        self.sync_dist_from: int | None = None  # --sync-dist from this rank's training step on
        self.sync_dist_in = "training_step"  # --sync-dist-in: the hook that issues them
        self._training_steps = 0
        self.sleep_at: tuple[int, int, float] | None = None  # (batch, rank, seconds)
        self.sigterm_at: tuple[int, int] | None = None  # (batch, rank)
        self.exit_at: tuple[int, int] | None = None  # (batch, rank)
        self.sigterm_last: tuple[int, int] | None = None  # (rank, epoch): SIGTERM in that epoch's last batch
        self.log_epoch = False  # logs "ep" (the epoch) for --early-stop's EarlyStopping
        self.validated_at: list[int] = []  # the global step of each validation (not the sanity check)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)  # collective

    def on_validation_start(self) -> None:
        if not self.trainer.sanity_checking:
            self.validated_at.append(self.trainer.global_step)

    def training_step(self, batch, batch_idx):
        if self.sleep_at is not None and (batch_idx, self.global_rank) == self.sleep_at[:2]:
            time.sleep(self.sleep_at[2])  # a slow step: alive, never to be declared dead
        if self.sigterm_at is not None and (batch_idx, self.global_rank) == self.sigterm_at:
            os.kill(os.getpid(), signal.SIGTERM)  # before this step's round is submitted
        if self.exit_at is not None and (batch_idx, self.global_rank) == self.exit_at:
            sys.exit(0)  # user code ending its process "successfully" mid-fit
        if (self.sigterm_last is not None and (self.global_rank, self.current_epoch) == self.sigterm_last
                and self.trainer.fit_loop.epoch_loop.batch_progress.is_last_batch):
            os.kill(os.getpid(), signal.SIGTERM)  # in this rank's last batch of the epoch
        if self.log_epoch:
            self.log("ep", float(self.current_epoch))
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        if self.rank0_only is not None and self.global_rank == 0 and batch_idx % 2:
            loss = loss + self.rank0_only(x).pow(2).mean()
        self.log("train_loss", loss)
        self._training_steps += 1
        if self.sync_dist_in == "training_step":
            self.synchronise(loss)
        return loss

    def synchronise(self, loss: torch.Tensor) -> None:
        """--sync-dist: the strategy's own collectives, every step (from --sync-dist-from on), in the hook that
        calls this (--sync-dist-in)."""
        if self.sync_dist or (self.sync_dist_from is not None and self._training_steps > self.sync_dist_from):
            self.log("synced_loss", loss.detach(), sync_dist=True)
            self.all_gather(loss.detach())
            self.trainer.strategy.barrier("fit.py")

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.sync_dist_in == "on_train_batch_end":
            self.synchronise(outputs["loss"])

    def on_before_optimizer_step(self, optimizer):
        if self.sync_dist_in == "on_before_optimizer_step":
            self.synchronise(torch.tensor(float(self.trainer.global_step)))

    def on_after_batch_transfer(self, batch, dataloader_idx):
        active = self.sync_dist or (self.sync_dist_from is not None and self._training_steps > self.sync_dist_from)
        if self.sync_dist_in == "on_after_batch_transfer" and active and self.trainer.training:
            self.all_gather(batch[0].sum())  # Lightning allows no self.log() here
            self.trainer.strategy.barrier("fit.py")
        return batch

    def on_train_start(self) -> None:
        if self.pid_dir is not None:  # lets a test signal a given rank
            self.pid_dir.mkdir(parents=True, exist_ok=True)
            (self.pid_dir / f"rank{self.global_rank}.pid").write_text(str(os.getpid()))

    def configure_optimizers(self):
        params = [p for p in self.parameters() if p.requires_grad]  # --unfreeze-at: the frozen layer added later
        if self.optimizer == "adamw":
            optimizer = torch.optim.AdamW(params, lr=0.01, weight_decay=self.weight_decay)
        else:
            optimizer = torch.optim.SGD(params, lr=0.05, momentum=self.momentum, weight_decay=self.weight_decay)
        if not self.step_scheduler:
            return optimizer
        # Halves the learning rate every 3 optimizer steps (abs_sgd: steps, not rounds or batches).
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class UnfreezeAt(BaseFinetuning):
    """``--unfreeze-at EPOCH``: the first layer frozen before training, unfrozen (a param group added to the
    optimizer) at that epoch's start, as ``BackboneFinetuning`` does."""

    def __init__(self, epoch: int) -> None:
        super().__init__()
        self.epoch = epoch

    def freeze_before_training(self, pl_module: L.LightningModule) -> None:
        self.freeze(pl_module.net[0])

    def finetune_function(self, pl_module: L.LightningModule, epoch: int, optimizer: torch.optim.Optimizer) -> None:
        if epoch == self.epoch:
            self.unfreeze_and_add_param_group(pl_module.net[0], optimizer)


class SaveAt(L.Callback):
    """Saves ``<out>/mid.ckpt`` after ``step`` optimizer steps, or at the end of epoch ``epoch``
    (every rank calls it, as Lightning requires; abs_sgd: at an epoch end, which every rank reaches)."""

    def __init__(self, path: Path, step: int | None = None, epoch: int | None = None) -> None:
        self.step, self.epoch, self.path = step, epoch, path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.step is not None and trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)

    def on_train_epoch_end(self, trainer, pl_module):
        if self.epoch is not None and trainer.current_epoch == self.epoch:
            trainer.save_checkpoint(self.path)


class BatchEndSync(L.Callback):
    """``--sync-dist-in callback``: the module's --sync-dist collectives, issued from a callback's batch end."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        pl_module.synchronise(outputs["loss"])


class RoundLog(L.Callback):
    """Every round optimizer 0's engine applied on this rank: ``[round, synchronous, sync_from]`` (the strategy's
    ``round_listeners``; empty under DDP); and per round, who is in it: ``[averaged, fresh]`` (the members whose
    models a model-averaging round's sum holds, ``None`` for a partial allreduce; the ranks whose contribution of
    this very round is in it)."""

    def __init__(self) -> None:
        self.rounds: list[list[Any]] = []
        self.members: list[list[Any]] = []
        self.counts: list[list[int]] = []  # per round, every rank's contribution (abs_sgd: its samples)

    def _append(self, stats: Any) -> None:
        self.rounds.append([stats.round_index, stats.synchronous, getattr(stats, "sync_from", None)])
        self.counts.append(list(stats.counts))
        averaged = getattr(stats, "averaged", None)
        self.members.append([None if averaged is None else list(averaged), list(stats.fresh)])

    def on_train_start(self, trainer, pl_module):
        listeners = getattr(trainer.strategy, "round_listeners", None)
        if listeners is not None:
            listeners.append(lambda index, stats: index == 0 and self._append(stats))


class EpochProbe(L.Callback):
    """Counts the batches and samples of each epoch (abs_sgd: a fast rank draws more samples)."""

    def __init__(self) -> None:
        self.batches: list[int] = []
        self.samples: list[int] = []
        self.first_sizes: list[int] = []  # the size of each epoch's first batch

    def on_train_epoch_start(self, trainer, pl_module):
        self.batches.append(0)
        self.samples.append(0)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if not self.batches or not self.batches[-1]:
            self.first_sizes.append(len(batch[0] if isinstance(batch, (list, tuple)) else batch))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if not self.batches:  # resumed mid-epoch: Lightning skips the epoch start
            self.batches.append(0)
            self.samples.append(0)
        self.batches[-1] += 1
        self.samples[-1] += len(batch[0] if isinstance(batch, (list, tuple)) else batch)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        # Every rank takes part in every save: the global step of each, in order.
        self.saved_at = [*getattr(self, "saved_at", []), trainer.global_step]
        # The file names this rank decided (rank 0 writes the files; Lightning's version counter runs
        # a collective per name it tries, so every rank must decide the same names).
        self.saved_names = [*getattr(self, "saved_names", []),
                            [[Path(c.best_model_path).name, Path(c.last_model_path).name]
                             for c in trainer.checkpoint_callbacks]]

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        # Every optimizer step, the strategies' own (eager_sgd's final flush step) included.
        self.before_steps = getattr(self, "before_steps", 0) + 1
        # The global step each step's hooks see (abs_sgd: several steps may fall in one batch).
        self.step_seen = [*getattr(self, "step_seen", []), trainer.global_step]


class Probe(L.Callback):
    """With ``--spy``: counts the default group's collectives from the first batch start to each batch end.

    Listed first, so its batch-end count precedes the other callbacks' batch
    ends; ``at_train_end`` (before the strategy's own end of fit) covers them all.
    """

    def __init__(self) -> None:
        self.at_batch_end: list[int] = []
        self.at_train_end: int | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        from tests.scripts.exact import SPY

        SPY["active"] = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        from tests.scripts.exact import SPY

        self.at_batch_end.append(len(SPY["calls"]))

    def on_train_end(self, trainer, pl_module):
        from tests.scripts.exact import SPY

        self.at_train_end = len(SPY["calls"])
        SPY["active"] = False


def parse_speed(text: str) -> list[float]:
    return [float(f) for f in text.split(",")]


def main() -> None:
    from tests.scripts.ports import ensure_master_port  # a port outside the ephemeral range

    ensure_master_port()
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="eager_sgd", help="a registered name, or 'eager_sgd:<mode>'")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--imbalance-ms", "--straggle-ms", dest="imbalance_ms", type=float, default=0.0)
    parser.add_argument("--stragglers", type=int, default=1)
    parser.add_argument("--imbalance-seed", type=int, default=7)
    parser.add_argument("--speed", type=parse_speed, default=None, help="one factor per rank, e.g. 1,1,0.5,0.25")
    parser.add_argument("--track", action="store_true", help="add a StalenessTracker")
    parser.add_argument("--csv", type=Path, default=None, help="CSVLogger directory")
    parser.add_argument("--wandb", type=Path, default=None, help="wandb_logger save_dir (offline by default)")
    parser.add_argument("--spy", action="store_true", help="count default-group collectives while batches run")
    parser.add_argument("--sync-dist", action="store_true",
                        help="log with sync_dist=True, all_gather and barrier in every training step")
    parser.add_argument("--sync-dist-from", type=int, default=None,
                        help="as --sync-dist, from this rank's training step N + 1 on")
    parser.add_argument("--sync-dist-in", choices=("training_step", "on_train_batch_end", "callback",
                                                   "on_after_batch_transfer", "on_before_optimizer_step"),
                        default="training_step",
                        help="the hook that issues --sync-dist's collectives: the training step, the module's "
                             "on_train_batch_end or a callback's")
    parser.add_argument("--rotation", type=int, default=None, help="add a GroupRotation(consensus_every=N)")
    parser.add_argument("--strategy-kw", default="{}", help="JSON keyword arguments of a configured strategy")
    parser.add_argument("--batchnorm", action="store_true", help="a BatchNorm1d layer (per-replica buffers)")
    parser.add_argument("--max-epochs", type=int, default=None, help="Trainer(max_epochs); then --steps is ignored")
    parser.add_argument("--max-time", type=float, default=None,
                        help="Trainer(max_time=SECONDS) with no step or epoch limit; then --steps is ignored")
    parser.add_argument("--checkpoint-seconds", type=float, default=None,
                        help="ModelCheckpoint(train_time_interval=SECONDS, save_top_k=-1) into <out>/ckpt_time "
                             "(beside --checkpoint-every's, if given)")
    parser.add_argument("--validate", action="store_true", help="validate at epoch ends (64 samples, 16 per rank)")
    parser.add_argument("--val-seconds", type=float, default=None,
                        help="Trainer(val_check_interval=SECONDS as a time); 64 validation samples, 16 per rank")
    parser.add_argument("--adaptive", action="store_true", help="add an AdaptiveBatchSize(window=4, min_batch_size=2) (abs_sgd)")
    parser.add_argument("--arrival", choices=ARRIVALS, default=None,
                        help="--adaptive's arrival rule (default: the callback's)")
    parser.add_argument("--step-scheduler", action="store_true", help="a StepLR stepped per optimizer step")
    parser.add_argument("--momentum", type=float, default=0.0, help="SGD momentum (the staleness rule reads it)")
    parser.add_argument("--weight-decay", type=float, default=0.0, help="the optimizer's weight decay")
    parser.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd",
                        help="SGD (lr 0.05, --momentum) or AdamW (lr 0.01; --momentum is ignored)")
    parser.add_argument("--unused", action="store_true", help="a layer no rank uses and one only rank 0 uses")
    parser.add_argument("--rank0-only", action="store_true", help="only the layer rank 0 uses on odd batches")
    parser.add_argument("--clip", type=float, default=None, help="Trainer(gradient_clip_val=...)")
    parser.add_argument("--save-at", type=int, default=None, help="save <out>/mid.ckpt after this many steps")
    parser.add_argument("--save-epoch", type=int, default=None, help="save <out>/mid.ckpt at this epoch's end")
    parser.add_argument("--resume", type=Path, default=None, help="a checkpoint to resume the fit from")
    parser.add_argument("--save-last", choices=["true", "link"], default="true",
                        help="--checkpoint-every's ModelCheckpoint(save_last=...): True, or 'link' (a link to the latest)")
    parser.add_argument("--checkpoint-every", type=int, default=None,
                        help="ModelCheckpoint(every_n_train_steps=N, save_top_k=-1, save_last=<--save-last>) "
                             "into <out>/ckpt")
    parser.add_argument("--sleep-at", default=None, help="BATCH:RANK:SECONDS: that rank sleeps in that step")
    parser.add_argument("--sigterm-at", default=None, help="BATCH:RANK: that rank sends itself SIGTERM in that step")
    parser.add_argument("--exit-at", default=None, help="BATCH:RANK: that rank calls sys.exit(0) in that step")
    parser.add_argument("--rank-batch-sizes", default=None,
                        help="one loader batch size per rank, e.g. 16,16,8,8 (default: 16 on every rank)")
    parser.add_argument("--rank-dataset-sizes", default=None,
                        help="one train dataset length per rank (the first N samples), e.g. 2048,2048,2048,1024")
    parser.add_argument("--early-stop", type=int, default=None,
                        help="an EarlyStopping (on the logged epoch) that ends the fit at this epoch's end")
    parser.add_argument("--sigterm-last", default=None, help="RANK:EPOCH: that rank sends itself SIGTERM in its "
                                                               "last batch of that epoch")
    parser.add_argument("--rank-seed", action="store_true",
                        help="each rank calls seed_everything(rank + 1) in its setup (a per-rank seed)")
    parser.add_argument("--reload-dataloaders", action="store_true",
                        help="Trainer(reload_dataloaders_every_n_epochs=1)")
    add_launch_option(parser)
    parser.add_argument("--no-broadcast-replacement", action="store_true",
                        help="as on Lightning before 2.6: the strategy finds no per-batch SIGTERM broadcast to "
                             "replace, and checks for the agreed stop at its batch start")
    parser.add_argument("--unfreeze-at", type=int, default=None,
                        help="the first layer frozen before training, unfrozen at this epoch (BaseFinetuning)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    fork = args.launch == "fork"
    if args.no_broadcast_replacement:  # this process and the ranks it forks (the fallback of Lightning < 2.6)
        from lightning_partial import _compat

        _compat.replace_sigterm_broadcast = lambda trainer, stop_requested: False
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # torch read the variable at import: size this process's pool too (forked ranks inherit it).
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    L.seed_everything(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(2048, 1, generator=g)
    dataset = TensorDataset(x, y)
    loader: DataLoader | None = DataLoader(dataset, batch_size=16, shuffle=True)
    model = Regressor(batchnorm=args.batchnorm, unused=args.unused, rank0_only=args.rank0_only)
    if args.rank_batch_sizes is not None or args.rank_dataset_sizes is not None:
        sizes = [int(b) for b in (args.rank_batch_sizes or "16,16,16,16").split(",")]
        lengths = [int(n) for n in (args.rank_dataset_sizes or "2048,2048,2048,2048").split(",")]
        # Lightning asks for the loader in each rank (a forked rank too), once its rank is known.
        model.train_dataloader = lambda: DataLoader(
            torch.utils.data.Subset(dataset, range(lengths[model.global_rank])),
            batch_size=sizes[model.global_rank], shuffle=True)
        loader = None
    if args.rank_seed:
        # Lightning calls setup on every rank before it builds the train loader's sampler (seeded by PL_GLOBAL_SEED).
        model.setup = lambda stage: L.seed_everything(model.global_rank + 1, verbose=False)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.step_scheduler = args.step_scheduler
    model.momentum = args.momentum
    model.weight_decay = args.weight_decay
    model.optimizer = args.optimizer
    model.sync_dist = args.sync_dist
    model.sync_dist_from = args.sync_dist_from
    model.sync_dist_in = args.sync_dist_in
    batch_sync = BatchEndSync() if args.sync_dist_in == "callback" else None
    if args.sleep_at is not None:
        batch, rank, seconds = args.sleep_at.split(":")
        model.sleep_at = (int(batch), int(rank), float(seconds))
    if args.sigterm_at is not None:
        batch, rank = args.sigterm_at.split(":")
        model.sigterm_at = (int(batch), int(rank))
    if args.exit_at is not None:
        batch, rank = args.exit_at.split(":")
        model.exit_at = (int(batch), int(rank))
    model.pid_dir = args.out / "pids"
    launch = {"start_method": "fork"} if fork else {}
    strategy: Any
    if args.strategy.startswith("eager_sgd:"):  # a configured instance rather than a registry name
        strategy = lightning_partial.EagerSGDStrategy(mode=args.strategy.split(":", 1)[1], **launch)
    else:
        strategy = registry_name(parser, args.strategy, fork)
    kw = json.loads(args.strategy_kw)
    kw = {k: timedelta(seconds=v) if k.endswith("timeout") else v for k, v in kw.items()}
    if kw:
        kw.update(launch)
        classes = {"eager_sgd": lightning_partial.EagerSGDStrategy, "wagma_sgd": lightning_partial.WAGMAStrategy,
                   "ds_sync": lightning_partial.DSSyncStrategy, "abs_sgd": lightning_partial.ABSSGDStrategy}
        strategy = classes[args.strategy](**kw)

    probe = Probe() if args.spy else None
    imbalance = LoadImbalance(
        delay_ms=args.imbalance_ms, stragglers=args.stragglers, speed=args.speed, seed=args.imbalance_seed
    )
    tracker = StalenessTracker() if args.track else None
    rotation = GroupRotation(consensus_every=args.rotation) if args.rotation is not None else None
    saver = None
    if args.save_at is not None or args.save_epoch is not None:
        saver = SaveAt(args.out / "mid.ckpt", step=args.save_at, epoch=args.save_epoch)
    # BatchNorm needs 2 samples.
    arrival = {} if args.arrival is None else {"arrival": args.arrival}
    adaptive = AdaptiveBatchSize(window=4, min_batch_size=2, **arrival) if args.adaptive else None
    epochs = EpochProbe()
    rounds = RoundLog()
    checkpoints = None
    if args.checkpoint_every is not None:
        from lightning.pytorch.callbacks import ModelCheckpoint

        checkpoints = ModelCheckpoint(dirpath=args.out / "ckpt", every_n_train_steps=args.checkpoint_every,
                                      save_top_k=-1, save_last=True if args.save_last == "true" else "link")
    time_checkpoints = None
    if args.checkpoint_seconds is not None:
        from lightning.pytorch.callbacks import ModelCheckpoint

        time_checkpoints = ModelCheckpoint(dirpath=args.out / "ckpt_time", save_top_k=-1,
                                           train_time_interval=timedelta(seconds=args.checkpoint_seconds))
    unfreeze = UnfreezeAt(args.unfreeze_at) if args.unfreeze_at is not None else None
    early_stop = None
    if args.early_stop is not None:
        # Each rank decides at its own epoch end, on the same logged value: all stop after that epoch.
        model.log_epoch = True
        early_stop = EarlyStopping(monitor="ep", mode="max", stopping_threshold=args.early_stop - 0.5,
                                   check_on_train_epoch_end=True, verbose=False)
    if args.sigterm_last is not None:
        rank, epoch = (int(v) for v in args.sigterm_last.split(":"))
        model.sigterm_last = (rank, epoch)
    callbacks = [c for c in (probe, imbalance, tracker, rotation, saver, adaptive, epochs, rounds, checkpoints,
                             time_checkpoints, unfreeze, early_stop, batch_sync) if c is not None]

    def write_stopped(trainer: L.Trainer) -> None:
        # Every rank is expected to stop at the same step: the test compares the markers.
        (args.out / f"stopped{trainer.global_rank}").write_text(str(trainer.global_step))

    def write_results(trainer: L.Trainer) -> None:
        """Every rank: its record, ``callbacks<R>.json``, and its final state, ``rank<R>.pt``."""
        if wandb is not None and trainer.is_global_zero:
            wandb.experiment.finish()  # writes the run's exit record now rather than at interpreter exit
        rank = trainer.global_rank
        record: dict[str, Any] = {
            "rank": rank,
            "world_size": trainer.world_size,
            "imbalance": {
                "delay_ms": imbalance.delay_ms,
                "stragglers": imbalance.stragglers,
                "seed": imbalance.seed,
                "speed": imbalance.speed,
                "injected_ms": imbalance.injected_ms,
                "batches": imbalance.batches,
                "records": [asdict(r) for r in imbalance.records],
            },
        }
        record["global_step"] = trainer.global_step
        record["should_stop"] = trainer.should_stop
        record["validated_at"] = model.validated_at
        record["changed"] = sorted(k for k, v in model.state_dict().items() if not torch.equal(v, initial[k]))
        weights = getattr(trainer.strategy, "_staleness", {}).get(0)
        record["staleness_weights"] = asdict(weights) if weights is not None else None
        update_rule = getattr(trainer.strategy, "update_rule", None)
        record["update_rule"] = update_rule() if callable(update_rule) else None
        record["lr"] = trainer.optimizers[0].param_groups[0]["lr"] if trainer.optimizers else None
        state = trainer.optimizers[0].state if trainer.optimizers else {}
        # A digest of the optimizer's state per parameter and entry (equal on ranks whose states are identical).
        record["optimizer_state"] = [[name, key, float(value.double().sum())]
                                     for name, param in model.named_parameters()
                                     for key, value in sorted(state.get(param, {}).items())
                                     if isinstance(value, torch.Tensor)]
        record["epoch_batches"] = epochs.batches
        record["epoch_samples"] = epochs.samples
        record["epoch_first_batch"] = epochs.first_sizes
        record["before_optimizer_steps"] = getattr(epochs, "before_steps", 0)
        record["step_seen"] = getattr(epochs, "step_seen", [])
        record["saved_at"] = getattr(epochs, "saved_at", [])
        record["saved_names"] = getattr(epochs, "saved_names", [])
        last = getattr(trainer.strategy, "round_stats", {}).get(0)
        record["last_round"] = {"round": last.round_index, "flush": last.flush,
                                "contributions": last.contributions} if last is not None else None
        record["rounds"] = rounds.rounds
        record["round_members"] = rounds.members
        record["round_counts"] = rounds.counts
        lags = getattr(trainer.strategy, "step_lags", None)
        if lags is not None:
            record["step_lags"] = {str(lag): n for lag, n in lags.histogram(0).items()}
        if adaptive is not None:
            record["adaptive"] = [[r, list(sizes), list(counts), split] for r, sizes, counts, split in adaptive.history]
            record["adaptive_bases"] = list(adaptive.bases or ())
            record["round_seconds"] = trainer.strategy.round_seconds  # the last set (arrival="time")
            record["round_fill"] = trainer.strategy.round_fill  # the last set (arrival="samples")
            record["fit_arrival"] = adaptive.fit_arrival
        if rotation is not None:
            record["groups"] = [asdict(r) for r in rotation.history]
        if tracker is not None:
            record["staleness"] = {str(i): s.as_dict() for i, s in tracker.summary.items()}
        if probe is not None:
            from tests.scripts.exact import SPY

            record["collectives_at_batch_end"] = probe.at_batch_end
            record["collectives_at_train_end"] = probe.at_train_end
            record["collective_names"] = sorted(set(SPY["calls"]))
        (args.out / f"callbacks{rank}.json").write_text(json.dumps(record, indent=1))
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, args.out / f"rank{rank}.pt")
        release_default_group()

    if fork:
        callbacks.append(AtFitEnd(write_results, on_sigterm=write_stopped))  # last (see AtFitEnd)
    loggers: list[Logger] = []
    if args.csv is not None:
        loggers.append(CSVLogger(args.csv, name="fit", version=0))
    wandb = None
    if args.wandb is not None:
        from lightning_partial.loggers import wandb_logger

        wandb = wandb_logger(save_dir=args.wandb, name="fit")
        loggers.append(wandb)

    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=args.devices,
        max_steps=-1 if args.max_epochs is not None or args.max_time is not None else args.steps,
        max_epochs=args.max_epochs,
        max_time=None if args.max_time is None else timedelta(seconds=args.max_time),
        val_check_interval=1.0 if args.val_seconds is None else timedelta(seconds=args.val_seconds),
        limit_val_batches=2,
        num_sanity_val_steps=0,
        reload_dataloaders_every_n_epochs=1 if args.reload_dataloaders else 0,
        callbacks=callbacks,
        logger=loggers or False,
        log_every_n_steps=1,
        gradient_clip_val=args.clip,
        enable_checkpointing=checkpoints is not None or time_checkpoints is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        validate = args.validate or args.val_seconds is not None
        val = DataLoader(torch.utils.data.Subset(dataset, range(64)), batch_size=16) if validate else None
        trainer.fit(model, loader, val, ckpt_path=args.resume)
    except SIGTERMException:
        write_stopped(trainer)
    if fork:
        (args.out / "parent.json").write_text(json.dumps({"interrupted": trainer.interrupted}))
    else:
        write_results(trainer)


if __name__ == "__main__":
    main()
