"""Late gradients under AdamW, on the AdamW main job's task, in one process (seconds per fit).

The main job's Transformer task (``conf/main_job_transformer.yaml``: 2 + 2
layers of width 64 on the built-in token pairs, AdamW lr 0.003 betas (0.9,
0.98), 8 epochs of 4,096 pairs, held-out token accuracy) with four simulated
workers of 32 samples each and no communication: at each step ``fresh`` of
the four micro-batch gradients are applied at once and the others one step
late, the way a strategy's rounds deliver them:

* ``fresh=4``: DDP; ``fresh=0``: every gradient one step late (``abs_sgd``);
  ``fresh=1``: one fresh of four (``eager_sgd`` solo's steady state);
* ``pred``: weight prediction (``lightning_partial/strategies/prediction.py``):
  every gradient is computed at ``w + pred * u``, ``u`` the last update;
* ``late_weight``: the factor of a late gradient (``"inverse"``: 0.5);
* ``retime``: the late gradients' spike compensation through Adam's moments
  (:func:`lightning_partial.strategies.compensation.retime_adam`, the library's);
* ``sync_first``, ``sync_last``: the fraction of the steps, at the start or at
  the end of the fit, in which every gradient is fresh (the strategies'
  ``final_sync``); the gradients pending at the switch arrive at its first step.
* ``sync_pred``: whether ``pred`` holds in those synchronous steps too (a look-ahead there, as the
  strategies do; ``False``: computed at the current weights):
  ``benchmarks/results/delay_lab_finish_pred.json``;
* ``gap``: gap-aware damping of the late gradients (Barkai, Hakimi, Schuster, *Gap-Aware Mitigation of
  Gradient Staleness*, ICLR 2020): each coordinate divided by ``1 + gap * |w - w_c| / s``, ``w_c`` the
  weights it was computed at (prediction included), ``s`` a running mean of the update's size
  (coefficient 0.9); the damped share is dropped (a lab, not a rule of the library):
  ``benchmarks/results/delay_lab_gap.json``;
* ``late_beta1``: Adam's ``beta1`` in the late (not synchronous) steps; ``late_lr``: the learning
  rate's factor there; ``lr``: the whole fit's learning rate (DDP's included):
  ``benchmarks/results/delay_lab_rules.json``, with ``pred`` 1.5 and 2;
* ``dc``: delay compensation with a diagonal curvature estimate (Zheng et al., *Asynchronous
  Stochastic Gradient Descent with Delay Compensation*, ICML 2017, the adaptive DC-ASGD-a): a late
  gradient ``g`` computed at ``w_c`` becomes ``g + dc * g * g / sqrt(v) * (w - w_c)``, ``v`` Adam's
  bias-corrected second moment as the mean square: ``benchmarks/results/delay_lab_dc.json``.

It isolates the update rule from the transport, the timing and the host: a
fit is a pure function of its seed. Fits run two at a time, one thread each::

    .venv/bin/python -m benchmarks.delay_lab            # writes benchmarks/results/delay_lab.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
WORKERS, BATCH = 4, 32


@dataclass(frozen=True, kw_only=True)
class Setting:
    """One simulated strategy (see the module docstring)."""

    fresh: int = WORKERS
    pred: float = 0.0
    late_weight: float = 1.0
    retime: bool = False
    sync_first: float = 0.0
    sync_last: float = 0.0
    sync_pred: bool = True
    gap: float = 0.0
    late_beta1: float = 0.0
    late_lr: float = 1.0
    lr: float = 0.003
    dc: float = 0.0


SETTINGS: dict[str, Setting] = {
    "ddp": Setting(),
    "ddp_lookahead": Setting(pred=1.0),
    "late": Setting(fresh=0),
    "late_retime": Setting(fresh=0, retime=True),
    "late_pred": Setting(fresh=0, pred=1.0),
    "late_pred_retime": Setting(fresh=0, pred=1.0, retime=True),
    "late_pred2": Setting(fresh=0, pred=2.0),
    "solo_pred_inverse": Setting(fresh=1, pred=1.0, late_weight=0.5),
    "solo_pred_none": Setting(fresh=1, pred=1.0),
    "solo_pred2_inverse": Setting(fresh=1, pred=2.0, late_weight=0.5),
    # A synchronous phase at the start or at the end (the strategies' final_sync): benchmarks/results/delay_lab_finish.json.
    **{f"late_pr_{where}{pct}": Setting(fresh=0, pred=1.0, retime=True, **{f"sync_{where}": pct / 100})
       for where, pcts in (("first", (10, 25)), ("last", (3, 5, 10, 25))) for pct in pcts},
    **{f"late_pr_last{pct}_nopred": Setting(fresh=0, pred=1.0, retime=True, sync_last=pct / 100, sync_pred=False)
       for pct in (5, 25)},
    # Prediction past the weights a late gradient is applied at (a look-ahead, as ddp_lookahead's for fresh ones).
    **{f"late_pr{tag}{suffix}": Setting(fresh=0, pred=coef, retime=True, sync_last=last)
       for tag, coef in (("15", 1.5), ("2", 2.0)) for suffix, last in (("", 0.0), ("_last5", 0.05))},
    # Less explicit momentum while gradients are late (Mitliagkas et al., *Asynchrony begets momentum*, 2016).
    **{f"late_pr_b1{tag}_last5": Setting(fresh=0, pred=1.0, retime=True, sync_last=0.05, late_beta1=b1)
       for tag, b1 in (("8", 0.8), ("5", 0.5))},
    "late_pr_w75_last5": Setting(fresh=0, pred=1.0, retime=True, sync_last=0.05, late_weight=0.75),
    "late_pr_b195_last5": Setting(fresh=0, pred=1.0, retime=True, sync_last=0.05, late_beta1=0.95),
    # Another step size while gradients are late: under Adam a gradient's factor changes nothing, its step size does.
    **{f"late_pr_lr{tag}_last5": Setting(fresh=0, pred=1.0, retime=True, sync_last=0.05, late_lr=f)
       for tag, f in (("7", 0.7), ("5", 0.5), ("13", 1.3), ("16", 1.6))},
    # DDP and abs_sgd's defaults each at a larger learning rate (the task's is below DDP's best for 8 epochs).
    **{f"{name}_lr{tag}": Setting(**kw, lr=0.003 * f) for tag, f in (("13", 1.3), ("16", 1.6), ("2", 2.0))
       for name, kw in (("ddp", {}), ("late_pr_last5", {"fresh": 0, "pred": 1.0, "retime": True, "sync_last": 0.05}))},
    "late_pr_gap": Setting(fresh=0, pred=1.0, retime=True, gap=1.0),
    "late_pr_gap_last5": Setting(fresh=0, pred=1.0, retime=True, gap=1.0, sync_last=0.05),
    "late_pr_gap2_last5": Setting(fresh=0, pred=1.0, retime=True, gap=0.5, sync_last=0.05),
    "late_pr_gap4_last5": Setting(fresh=0, pred=1.0, retime=True, gap=0.25, sync_last=0.05),
    # DC-ASGD-a's curvature compensation of the late gradients, with prediction (abs_sgd's defaults) and without.
    **{f"late_pr_dc{tag}_last5": Setting(fresh=0, pred=1.0, retime=True, sync_last=0.05, dc=c)
       for tag, c in (("1", 1.0), ("10", 10.0), ("100", 100.0))},
    **{f"late_r_dc{tag}_last5": Setting(fresh=0, retime=True, sync_last=0.05, dc=c)
       for tag, c in (("0", 0.0), ("10", 10.0), ("100", 100.0))},
    **{f"solo_pi_{where}{pct}": Setting(fresh=1, pred=1.0, late_weight=0.5, **{f"sync_{where}": pct / 100})
       for where, pcts in (("first", (10, 25)), ("last", (3, 5, 10, 25))) for pct in pcts},
}


def fit(name: str, seed: int, epochs: int = 8) -> dict:
    """One fit of setting ``name``: held-out token accuracy and the last quarter's mean training loss."""
    from recipes.data.text import MappedTokens, pad_pairs
    from recipes.models.sequence import Seq2SeqTransformer

    from lightning_partial.strategies.compensation import retime_adam

    setting = SETTINGS[name]
    torch.manual_seed(seed)
    torch.set_num_threads(1)
    train = MappedTokens(4096, vocab_size=24, min_len=4, max_len=8, seed=seed, split=0)
    val = MappedTokens(1024, vocab_size=24, min_len=4, max_len=8, seed=seed, split=1)
    net = Seq2SeqTransformer(24, 24, 64, 4, 2, 2, 128, 0.0, 10)
    params = list(net.parameters())
    opt = torch.optim.AdamW(params, lr=setting.lr, betas=(0.9, 0.98), weight_decay=0.0)
    beta1, beta2 = opt.param_groups[0]["betas"]

    def loss_of(batch):
        src, tgt = batch
        logits = net(src, tgt[:, :-1])
        target = tgt[:, 1:]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=0)
        return loss, logits, target

    def gradient(batch, shift):
        saved = [p.detach().clone() for p in params] if shift is not None else None
        with torch.no_grad():
            for p, s in zip(params, shift or ()):
                p.add_(s)
        for p in params:
            p.grad = None
        loss, _, _ = loss_of(batch)
        loss.backward()
        grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in params]
        with torch.no_grad():
            for p, s in zip(params, saved or ()):
                p.copy_(s)
        return grads, float(loss.detach())

    order = torch.Generator().manual_seed(seed)
    steps_per_epoch = len(train) // (WORKERS * BATCH)
    last_update, pending, losses = None, None, []
    pending_at, scale = None, None
    started = time.perf_counter()
    total = epochs * steps_per_epoch
    for epoch in range(epochs):
        perm = torch.randperm(len(train), generator=order).tolist()
        for s in range(steps_per_epoch):
            idx = perm[s * WORKERS * BATCH:(s + 1) * WORKERS * BATCH]
            t = epoch * steps_per_epoch + s
            synchronous = t < setting.sync_first * total or t >= (1 - setting.sync_last) * total
            predict = setting.pred and last_update is not None and (setting.sync_pred or not synchronous)
            shift = [u * setting.pred for u in last_update] if predict else None
            fresh = [torch.zeros_like(p) for p in params]
            late = [torch.zeros_like(p) for p in params]
            on_time = WORKERS if synchronous else setting.fresh
            for w in range(WORKERS):
                grads, loss = gradient(pad_pairs([train[i] for i in idx[w * BATCH:(w + 1) * BATCH]]), shift)
                losses.append(loss)
                torch._foreach_add_(fresh if w < on_time else late, grads, alpha=1.0 / WORKERS)
            arriving, arriving_at = pending, pending_at
            pending = late  # applied at the next step
            if setting.gap or setting.dc:  # the weights the late gradients were computed at
                pending_at = [p.detach() + sh if sh is not None else p.detach().clone()
                              for p, sh in zip(params, shift or [None] * len(params))]
            if setting.gap and arriving is not None and scale is not None:
                # Gap-aware damping (Barkai et al. 2020): per coordinate, by the distance from the weights the
                # gradient was computed at to those it is applied to, in units of the running mean update size.
                for a, p, c, sc in zip(arriving, params, arriving_at, scale):
                    a.div_(1.0 + setting.gap * (p.detach() - c).abs() / (sc + 1e-12))
            if setting.dc and arriving is not None and opt.state:
                # DC-ASGD-a (Zheng et al. 2017): g(w) ~ g(w_c) + lambda * g * g * (w - w_c), lambda = dc / sqrt(v).
                for a, p, c in zip(arriving, params, arriving_at):
                    state = opt.state[p]
                    v = state["exp_avg_sq"] / (1 - beta2 ** float(state["step"]))
                    a.add_(setting.dc * a * a / (v.sqrt() + 1e-8) * (p.detach() - c))
            if arriving is not None:
                torch._foreach_mul_(arriving, setting.late_weight)
            for p, g, a in zip(params, fresh, arriving or [None] * len(params)):
                p.grad = g if a is None else g + a
            before = [p.detach().clone() for p in params]
            late_step = not synchronous and on_time < WORKERS  # a step that applies late gradients
            opt.param_groups[0]["lr"] = setting.lr * (setting.late_lr if late_step else 1.0)
            if setting.late_beta1:  # late steps with another beta1, the others with the optimizer's own
                opt.param_groups[0]["betas"] = (setting.late_beta1 if late_step else beta1, beta2)
            opt.step()
            if setting.retime and arriving is not None:
                retime_adam(opt, params, arriving, 1)
            last_update = [p.detach() - b for p, b in zip(params, before)]
            if setting.gap:
                scale = [u.abs() for u in last_update] if scale is None else \
                    [0.9 * sc + 0.1 * u.abs() for sc, u in zip(scale, last_update)]
    net.eval()
    correct = count = 0
    with torch.no_grad():
        for i in range(0, len(val), 256):
            _, logits, target = loss_of(pad_pairs([val[j] for j in range(i, min(i + 256, len(val)))]))
            mask = target.ne(0)
            correct += int(((logits.argmax(-1) == target) & mask).sum())
            count += int(mask.sum())
    quarter = len(losses) // 4
    return {"setting": name, "seed": seed, "accuracy": 100.0 * correct / count,
            "train_loss_last_quarter": sum(losses[-quarter:]) / quarter, "seconds": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, of {', '.join(SETTINGS)}")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "delay_lab.json")
    args = parser.parse_args()
    names = [n for n in args.settings.split(",") if n]
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        parser.error(f"unknown settings {unknown}: expected some of {', '.join(SETTINGS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    with ProcessPoolExecutor(args.jobs) as pool:
        runs = list(pool.map(fit, [n for n in names for _ in seeds], [s for _ in names for s in seeds]))
    summary = {}
    for name in names:
        accuracy = [r["accuracy"] for r in runs if r["setting"] == name]
        summary[name] = {**asdict(SETTINGS[name]), "accuracy": accuracy, "mean": statistics.mean(accuracy),
                         "range": [min(accuracy), max(accuracy)]}
        print(f"{name:22s} {' '.join(f'{a:6.2f}' for a in accuracy)}   mean {summary[name]['mean']:6.2f}")
    args.out.write_text(json.dumps({"seeds": seeds, "summary": summary, "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
