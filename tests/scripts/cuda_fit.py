"""One-device Lightning fits for tests/test_cuda.py, every case in one process (one Lightning import).

Cases (``--cases``, comma-separated, run in this order):

* ``fp32``, ``bf16``: 20 steps of ``strategy="auto"`` then of ``strategy="eager_sgd"``
  (``32-true`` / ``bf16-mixed``) from the same initial weights on the same batches;
  records whether the final weights are bit-identical.
* ``majority``: ``strategy="eager_sgd_majority"`` at world size 1; records what it raised.
* ``abs_adamw``: 20 rounds of ``ABSSGDStrategy(delay=1)`` (the paper's delay) with AdamW at world size 1 (every
  result a round late, so every step but the first is re-timed through Adam's moments:
  ``compensation.retime_adam``) in ``32-true`` and ``bf16-mixed``; records the update
  rule, the device of every re-timed parameter, gradient and moment, and the
  training loss before and after. (Which micro-batches share a round depends on
  the communication thread's timing, so the fit is not compared across devices.)
* ``overlap``: 20 steps of ``EagerSGDStrategy(overlap=True, weight_prediction=False)`` (each
  step applies the previous step's round, collected a step after it ran; the last one at
  the end of fit) against the same SGD momentum loop written out by hand: each gradient
  applied one step late and re-timed (``mu * g`` through the buffer, then ``lr * g``
  outside it; a fresh optimizer's first step whole); records whether the final weights
  are bit-identical, and the rounds applied.
* ``invariant``: ``strategy="eager_sgd"`` whose module logs with ``sync_dist=True`` every
  step, calls ``self.all_gather`` and ``strategy.barrier()`` in ``training_step`` and runs
  validation epochs with ``sync_dist=True`` logging. A spy installed before Lightning is
  imported records every ``torch.distributed`` collective: its name, the backend of the
  group it ran on, the calling thread, the first caller outside torch.distributed, the
  phase of the fit (``train`` from ``on_train_start`` to ``on_train_end``), whether a
  validation loop ran, and whether an engine's communication thread was alive.

Each case writes ``<out>/<case>.json``: ``{"ok": true, ...}`` or ``{"ok": false, "error": traceback}``;
the process group is destroyed between cases. ``--accelerator cpu`` runs the same cases
on the host (gloo everywhere): a check of this script without a GPU.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import logging
import os
import sys
import threading
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

# ------------------------------------------------------------------ the spy
SPY: dict[str, Any] = {"phase": "before", "validating": False, "calls": []}
_COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast", "broadcast_object_list",
    "barrier", "monitored_barrier", "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather", "gather_object",
    "scatter", "scatter_object_list", "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv",
    "batch_isend_irecv", "_all_gather_base", "_reduce_scatter_base",
)
_TORCH_DISTRIBUTED = str(Path(dist.__file__).resolve().parent)
_THIS_FILE = str(Path(__file__).resolve())


def _group_of(name: str, signature: inspect.Signature, args: tuple, kwargs: dict) -> Any:
    if name == "batch_isend_irecv":
        ops = args[0] if args else kwargs.get("p2p_op_list", [])
        return ops[0].group if ops else None
    try:
        return signature.bind_partial(*args, **kwargs).arguments.get("group")
    except TypeError:
        return kwargs.get("group")


def _backend(group: Any) -> str:
    try:
        return str(dist.get_backend(group))
    except Exception as err:  # noqa: BLE001 - a group unknown to c10d
        return f"unknown ({type(err).__name__})"


def _caller() -> str:
    """The first frame outside torch.distributed and this file: ``<dir>/<file>:<function>``."""
    frame = sys._getframe(2)
    while frame is not None:
        filename = str(Path(frame.f_code.co_filename).resolve())
        if not filename.startswith(_TORCH_DISTRIBUTED) and filename != _THIS_FILE:
            path = Path(filename)
            return f"{path.parent.name}/{path.name}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


def _engine_alive() -> bool:
    """Whether an engine's communication thread runs (not its completion watch or retired groups)."""
    return any(
        t.name.startswith("lightning_partial-") and not t.name.endswith(("-completion-watch", "-retired-groups"))
        for t in threading.enumerate()
    )


