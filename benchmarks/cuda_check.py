"""CUDA checks of the partial-allreduce engine and ``strategy="eager_sgd"`` on one GPU.

Prints one ``PASS`` / ``FAIL`` / ``SKIP`` / ``INFO`` line per check and exits 1
if any check failed. Without CUDA every GPU check is skipped (exit 0), so the
script is harmless on CPU-only machines and in CI.

1. Engine on CUDA tensors across 2 spawned processes, both on ``cuda:0``,
   ``backend="gloo"`` (NCCL refuses two ranks on one GPU), modes ``solo`` and
   ``majority``, rank 1 slow so that its gradients are carried: per-round
   results bit-identical on both ranks, and the sum over all rounds + the flush
   equals the sum of everything contributed (integer-valued floats: exact).
2. The NCCL data path at world size 1 (``backend="nccl"``): a few rounds
   (several dtypes, so several buckets) and a flush give the exact inputs back.
3. No host synchronisation of the caller's compute stream: a ~200 ms kernel
   (``torch.cuda._sleep``) is enqueued, the gradient is produced after it on the
   same stream, then ``arrive`` is timed. Checked: the caller's thread makes no
   synchronising CUDA call (``torch.cuda.set_sync_debug_mode``, with a positive
   control); for NCCL, ``arrive`` returns before the kernel has finished; the
   result is correct once read after ``torch.cuda.synchronize()``. For gloo,
   which stages CUDA tensors through host memory, the blocking is reported (INFO).
4. Lightning: ``strategy="eager_sgd"`` on one GPU for 20 steps, in ``32-true``
   and ``bf16-mixed``, gives bit-identical weights to ``strategy="auto"``
   (world size 1: the engine returns the gradient unchanged); and
   ``strategy="eager_sgd_majority"`` is refused at world size 1 with a ValueError.
5. Group model averaging (``GroupAverage``, the engine of ``wagma_sgd`` and
   ``ds_sync``) on CUDA tensors at world size 1 (NCCL): group rounds, global
   rounds (``sync_every``), consensus measurements and the flush give the exact
   model back. (Point-to-point exchanges between ranks need two GPUs.)

Usage::

    python benchmarks/cuda_check.py          # on a GPU machine; SKIPs everything without CUDA
    python benchmarks/cuda_check.py --cpu    # the same logic on CPU tensors (gloo) where that makes sense
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import queue as queue_module
import sys
import threading
import time
import traceback
import warnings
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

from lightning_partial.collectives import PartialAllreduce, PartialAllreduceConfig  # noqa: E402

RESULTS: list[tuple[str, str, str]] = []


def report(status: str, name: str, detail: str = "") -> None:
    RESULTS.append((status, name, detail))
    print(f"{status:<4} {name}" + (f": {detail}" if detail else ""), flush=True)


def local_store(world_size: int = 1) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, world_size, True, timeout=timedelta(seconds=60), wait_for_workers=False)


def timed(name: str, fn: Callable[[], None]) -> None:
    started = time.perf_counter()
    try:
        fn()
    except Exception:  # noqa: BLE001 - one broken item must not hide the others
        report("FAIL", name, "raised:\n" + traceback.format_exc())
    print(f"     ({name}: {time.perf_counter() - started:.1f}s)", flush=True)


# ---------------------------------------------------------------- item 1
STEPS = 30
SLOW_RANK = 1
SLOW_SECONDS = 0.015


def make_grads(rank: int, step: int, device: torch.device, *, delay: bool) -> list[torch.Tensor]:
    """Integer-valued gradients of (rank, step); produced after a short kernel on the current stream."""
    base = float(rank * 1000 + step * 10 + 1)
    if delay and device.type == "cuda":
        torch.cuda._sleep(2_000_000)  # ~1 ms: the engine must wait for the producer's stream
    a = torch.arange(4099, device=device, dtype=torch.float32).remainder_(13).add_(base)
    b = torch.full((3, 5), -base, device=device, dtype=torch.float32)
    c = torch.arange(7, device=device, dtype=torch.float64).mul_(base)
    return [a, b, c]


def _engine_rank(rank: int, world_size: int, port: int, mode: str, device_name: str) -> dict[str, Any]:
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, world_size, False, timeout=timedelta(seconds=60))
    cfg = PartialAllreduceConfig(mode=mode, normalize="sum", timeout=timedelta(seconds=60), seed=3)
    like = make_grads(rank, 0, device, delay=False)
    engine = PartialAllreduce(cfg, store=store, rank=rank, world_size=world_size, like=like, backend="gloo")
    engine.start()
    rounds: list[list[torch.Tensor]] = []
    stats: list[tuple] = []
    acc = [torch.zeros_like(t) for t in like]
    try:
        for step in range(STEPS):
            if rank == SLOW_RANK:
                time.sleep(SLOW_SECONDS)
            result = engine.arrive(make_grads(rank, step, device, delay=True))
            for a, t in zip(acc, result.tensors):
                a.add_(t)  # on the caller's stream, no synchronisation
            rounds.append([t.clone() for t in result.tensors])
            s = result.stats
            stats.append((s.round_index, s.counts, s.oldest_staleness, s.contributions))
            result.release()
        last = engine.flush()
        for a, t in zip(acc, last.tensors):
            a.add_(t)
        rounds.append([t.clone() for t in last.tensors])
        s = last.stats
        stats.append((s.round_index, s.counts, s.oldest_staleness, s.contributions))
    finally:
        engine.close()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return {
        "rounds": [[t.cpu() for t in r] for r in rounds],
        "stats": stats,
        "acc": [a.cpu() for a in acc],
        "backend": engine.backend,
        "device": str(like[0].device),
    }


def _process_entry(rank: int, world_size: int, port: int, mode: str, device_name: str, q: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        buffer = io.BytesIO()  # tensors as bytes: no file descriptors that die with this process
        torch.save(_engine_rank(rank, world_size, port, mode, device_name), buffer)
        q.put((rank, "ok", buffer.getvalue()))
    except BaseException:  # noqa: BLE001
        q.put((rank, "error", traceback.format_exc()))
        raise SystemExit(3)


def run_ranks(world_size: int, target: Callable[..., None], *args: Any, timeout: float = 120.0) -> dict[int, tuple]:
    """Spawns ``target(rank, *args, queue)`` per rank; returns ``{rank: (status, value)}``; never hangs."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, *args, q), daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    reports: dict[int, tuple] = {}
    deadline = time.monotonic() + timeout
    while len(reports) < world_size and time.monotonic() < deadline:
        try:
            rank, status, value = q.get(timeout=0.5)
            reports[rank] = (status, value)
        except queue_module.Empty:
            if all(not p.is_alive() for p in procs) and q.empty():
                break
    for r, p in enumerate(procs):
        p.join(timeout=max(0.1, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(5)
        if r not in reports:
            reports[r] = ("error", f"no report (exit code {p.exitcode}; killed after {timeout}s if None)")
    return reports


def check_processes(device_name: str) -> None:
    world_size = 2
    for mode in ("solo", "majority"):
        name = f"1 engine, 2 processes on {device_name}, gloo, {mode}"
        store = local_store(world_size)
        started = time.perf_counter()
        reports = run_ranks(world_size, _process_entry, world_size, store.port, mode, device_name)
        elapsed = time.perf_counter() - started
        errors = {r: v for r, (s, v) in reports.items() if s != "ok"}
        if errors:
            report("FAIL", name, "; ".join(f"rank {r}: {v}" for r, v in errors.items()))
            continue
        out = [torch.load(io.BytesIO(reports[r][1]), weights_only=False) for r in range(world_size)]
        problems = []
        if out[0]["device"] != device_name and not out[0]["device"].startswith(device_name):
            problems.append(f"tensors on {out[0]['device']}")
        identical = len(out[0]["rounds"]) == len(out[1]["rounds"]) and all(
            all(torch.equal(a, b) for a, b in zip(r0, r1)) for r0, r1 in zip(out[0]["rounds"], out[1]["rounds"])
        )
        if not identical:
            problems.append("per-round results differ between the ranks")
        if out[0]["stats"] != out[1]["stats"]:
            problems.append("per-round stats differ between the ranks")
        expected = [torch.zeros_like(t, dtype=torch.float64) for t in out[0]["acc"]]
        for r in range(world_size):
            for step in range(STEPS):
                for e, g in zip(expected, make_grads(r, step, torch.device("cpu"), delay=False)):
                    e.add_(g.double())
        for r in range(world_size):
            summed = [torch.stack([rd[i].double() for rd in out[r]["rounds"]]).sum(0) for i in range(len(expected))]
            if not all(torch.equal(s, e) for s, e in zip(summed, expected)):
                problems.append(f"rank {r}: sum over rounds != sum contributed")
            if not all(torch.equal(a.double(), e) for a, e in zip(out[r]["acc"], expected)):
                problems.append(f"rank {r}: sum accumulated on the stream != sum contributed")
        stats = out[0]["stats"]
        contributions = sum(s[3] for s in stats)
        if contributions != world_size * STEPS:
            problems.append(f"{contributions} contributions counted, expected {world_size * STEPS}")
        carried = sum(1 for s in stats for st in s[2] if st is not None and st > 0)
        if carried == 0:
            problems.append("no gradient was carried (the slow rank was never late): the check proves little")
        flush = stats[-1]
        detail = (
            f"{len(stats) - 1} rounds + flush in {elapsed:.1f}s, {contributions} contributions, "
            f"{carried} carried (stale) contributions, flush counts={flush[1]}, "
            f"bit-identical ranks={identical}, backend={out[0]['backend']}"
        )
        report("FAIL" if problems else "PASS", name, "; ".join(problems) + (" | " if problems else "") + detail)


# ---------------------------------------------------------------- item 2
def check_world1(device: torch.device, backend: str) -> None:
    def grads(step: int) -> list[torch.Tensor]:
        if device.type == "cuda":
            torch.cuda._sleep(5_000_000)
        base = float(step + 1)
        return [
            torch.arange(1000, device=device, dtype=torch.float32).add_(base),
            torch.full((4, 4), -base, device=device, dtype=torch.float32),
            torch.arange(33, device=device, dtype=torch.bfloat16).remainder_(7).add_(base),
            torch.arange(9, device=device, dtype=torch.float64).mul_(base),
        ]

    for mode in ("solo", "sync"):
        name = f"2 world size 1, backend={backend}, {mode}"
        store = local_store()
        cfg = PartialAllreduceConfig(mode=mode, timeout=timedelta(seconds=60), name=f"w1-{mode}")
        engine = PartialAllreduce(cfg, store=store, rank=0, world_size=1, like=grads(0), backend=backend).start()
        problems = []
        pairs = []
        try:
            for step in range(6):
                g = grads(step)
                sent = [t.clone() for t in g]
                result = engine.arrive(g)
                for t in g:
                    t.fill_(-7)  # overwritten right after arrive: must not change what was sent
                pairs.append((step, sent, [t.clone() for t in result.tensors], result.stats.contributions))
            last_sent = grads(99) if mode == "solo" else None
            last = engine.flush(last_sent)
            flush_expected = last_sent if last_sent is not None else [torch.zeros_like(t) for t in grads(0)]
            pairs.append(("flush", [t.clone() for t in flush_expected], [t.clone() for t in last.tensors],
                          last.stats.contributions))
        finally:
            engine.close()
        if device.type == "cuda":
            torch.cuda.synchronize()
        for step, sent, got, contributions in pairs:
            if not all(torch.equal(s, g) for s, g in zip(sent, got)):
                problems.append(f"round {step}: result differs from the input")
            want = 0 if (step == "flush" and mode == "sync") else 1
            if contributions != want:
                problems.append(f"round {step}: {contributions} contributions, expected {want}")
        detail = f"6 rounds + flush, 4 tensors in {len(engine.layout.buckets)} buckets, backend={engine.backend}"
        report("FAIL" if problems else "PASS", name, "; ".join(problems) + (" | " if problems else "") + detail)


# ---------------------------------------------------------------- item 3
class _SyncWarnings:
    """Records the synchronising-CUDA-call warnings raised on *this* thread (sync debug mode 'warn')."""

    def __enter__(self) -> "_SyncWarnings":
        self.seen: list[str] = []
        self._thread = threading.current_thread()
        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("always")
        previous = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001
            if threading.current_thread() is self._thread and "synchroniz" in str(message):
                self.seen.append(str(message).splitlines()[0][:120])
            elif "synchroniz" not in str(message):
                previous(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: object) -> None:
        torch.cuda.set_sync_debug_mode("default")
        self._catch.__exit__(*exc)


def cycles_per_ms() -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    torch.cuda._sleep(20_000_000)
    end.record()
    torch.cuda.synchronize()
    return 20_000_000 / start.elapsed_time(end)


def check_no_host_sync(device: torch.device, backends: tuple[str, ...] = ("nccl", "gloo"), label: str = "") -> None:
    rate = cycles_per_ms()
    kernel_ms = 200.0
    cycles = int(kernel_ms * rate)
    n = 1 << 20
    with _SyncWarnings() as control:
        torch.zeros(1, device=device).item()  # positive control: a synchronising call
    instrument_ok = bool(control.seen)
    report("PASS" if instrument_ok else "FAIL", f"3 sync-debug instrument{label}",
           f"positive control (.item()) recorded {len(control.seen)} warning(s); sleep rate {rate:.0f} cycles/ms")
    for backend in backends:
        store = local_store()
        cfg = PartialAllreduceConfig(mode="solo", timeout=timedelta(seconds=60), name=f"nosync-{backend}")
        engine = PartialAllreduce(cfg, store=store, rank=0, world_size=1,
                                  like=torch.zeros(n, device=device), backend=backend).start()
        stream = torch.cuda.current_stream(device)
        rows = []
        try:
            for _ in range(3):  # warm-up (NCCL communicator creation, allocator)
                engine.arrive(torch.ones(n, device=device)).release()
            for rep in range(3):
                g = torch.empty(n, device=device)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                torch.cuda._sleep(cycles)
                g.fill_(float(rep + 3))  # the gradient is produced after the long kernel, on the same stream
                with _SyncWarnings() as caller:
                    result = engine.arrive(g)
                t_arrive = time.perf_counter() - t0
                busy = not stream.query()  # is the long kernel (or what follows it) still running?
                out = result.tensors[0].clone()  # read on the caller's stream
                torch.cuda.synchronize()
                t_done = time.perf_counter() - t0
                correct = bool(torch.all(out == float(rep + 3)).item())
                rows.append((t_arrive * 1e3, t_done * 1e3, busy, correct, list(caller.seen)))
        finally:
            engine.close()
        detail = "; ".join(f"arrive {a:.1f} ms, kernel done {d:.1f} ms, stream busy after arrive={b}"
                           for a, d, b, _, _ in rows)
        syncs = [s for *_, seen in rows for s in seen]
        report("PASS" if not syncs and instrument_ok else "FAIL",
               f"3 {backend}{label}: no synchronising CUDA call on the caller's thread in arrive",
               f"{len(syncs)} seen" + (f": {syncs[:2]}" if syncs else ""))
        early = all(a < 0.5 * d and b for a, d, b, _, _ in rows)
        if backend == "nccl":
            report("PASS" if early else "FAIL",
                   f"3 nccl{label}: arrive returns before the {kernel_ms:.0f} ms kernel finishes", detail)
        else:
            report("INFO", f"3 gloo{label}: arrive {'does not block' if early else 'blocks'} on the kernel "
                   "(gloo stages CUDA tensors through host memory)", detail)
        report("PASS" if all(c for *_, c, _ in rows) else "FAIL", f"3 {backend}{label}: result correct after synchronize",
               f"{sum(c for *_, c, _ in rows)}/{len(rows)}")


# ---------------------------------------------------------------- item 4
def _fit_entry(rank: int, case: str, accelerator: str, q: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        q.put((rank, "ok", _fit_case(case, accelerator)))
    except BaseException:  # noqa: BLE001
        q.put((rank, "error", traceback.format_exc()))
        raise SystemExit(3)


def _fit_case(case: str, accelerator: str) -> dict[str, Any]:
    import lightning as L
    from torch import nn
    from torch.nn import functional as F
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_partial  # noqa: F401 - registers "eager_sgd" and friends

    for logger_name in ("lightning", "lightning.pytorch", "lightning.fabric", "lightning_partial"):
        logging.getLogger(logger_name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")

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
                self.seen["pg_backend"] = dist.get_backend()
                self.seen["round"] = strategy.round_stats[0].round_index
            self.seen["grad_device"] = str(self.net[0].weight.grad.device)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

        def train_dataloader(self) -> DataLoader:
            gen = torch.Generator().manual_seed(1)
            x = torch.randn(256, 8, generator=gen)
            y = x.sum(1, keepdim=True).sin()
            return DataLoader(TensorDataset(x, y), batch_size=16, shuffle=False)

    def fit(strategy: str, precision: str) -> tuple[dict[str, torch.Tensor], Any, Any]:
        torch.manual_seed(0)
        model = Tiny()
        model.initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
        trainer = L.Trainer(strategy=strategy, accelerator=accelerator, devices=1, max_steps=20, precision=precision,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, num_sanity_val_steps=0,
                            use_distributed_sampler=False)  # the same batches as strategy="auto"
        trainer.fit(model)
        return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}, model, trainer

    try:
        if case == "majority":
            try:
                fit("eager_sgd_majority", "32-true")
            except ValueError as err:
                return {"raised": "ValueError", "message": str(err)}
            except Exception as err:  # noqa: BLE001
                return {"raised": type(err).__name__, "message": str(err)}
            return {"raised": None, "message": ""}
        precision = {"fp32": "32-true", "bf16": "bf16-mixed"}[case]
        started = time.perf_counter()
        reference, _, _ = fit("auto", precision)
        t_ref = time.perf_counter() - started
        started = time.perf_counter()
        weights, model, trainer = fit("eager_sgd", precision)
        t_eager = time.perf_counter() - started
        diff = max((weights[k].double() - reference[k].double()).abs().max().item() for k in reference)
        return {
            "identical": all(torch.equal(weights[k], reference[k]) for k in reference),
            "max_diff": diff,
            "finite": all(torch.isfinite(v).all().item() for v in weights.values()),
            "trained": any(not torch.equal(weights[k], model.initial[k]) for k in reference),
            "global_step": trainer.global_step,
            "flush_round": trainer.strategy.round_stats[0].round_index if trainer.strategy.round_stats else None,
            "strategy": type(trainer.strategy).__name__,
            "seen": model.seen,
            "t_ref": t_ref,
            "t_eager": t_eager,
        }
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def check_lightning(accelerator: str) -> None:
    for case in ("fp32", "bf16"):
        name = f"4 Lightning eager_sgd, {accelerator}, devices=1, {'32-true' if case == 'fp32' else 'bf16-mixed'}"
        status, out = run_ranks(1, _fit_entry, case, accelerator, timeout=300)[0]
        if status != "ok":
            report("FAIL", name, out)
            continue
        problems = []
        seen = out["seen"]
        if out["global_step"] != 20:
            problems.append(f"global_step={out['global_step']}")
        if not out["trained"]:
            problems.append("the weights did not change")
        if not out["finite"]:
            problems.append("non-finite weights")
        if not out["identical"] and out["max_diff"] > 1e-6:
            problems.append(f"weights differ from strategy='auto' (max |diff| {out['max_diff']:.3g})")
        if out["flush_round"] != 20:
            problems.append(f"last round {out['flush_round']}, expected the flush at round 20")
        want_device = "cuda" if accelerator == "gpu" else "cpu"
        if not seen.get("engine_device", "").startswith(want_device) or not seen.get("grad_device", "").startswith(
            want_device
        ):
            problems.append(f"engine/gradients not on {want_device}: {seen}")
        detail = (
            f"{out['strategy']}, {out['global_step']} steps, last round {out['flush_round']} (flush), "
            f"engine backend={seen.get('engine_backend')}, default group={seen.get('pg_backend')}, "
            f"weights bit-identical to strategy='auto'={out['identical']} (max |diff| {out['max_diff']:.2g}), fit {out['t_eager']:.1f}s "
            f"(auto {out['t_ref']:.1f}s)"
        )
        report("FAIL" if problems else "PASS", name, "; ".join(problems) + (" | " if problems else "") + detail)
    name = f"4 Lightning eager_sgd_majority, {accelerator}, devices=1: refused"
    status, out = run_ranks(1, _fit_entry, "majority", accelerator, timeout=300)[0]
    if status != "ok":
        report("FAIL", name, out)
    elif out["raised"] == "ValueError" and "majority" in out["message"]:
        report("PASS", name, f"ValueError: {out['message']}")
    else:
        report("FAIL", name, f"expected a ValueError naming 'majority', got {out['raised']}: {out['message']}")


def check_group_average(device: torch.device, backend: str) -> None:
    from lightning_partial.collectives import ButterflySchedule, GroupAverage, apply_average

    name = f"5 GroupAverage world size 1, backend={backend}"
    store = local_store()
    cfg = PartialAllreduceConfig(mode="solo", normalize="sum", sync_every=3, timeout=timedelta(seconds=60), name="ga")
    w = [torch.arange(1000, device=device, dtype=torch.float32), torch.ones(7, device=device, dtype=torch.bfloat16)]
    engine = GroupAverage(cfg, schedule=ButterflySchedule(world_size=1, group_size=1), store=store, rank=0,
                          world_size=1, like=w, backend=backend, measure_every=2).start()
    consensus = []
    try:
        for _ in range(7):
            for t in w:
                t.add_(1)
            result = engine.arrive(w)
            apply_average(result, w)
            consensus.append(result.stats.consensus)
            result.release()
        last = engine.flush(w)
        apply_average(last, w)
        consensus.append(last.stats.consensus)
    finally:
        engine.close()
    if device.type == "cuda":
        torch.cuda.synchronize()
    ok = torch.equal(w[0], torch.arange(1000, device=device, dtype=torch.float32) + 7) and torch.equal(
        w[1], torch.full((7,), 8.0, device=device, dtype=torch.bfloat16)
    )
    measured = [c for c in consensus if c is not None]
    problems = ([] if ok else ["the model changed"]) + ([] if measured and all(c == 0 for c in measured) else
                                                          [f"consensus {consensus}"])
    report("FAIL" if problems else "PASS", name, "; ".join(problems) or
           f"7 rounds + flush exact, engine backend={engine.backend}, consensus measured {len(measured)}x (0.0)")


# ------------------------------------------------------------------ main
def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true",
                        help="run what can run without a GPU on CPU tensors (gloo): a check of this script")
    parser.add_argument("--only", default="12345", help="which items to run, e.g. '13'")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    print(f"torch {torch.__version__}, CUDA available: {cuda}"
          + (f", {torch.cuda.get_device_name(0)}, NCCL {torch.cuda.nccl.version()}" if cuda else ""), flush=True)
    started = time.perf_counter()
    if cuda:
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        if "1" in args.only:
            timed("item 1", lambda: check_processes("cuda:0"))
        if "2" in args.only:
            timed("item 2", lambda: check_world1(device, "nccl"))
        if "3" in args.only:
            timed("item 3", lambda: check_no_host_sync(device))
        if "4" in args.only:
            timed("item 4", lambda: check_lightning("gpu"))
        if "5" in args.only:
            timed("item 5", lambda: check_group_average(device, "nccl"))
    elif args.cpu:
        if "1" in args.only:
            timed("item 1", lambda: check_processes("cpu"))
        if "2" in args.only:
            timed("item 2", lambda: check_world1(torch.device("cpu"), "gloo"))
        report("SKIP", "3 no host sync on the compute stream", "needs CUDA")
        if "4" in args.only:
            timed("item 4", lambda: check_lightning("cpu"))
        if "5" in args.only:
            timed("item 5", lambda: check_group_average(torch.device("cpu"), "gloo"))
    else:
        for item in ("1 engine across 2 processes on cuda:0", "2 NCCL data path, world size 1",
                     "3 no host sync on the compute stream", "4 Lightning eager_sgd on one GPU",
                     "5 GroupAverage on CUDA tensors"):
            report("SKIP", item, "no CUDA device")
    failed = [r for r in RESULTS if r[0] == "FAIL"]
    print(f"{'FAILED' if failed else 'OK'}: {len(failed)} failed, "
          f"{sum(r[0] == 'PASS' for r in RESULTS)} passed, {sum(r[0] == 'SKIP' for r in RESULTS)} skipped "
          f"in {time.perf_counter() - started:.1f}s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
