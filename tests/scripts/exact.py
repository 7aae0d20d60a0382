"""A 4-process Lightning fit in exact arithmetic: what was computed is what was applied.

The model is linear in its data: ``loss = sum(w * x)``, so the gradient of a
batch is ``sum(x)`` whatever the weights are. With integer-valued float64 data,
``lr`` and ``1/P`` powers of two, plain SGD ends at exactly

    w_final = w_0 - lr / P * (sum over every rank and every batch of sum(x) / A)

(``A``: gradient accumulation) if and only if every computed gradient was
applied exactly once. Each rank records what it computed (per step) to
``<out>/rank<R>.json``; the test checks the formula, bit for bit.

Options select the Lightning feature under test: ``--accumulate``, ``--manual``
(two optimizers, manual optimization), ``--precision``, ``--evaluate``
(validate/test/predict and ``sync_dist`` logging after fit), ``--spy`` (count
collectives on the default group while the batches run), ``--save-at`` /
``--resume`` (a mid-run checkpoint and a resumed fit), ``--checkpoint-every N``
(a ``ModelCheckpoint`` every N steps into ``<out>/ckpt``, with ``last.ckpt``;
a fit that finds ``last.ckpt`` resumes from it, as a restarted job does) and
``--die-at K`` (rank ``--die-rank`` kills itself at step K in the first attempt
under torchrun, ``TORCHELASTIC_RESTART_COUNT=0``). What each rank computed is
also appended per step to ``<out>/seen.rank<R>.attempt<A>.jsonl``, so that a
process that dies leaves its record behind.

``--launch fork`` starts the ranks with the strategy's fork twin
(``tests/scripts/launch.py``): each rank then writes ``rank<R>.json`` at ``on_fit_end``;
``--evaluate`` and ``--die-at`` need ``popen``, the default.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

# -- the spy: counts default-group collectives (it forwards every call unchanged) --
SPY = {"active": False, "calls": []}
_COLLECTIVES = (
    "all_reduce", "broadcast", "barrier", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
    "gather", "scatter", "reduce", "all_gather_object", "broadcast_object_list", "gather_object", "all_to_all",
    "monitored_barrier",
)


def _spied(name, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        group = kwargs.get("group")
        if SPY["active"] and (group is None or group is dist.group.WORLD):
            SPY["calls"].append(name)
        return fn(*args, **kwargs)

    return wrapper


def install_spy() -> None:
    # Before Lightning is imported, on both modules it may call through.
    from torch.distributed import distributed_c10d

    for name in _COLLECTIVES:
        for module in (dist, distributed_c10d):
            if hasattr(module, name):
                setattr(module, name, _spied(name, getattr(module, name)))


def main() -> None:
    from tests.scripts.ports import ensure_master_port  # a port outside the ephemeral range

    ensure_master_port()
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="eager_sgd")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--manual", action="store_true")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--slow-rank", type=int, default=3)
    parser.add_argument("--slow-ms", type=float, default=25.0)
    parser.add_argument("--evaluate", action="store_true")
    parser.add_argument("--spy", action="store_true")
    parser.add_argument("--save-at", type=int, default=None, help="save <out>/mid.ckpt after this many steps")
    parser.add_argument("--resume", type=Path, default=None)
    parser.add_argument("--checkpoint-every", type=int, default=None)
    parser.add_argument("--die-at", type=int, default=None)
    parser.add_argument("--die-rank", type=int, default=2)
    parser.add_argument("--strategy-kw", default="{}", help="JSON keyword arguments of a configured strategy")
    # Not launch.add_launch_option: that module imports Lightning, which must come after the spy.
    parser.add_argument("--launch", choices=("popen", "fork"), default="popen",
                        help="how Lightning starts the ranks: see tests/scripts/launch.py")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    fork = args.launch == "fork"
    if fork and (args.evaluate or args.die_at is not None):
        parser.error("--launch fork: --evaluate and --die-at need --launch popen")
    if args.spy:
        install_spy()

    import lightning as L

    import lightning_partial  # noqa: F401 - registers the strategies
    from tests.scripts.launch import AtFitEnd, registry_name, release_default_group

    P, D, B = 4, 6, 4
    lr = 1 / 8

    class Linear(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = not args.manual
            self.w = torch.nn.Parameter(torch.arange(D, dtype=torch.float64))
            self.v = torch.nn.Parameter(torch.arange(D, dtype=torch.float64) * 3)
            self.seen: list[dict] = []
            self.train_indices: list[int] = []

        def _slow(self) -> None:
            if self.global_rank == args.slow_rank and args.slow_ms:
                time.sleep(args.slow_ms / 1000)  # a persistently slow rank: its gradients arrive late

        def training_step(self, batch, batch_idx):
            index, x = batch
            self._slow()
            self.train_indices += index.tolist()
            self.seen.append({"step": self.global_step, "x": x.sum(0).tolist()})
            with open(args.out / f"seen.rank{self.global_rank}.attempt{attempt}.jsonl", "a") as f:
                f.write(json.dumps(self.seen[-1]) + "\n")
            self.log("train_rank_mean", float(self.global_rank), on_step=False, on_epoch=True, sync_dist=True)
            if not args.manual:
                return (self.w * x).sum() + (self.v * x).sum() * 2  # grad of v: 2 * sum(x)
            opt_w, opt_v = self.optimizers()
            opt_w.zero_grad()
            self.manual_backward((self.w * x).sum())
            opt_w.step()
            opt_v.zero_grad()
            self.manual_backward((self.v * x).sum() * 2)  # grad of v: 2 * sum(x)
            opt_v.step()
            return None

        def validation_step(self, batch, batch_idx):
            self.log("val_rank_mean", float(self.global_rank), sync_dist=True)

        def test_step(self, batch, batch_idx):
            self.log("test_rank_mean", float(self.global_rank), sync_dist=True)

        def predict_step(self, batch, batch_idx):
            return (self.w.detach() * batch[1]).sum(1)

        def configure_optimizers(self):
            if args.manual:
                return torch.optim.SGD([self.w], lr=lr), torch.optim.SGD([self.v], lr=lr)
            return torch.optim.SGD([self.w, self.v], lr=lr)

    class Probe(L.Callback):
        """Turns the spy on at the first batch and records the count at every batch end."""

        def __init__(self) -> None:
            self.at_batch_end: list[int] = []
            self.rounds: dict[str, list[list]] = {}

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            SPY["active"] = True
            if (args.die_at is not None and attempt == 0 and trainer.global_step == args.die_at
                    and trainer.global_rank == args.die_rank):
                os.kill(os.getpid(), signal.SIGKILL)  # a rank lost mid-fit, after a checkpoint

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.at_batch_end.append(len(SPY["calls"]))
            if args.save_at is not None and trainer.global_step == args.save_at:
                trainer.save_checkpoint(args.out / "mid.ckpt")  # every rank calls it, as Lightning requires

        def on_train_end(self, trainer, pl_module):
            SPY["active"] = False

        def on_train_start(self, trainer, pl_module):
            # Every round each engine applied on this rank: [round, synchronous, sync_from].
            listeners = getattr(trainer.strategy, "round_listeners", None)
            if listeners is not None:
                listeners.append(lambda index, stats: self.rounds.setdefault(str(index), []).append(
                    [stats.round_index, stats.synchronous, getattr(stats, "sync_from", None)]))

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # read at import: size this process's pool too
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    probe = Probe()
    callbacks: list = [probe]
    ckpt_path = args.resume
    if args.checkpoint_every is not None:
        from lightning.pytorch.callbacks import ModelCheckpoint

        callbacks.append(ModelCheckpoint(dirpath=args.out / "ckpt", every_n_train_steps=args.checkpoint_every,
                                         save_top_k=-1, save_last=True))
        if (args.out / "ckpt" / "last.ckpt").exists():
            ckpt_path = args.out / "ckpt" / "last.ckpt"  # a restarted job resumes where it left off
    strategy = registry_name(parser, args.strategy, fork)
    kw = json.loads(args.strategy_kw)
    if kw:
        if fork:
            kw["start_method"] = "fork"
        classes = {"eager_sgd": lightning_partial.EagerSGDStrategy, "wagma_sgd": lightning_partial.WAGMAStrategy,
                   "ds_sync": lightning_partial.DSSyncStrategy, "abs_sgd": lightning_partial.ABSSGDStrategy}
        strategy = classes[args.strategy](**kw)
    g = torch.Generator().manual_seed(0)
    n = 512
    x = torch.randint(-4, 5, (n, D), generator=g).to(torch.float64)
    dataset = torch.utils.data.TensorDataset(torch.arange(n), x)
    loader = torch.utils.data.DataLoader(dataset, batch_size=B, shuffle=False)
    model = Linear()
    w0 = {k: v.detach().clone().tolist() for k, v in model.named_parameters()}

    def record_of(trainer: L.Trainer) -> dict:
        return {
            "rank": trainer.global_rank,
            "lr": lr,
            "world": P,
            "accumulate": args.accumulate,
            "w0": w0,
            "final": {k: v.detach().to(torch.float64).tolist() for k, v in model.named_parameters()},
            "seen": model.seen,
            "train_indices": model.train_indices,
            "collectives_at_batch_end": probe.at_batch_end,
            "collective_names": sorted(set(SPY["calls"])),
            "train_rank_mean": float(trainer.callback_metrics.get("train_rank_mean", float("nan"))),
            "global_step": trainer.global_step,
            "skipped_steps": getattr(trainer.strategy, "skipped_steps", 0),
            "unpredicted_steps": getattr(trainer.strategy, "unpredicted_steps", 0),
            "rounds": probe.rounds,
        }

    def write(trainer: L.Trainer, record: dict) -> None:
        (args.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))
        release_default_group()

    if fork:
        callbacks.append(AtFitEnd(lambda trainer: write(trainer, record_of(trainer))))  # last (see AtFitEnd)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=P,
        max_steps=args.steps,
        accumulate_grad_batches=args.accumulate,
        precision=args.precision,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=args.checkpoint_every is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=4,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    trainer.fit(model, loader, ckpt_path=ckpt_path)
    if fork:
        return
    record = record_of(trainer)
    if args.evaluate:
        trainer.validate(model, loader, verbose=False)
        record["val_rank_mean"] = float(trainer.callback_metrics["val_rank_mean"])
        trainer.test(model, loader, verbose=False)
        record["test_rank_mean"] = float(trainer.callback_metrics["test_rank_mean"])
        small = torch.utils.data.DataLoader(torch.utils.data.Subset(dataset, range(64)), batch_size=B)
        predictions = trainer.predict(model, small)
        record["predicted"] = sum(len(p) for p in predictions)
        record["final_after_evaluate"] = {k: v.detach().to(torch.float64).tolist() for k, v in model.named_parameters()}
    write(trainer, record)


if __name__ == "__main__":
    main()