def _spied(name: str, fn: Callable) -> Callable:
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            SPY["calls"].append({
                "fn": name,
                "backend": _backend(_group_of(name, signature, args, kwargs)),
                "thread": threading.current_thread().name,
                "caller": _caller(),
                "phase": SPY["phase"],
                "validating": SPY["validating"],
                "engine_alive": _engine_alive(),
            })
        except Exception as err:  # noqa: BLE001 - the spy must never change what it watches
            SPY["calls"].append({"fn": name, "backend": f"spy failed: {err!r}", "thread": "?", "caller": "?",
                                 "phase": SPY["phase"], "validating": SPY["validating"], "engine_alive": None})
        return fn(*args, **kwargs)

    wrapper.__spied__ = True  # type: ignore[attr-defined]
    return wrapper


def install_spy() -> None:
    """Wraps the collectives on both modules Lightning and torch call them through; before Lightning is imported."""
    from torch.distributed import distributed_c10d

    for name in _COLLECTIVES:
        for module in (dist, distributed_c10d):
            fn = getattr(module, name, None)
            if fn is not None and not getattr(fn, "__spied__", False):
                setattr(module, name, _spied(name, fn))


# ------------------------------------------------------------------ the fits
def run_cases(args: argparse.Namespace) -> None:
    import lightning as L
    from lightning.pytorch.callbacks import Callback
    from torch import nn
    from torch.nn import functional as F
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_partial  # noqa: F401 - registers "eager_sgd" and friends
    from tests.scripts.ports import RANK_VARIABLES, free_port

    for logger_name in ("lightning", "lightning.pytorch", "lightning.fabric", "lightning_partial"):
        logging.getLogger(logger_name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")

    def data(n: int, seed: int) -> TensorDataset:
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(n, 8, generator=gen)
        return TensorDataset(x, x.sum(1, keepdim=True).sin())

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
            self.seen: dict[str, Any] = {}

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return F.mse_loss(self.net(x).float(), y)

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            strategy = self.trainer.strategy
            engine = getattr(strategy, "_engines", {}).get(0)
            if engine is not None:
                self.seen["engine_backend"] = engine.backend
                self.seen["engine_device"] = str(engine.layout.buckets[0].device)
                self.seen["pg_backend"] = str(dist.get_backend())
                self.seen["round"] = strategy.round_stats[0].round_index
            self.seen["grad_device"] = str(self.net[0].weight.grad.device)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(data(256, 1), batch_size=16, shuffle=False)

    class Logged(Tiny):
        """Tiny plus what synchronises during fit: sync_dist logging, all_gather, barrier, validation."""

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            self.log("train_loss", loss, sync_dist=True)
            gathered = self.all_gather(loss.detach())
            self.seen["gathered_shape"] = list(gathered.shape)
            self.trainer.strategy.barrier()
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            self.log("val_loss", F.mse_loss(self.net(x).float(), y), sync_dist=True)

        def val_dataloader(self) -> DataLoader:
            return DataLoader(data(64, 2), batch_size=16, shuffle=False)

    class Phases(Callback):
        def __init__(self) -> None:
            self.validation_runs = 0

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            SPY["phase"] = "train"

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            SPY["phase"] = "after"

        def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
            SPY["validating"] = True
            self.validation_runs += 1

        def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
            SPY["validating"] = False

    def fresh_rendezvous() -> None:
        # A fit leaves LOCAL_RANK, MASTER_PORT, ... behind; the next one picks its own.
        for key in RANK_VARIABLES:
            os.environ.pop(key, None)
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(free_port())

    def fit(model: Any, strategy: Any, precision: str, **kwargs: Any) -> Any:
        fresh_rendezvous()
        options = dict(max_steps=20, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                       enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                       use_distributed_sampler=False)  # the same batches as strategy="auto"
        options.update(kwargs)
        trainer = L.Trainer(strategy=strategy, accelerator=args.accelerator, devices=1, precision=precision, **options)
        trainer.fit(model)
        return trainer

    def weights(model: Any) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}

    def against_auto(precision: str) -> dict[str, Any]:
        torch.manual_seed(0)
        reference_model = Tiny()
        fit(reference_model, "auto", precision)
        reference = weights(reference_model)
        torch.manual_seed(0)
        model = Tiny()
        initial = weights(model)
        trainer = fit(model, "eager_sgd", precision)
        final = weights(model)
        return {
            "identical": all(torch.equal(final[k], reference[k]) for k in reference),
            "max_diff": max((final[k].double() - reference[k].double()).abs().max().item() for k in reference),
            "finite": all(bool(torch.isfinite(v).all()) for v in final.values()),
            "trained": any(not torch.equal(final[k], initial[k]) for k in reference),
            "global_step": trainer.global_step,
            "flush_round": trainer.strategy.round_stats[0].round_index if trainer.strategy.round_stats else None,
            "strategy": type(trainer.strategy).__name__,
            "seen": model.seen,
        }

    def majority() -> dict[str, Any]:
        torch.manual_seed(0)
        try:
            fit(Tiny(), "eager_sgd_majority", "32-true")
        except Exception as err:  # noqa: BLE001 - recorded, the test judges it
            return {"raised": type(err).__name__, "message": str(err)}
        return {"raised": None, "message": ""}

    def invariant() -> dict[str, Any]:
        torch.manual_seed(0)
        model = Logged()
        phases = Phases()
        max_steps = 8
        SPY.update(phase="before", validating=False, calls=[])
        trainer = fit(model, "eager_sgd", "32-true", max_steps=max_steps, limit_train_batches=4,
                      limit_val_batches=2, callbacks=[phases])
        calls = list(SPY["calls"])
        SPY.update(phase="before", validating=False, calls=[])
        return {
            "calls": calls,
            "global_step": trainer.global_step,
            "max_steps": max_steps,
            "validation_runs": phases.validation_runs,
            "default_backend": model.seen.get("pg_backend"),
            "seen": model.seen,
        }

    class AdamTiny(Tiny):
        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            pass  # Tiny's record is eager_sgd's (its engine and round statistics)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)

    def train_loss(model: Any) -> float:
        x, y = data(256, 1).tensors
        net = Tiny().net
        net.load_state_dict({k: v.detach().float().cpu() for k, v in model.net.state_dict().items()})
        with torch.no_grad():
            return float(F.mse_loss(net(x), y))

    def abs_adamw() -> dict[str, Any]:
        from lightning_partial.strategies import compensation

        retimed: list[dict[str, Any]] = []
        retime_adam = compensation.retime_adam

        def counting(optimizer: Any, params: Any, grads: Any, staleness: int) -> None:
            moments = [optimizer.state[p]["exp_avg"] for p in params if "exp_avg" in optimizer.state.get(p, {})]
            retimed.append({"staleness": staleness, "params": sorted({str(p.device) for p in params}),
                            "grads": sorted({str(g.device) for g in grads}),
                            "moments": sorted({str(m.device) for m in moments})})
            retime_adam(optimizer, params, grads, staleness)

        runs: dict[str, Any] = {}
        compensation.retime_adam = counting  # compensate() calls it through the module
        try:
            for precision in ("32-true", "bf16-mixed"):
                torch.manual_seed(0)
                model = AdamTiny()
                initial = weights(model)
                before = train_loss(model)
                first = len(retimed)
                # The paper's delay: "auto" runs AdamW's rounds synchronously, which leaves nothing to re-time.
                trainer = fit(model, lightning_partial.ABSSGDStrategy(delay=1), precision, use_distributed_sampler=True)
                dist.destroy_process_group()  # each fit its own group
                final = weights(model)
                runs[precision] = {
                    "update_rule": trainer.strategy.update_rule(),
                    "global_step": trainer.global_step,
                    "finite": all(bool(torch.isfinite(v).all()) for v in final.values()),
                    "trained": any(not torch.equal(final[k], initial[k]) for k in initial),
                    "loss_before": before,
                    "loss_after": train_loss(model),
                    "retimed": retimed[first:],
                }
        finally:
            compensation.retime_adam = retime_adam
        return {"runs": runs, "device": args.accelerator}

    class Quiet(Tiny):
        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.seen.setdefault("rounds", []).append(self.trainer.strategy.round_stats.get(0))

    def overlap() -> dict[str, Any]:
        from lightning_partial import EagerSGDStrategy

        steps = 20
        torch.manual_seed(0)
        model = Quiet()
        trainer = fit(model, EagerSGDStrategy(overlap=True, weight_prediction=False), "32-true", max_steps=steps)
        final = weights(model)
        applied = [s.round_index for s in model.seen["rounds"] if s is not None]
        # The same steps by hand: the gradient of step r is applied at step r + 1, the last one after the loop,
        # re-timed (spike compensation, SGD momentum mu, no dampening): mu * g enters the buffer, and the
        # plain step lr * (spike / weight) * (mu * g) = lr * g follows; the first applied step is on time.
        device = torch.device("cuda" if args.accelerator == "gpu" else "cpu")
        torch.manual_seed(0)
        ref = Quiet().to(device)
        optimizer = ref.configure_optimizers()
        group = optimizer.param_groups[0]
        mu, lr = group["momentum"], group["lr"]
        batches = [b for _ in range(2) for b in ref.train_dataloader()][:steps]
        late: Any = None
        for batch in [*batches, None]:
            fresh = None
            if batch is not None:
                optimizer.zero_grad(set_to_none=True)
                ref.training_step(tuple(t.to(device) for t in batch), 0).backward()
                fresh = [p.grad.clone() for p in ref.parameters()]
            if late is not None:
                delayed = bool(optimizer.state)
                for p, g in zip(ref.parameters(), late):
                    p.grad = g
                if delayed:
                    torch._foreach_mul_(late, mu)
                optimizer.step()
                if delayed:
                    with torch.no_grad():
                        for p, g in zip(ref.parameters(), late):
                            p.add_(g, alpha=-1.0 * lr * (((1.0 - mu) / (1.0 - mu)) / mu))
            late = fresh
        reference = weights(ref)
        return {
            "identical": all(torch.equal(final[k], reference[k]) for k in reference),
            "max_diff": max((final[k].double() - reference[k].double()).abs().max().item() for k in reference),
            "global_step": trainer.global_step,
            "applied_in_loop": applied,
            "last_round": trainer.strategy.round_stats[0].round_index,
            "engine_device": str(trainer.strategy.root_device),
            "update_rule": trainer.strategy.update_rule(),
        }

    cases: dict[str, Callable[[], dict[str, Any]]] = {
        "abs_adamw": abs_adamw,
        "overlap": overlap,
        "fp32": lambda: against_auto("32-true"),
        "bf16": lambda: against_auto("bf16-mixed"),
        "majority": majority,
        "invariant": invariant,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    for case in args.cases.split(","):
        try:
            record = {"ok": True, **cases[case]()}
        except BaseException:  # noqa: BLE001 - one broken case must not hide the others
            record = {"ok": False, "error": traceback.format_exc()}
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        (args.out / f"{case}.json").write_text(json.dumps(record, default=str))
        print(f"{case}: {'ok' if record['ok'] else 'FAILED'}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--accelerator", default="gpu", choices=("gpu", "cpu"))
    parser.add_argument("--cases", default="fp32,bf16,majority,invariant,abs_adamw,overlap")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    install_spy()  # before Lightning is imported: modules that import a collective by name get the wrapper
    run_cases(args)


if __name__ == "__main__":
    main()
