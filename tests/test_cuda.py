"""Single-GPU tests of the engines and of ``strategy="eager_sgd"``.

Every GPU test is marked ``cuda`` and skipped without a CUDA device (``CUDA_ONLY``,
in the style of Lightning's ``RunIf(min_cuda_gpus=1)``). A module-level
``pytestmark`` would also mark the CPU variants below, so the two marks are
applied per test. On a GPU machine::

    python3 -m pytest -m cuda tests/test_cuda.py tests/test_staleness.py

One GPU only: NCCL refuses two ranks on one device, so the two-process test uses
``backend="gloo"`` on CUDA tensors, and every NCCL test runs at world size 1.

Processes (nothing CUDA or distributed runs in the pytest process):

* The NCCL tests run in a spawned **worker** with a NCCL default group of world
  size 1 (``init_process_group`` with ``device_id``, as Lightning on one GPU):
  a NCCL engine makes its data group with ``dist.new_group``. The worker is
  shared by the tests of this module (one start-up) and serves one check per
  request, each with its own deadline; a worker whose check failed or hung is
  ended (killed if need be) and the next test starts a fresh one. The
  completion-bound test aborts a NCCL group, so it gets a worker of its own.
* The two-rank test spawns its two ranks.
* The Lightning fits run ``tests/scripts/cuda_fit.py`` once for all their cases
  (a Lightning import per case would dominate the runtime).

The checks are module-level functions with assertions inside, so that the CPU
variants (``[cpu]``: items 2, 5, 6 without the long kernel, and 7's allocation
count; gloo, host tensors, well under a second) run the very same code in the
pytest process. Item 1's check runs on the host too (``check_two_processes("cpu")``),
but its two processes cost 6-11 s of start-up on a 2-core machine: not a CI test.

Items:

1. ``test_two_processes_gloo_on_cuda``: 2 processes on ``cuda:0``, gloo, solo and
   majority, rank 1 slow: per-round results bit-identical on both ranks, conserved.
2. ``test_world1_exact``: the NCCL data path at world size 1 (4 tensors, 3 dtypes).
3. ``test_arrive_makes_no_host_sync``: no synchronising CUDA call in ``arrive``;
   with NCCL, ``arrive`` returns while the producer's 200 ms kernel still runs.
4. ``test_eager_sgd_bit_identical_to_auto``, ``test_eager_sgd_majority_refused_at_world_size_1``.
5. ``test_group_average_world1``: group/global rounds, consensus and flush give the model back.
6. ``test_delayed_checkpoint_behind_long_kernel``: DelayedAllreduce's state taken while
   the latest round's result is still behind a long kernel, restored into a fresh engine.
7. ``test_steady_state_memory``: peak memory and buffer-set allocations bounded.
8. ``test_completion_watch_times_out``: a round stuck behind a 4 s kernel fails the engine
   after its 1 s timeout, naming rank 0 and the round; ``close()`` returns.
9. ``test_nccl_only_on_the_communication_thread``: in a one-GPU fit, every NCCL
   collective during fit comes from the engine's communication thread; the
   strategy's own collectives (``sync_dist``, ``all_gather``, ``barrier``) run on gloo.
10. ``test_abs_sgd_adamw_retimes_on_the_device``: ``abs_sgd`` (``delay=1``) with AdamW on one GPU
    (``32-true``, ``bf16-mixed``): every step after the first re-timed through Adam's moments on the
    device (``compensation.retime_adam``), the weights finite, the training loss lower. The
    formula's own CUDA checks are ``tests/test_staleness.py``'s ``[cuda]`` variants (``python3 -m pytest -m cuda tests/test_cuda.py tests/test_staleness.py``).
"""

from __future__ import annotations

import contextlib
import io
import json
import multiprocessing
import os
import queue as queue_module
import subprocess
import sys
import threading
import time
import traceback
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import pytest
import torch
import torch.distributed as dist

from tests.scripts.ports import RANK_VARIABLES  # the rendezvous variables a subprocess must not inherit

#: Every GPU test: selected by ``-m cuda``, skipped without a CUDA device.
CUDA_ONLY = (pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"))

#: Peak memory of the engine beyond the caller's inputs, in model sizes, at world size 1
#: with NCCL over rounds 5..50 (each result released). Measured on an H100 (torch 2.11):
#: PartialAllreduce 1.0, GroupAverage 3.5 (benchmarks/results/cuda_tests.json); the bounds
#: are docs/cuda.md's table (2 M balanced; S + 3 M for groups of S = 1).
#: PartialAllreduce: a round's buffer set is the deposit itself (reduced in place) and
#: is pooled on release: about 1 model expected.
PARTIAL_ALLREDUCE_PEAK_MODELS = 2.0
#: GroupAverage: the send buffer, the group sum handed out, a consensus copy, and
#: apply_average's and the consensus' temporaries: about 3.5 models expected.
GROUP_AVERAGE_PEAK_MODELS = 4.0
#: The model of the memory test: 4 float32 tensors of 16 MiB (64 MiB).
MEMORY_NUMEL = 4 << 20
MEMORY_ROUNDS = 50
MEMORY_WARMUP = 5

ROOT = Path(__file__).resolve().parent.parent
FIT_SCRIPT = "tests.scripts.cuda_fit"  # run as `python -m` from the repository root
FIT_CASES = ("fp32", "bf16", "majority", "invariant", "abs_adamw", "overlap")


def run_if_cuda(test: Callable) -> Callable:
    for mark in CUDA_ONLY:
        test = mark(test)
    return test


def cuda_param(*values: Any) -> Any:
    return pytest.param(*values, marks=CUDA_ONLY, id="cuda")


# ====================================================================== helpers
def local_store(world_size: int = 1) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, world_size, True, timeout=timedelta(seconds=60), wait_for_workers=False)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


_RATE: dict[str, float] = {}


def cycles_per_ms() -> float:
    """``torch.cuda._sleep`` cycles per millisecond on this GPU (measured once)."""
    if "rate" not in _RATE:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        torch.cuda._sleep(20_000_000)
        end.record()
        torch.cuda.synchronize()
        _RATE["rate"] = 20_000_000 / start.elapsed_time(end)
    return _RATE["rate"]


def _sleep_kernel(ms: float) -> None:
    torch.cuda._sleep(int(ms * cycles_per_ms()))


def _equal(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    return len(got) == len(want) and all(
        g.shape == w.shape and torch.equal(g.detach().double().cpu(), w.detach().double().cpu())
        for g, w in zip(got, want)
    )


# ============================================================ worker processes
def _serve(requests: Any, replies: Any, default_backend: Optional[str], cuda: bool) -> None:
    """A spawned worker: CUDA device 0 and a default group of world size 1 (``default_backend``, if any),
    then ``name(*args)`` (a function of this module) per request, until ``None``."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        if cuda:
            torch.cuda.set_device(0)
        if default_backend is not None:
            store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=60), wait_for_workers=False)
            dist.init_process_group(default_backend, store=store, rank=0, world_size=1, timeout=timedelta(seconds=120),
                                    device_id=torch.device("cuda", 0) if cuda else None)
        replies.put(("ready", torch.cuda.get_device_name(0) if cuda else "cpu"))
    except BaseException:  # noqa: BLE001
        replies.put(("error", traceback.format_exc()))
        return
    while True:
        item = requests.get()
        if item is None:
            break
        name, args = item
        try:
            replies.put(("ok", globals()[name](*args)))
        except BaseException:  # noqa: BLE001 - handed to the test
            replies.put(("error", traceback.format_exc()))
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
        replies.put(("closed", None))
    except BaseException:  # noqa: BLE001
        replies.put(("error", "teardown:\n" + traceback.format_exc()))


class Worker:
    """The parent's handle on a :func:`_serve` process; every wait is bounded."""

    def __init__(self, *, default_backend: Optional[str] = "nccl", cuda: bool = True,
                 start_timeout: float = 180.0) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._requests = ctx.Queue()
        self._replies = ctx.Queue()
        self._process = ctx.Process(target=_serve, args=(self._requests, self._replies, default_backend, cuda),
                                    daemon=True)
        self._process.start()
        status, value = self._reply(start_timeout, "start-up")
        if status != "ready":
            self.kill()
            pytest.fail(f"the CUDA worker did not start:\n{value}", pytrace=False)
        self.device_name = value

    @property
    def alive(self) -> bool:
        return self._process.is_alive()

    def _reply(self, timeout: float, what: str) -> tuple[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self._replies.get(timeout=0.5)
            except queue_module.Empty:
                if not self._process.is_alive():
                    try:
                        return self._replies.get(timeout=1.0)
                    except queue_module.Empty:
                        return "error", f"the worker died during {what} (exit code {self._process.exitcode})"
                if time.monotonic() > deadline:
                    self.kill()
                    return "error", f"the worker did not finish {what} within {timeout:g}s: killed (a hang)"

    def call(self, name: str, *args: Any, timeout: float) -> Any:
        """Runs ``name(*args)`` (a function of this module) in the worker; fails the test with its traceback."""
        self._requests.put((name, args))
        status, value = self._reply(timeout, name)
        if status != "ok":
            pytest.fail(f"{name}{args} in the CUDA worker:\n{value}", pytrace=False)
        return value

    def close(self, timeout: float = 30.0) -> Optional[str]:
        """Ends the worker (its process group destroyed); returns what went wrong, if anything."""
        if not self._process.is_alive():
            return None
        self._requests.put(None)
        status, value = self._reply(timeout, "teardown")
        self._process.join(timeout=5)
        if self._process.is_alive():
            self.kill()
        return None if status == "closed" else str(value)

    def kill(self) -> None:
        if self._process.is_alive():
            self._process.kill()
            self._process.join(timeout=10)


class WorkerPool:
    """One shared worker, started on first use, replaced after any failed check."""

    def __init__(self, **options: Any) -> None:
        self.options = options
        self._worker: Optional[Worker] = None
        self.problems: list[str] = []

    def call(self, name: str, *args: Any, timeout: float) -> Any:
        if self._worker is None or not self._worker.alive:
            self._worker = Worker(**self.options)
        try:
            return self._worker.call(name, *args, timeout=timeout)
        except BaseException:
            # A failed check may leave its process in a bad state (an aborted NCCL group, a
            # stuck thread, a sticky CUDA error): the next test gets a fresh worker.
            worker, self._worker = self._worker, None
            worker.close(timeout=10)
            worker.kill()
            raise

    def close(self) -> None:
        if self._worker is not None:
            problem = self._worker.close()
            if problem:
                self.problems.append(problem)


def _check_on(device: str, request: Any, name: str) -> Any:
    """Runs the check ``name(device_name, backend)`` here on host tensors (gloo), or in the NCCL worker on cuda:0."""
    if device == "cpu":
        return globals()[name]("cpu", "gloo")
    return request.getfixturevalue("nccl_worker").call(name, "cuda:0", "nccl", timeout=120)


@pytest.fixture(scope="module")
def nccl_worker():
    """A worker with a NCCL default group of world size 1, shared by this module's NCCL tests."""
    pool = WorkerPool(default_backend="nccl")
    yield pool
    pool.close()
    if pool.problems:
        pytest.fail("the NCCL worker's teardown (destroy_process_group) failed:\n" + "\n".join(pool.problems),
                    pytrace=False)


def _rank_entry(target: Callable[..., Any], rank: int, world_size: int, port: int, args: tuple, q: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        q.put((rank, "ok", target(rank, world_size, port, *args)))
    except BaseException:  # noqa: BLE001
        q.put((rank, "error", traceback.format_exc()))
        raise SystemExit(3) from None


def spawn_ranks(world_size: int, target: Callable[..., Any], *args: Any, timeout: float) -> dict[int, Any]:
    """``target(rank, world_size, port, *args)`` in ``world_size`` spawned processes; their return values.

    Reads the reports while it waits (a report larger than a pipe's buffer keeps its
    process alive until it is read); fails the test on an error or after ``timeout``.
    """
    store = local_store(world_size)
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank_entry, args=(target, r, world_size, store.port, args, q), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    reports: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    while len(reports) < world_size and time.monotonic() < deadline:
        try:
            rank, status, value = q.get(timeout=0.5)
            reports[rank] = (status, value)
        except queue_module.Empty:
            if all(not p.is_alive() for p in procs):
                with contextlib.suppress(queue_module.Empty):
                    while len(reports) < world_size:
                        rank, status, value = q.get(timeout=1.0)
                        reports[rank] = (status, value)
                break
    for r, p in enumerate(procs):
        p.join(timeout=max(0.1, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(5)
        if r not in reports:
            reports[r] = ("error", f"no report (exit code {p.exitcode}; None: killed after {timeout:g}s)")
    errors = {r: v for r, (s, v) in reports.items() if s != "ok"}
    if errors:
        pytest.fail("\n".join(f"rank {r}:\n{v}" for r, v in sorted(errors.items())), pytrace=False)
    return {r: v for r, (_, v) in reports.items()}


# ============================================================ 1: two processes
TWO_STEPS = 30
SLOW_RANK = 1
SLOW_SECONDS = 0.015


def two_rank_grads(rank: int, step: int, device: torch.device, *, delay: bool) -> list[torch.Tensor]:
    """Integer-valued gradients of (rank, step), produced after a short kernel on the current stream."""
    base = float(rank * 1000 + step * 10 + 1)
    if delay and device.type == "cuda":
        torch.cuda._sleep(2_000_000)  # ~1 ms: the engine must wait for the producer's stream
    a = torch.arange(4099, device=device, dtype=torch.float32).remainder_(13).add_(base)
    b = torch.full((3, 5), -base, device=device, dtype=torch.float32)
    c = torch.arange(7, device=device, dtype=torch.float64).mul_(base)
    return [a, b, c]


def two_rank_run(rank: int, world_size: int, port: int, device_name: str) -> bytes:
    """One rank of item 1: both modes, one engine each; returns everything it saw (``torch.save`` bytes)."""
    from lightning_partial.collectives import PartialAllreduce, PartialAllreduceConfig

    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, world_size, False, timeout=timedelta(seconds=60))
    out: dict[str, Any] = {}
    for mode in ("solo", "majority"):
        cfg = PartialAllreduceConfig(mode=mode, normalize="sum", timeout=timedelta(seconds=60), seed=3,
                                     name=f"two-{mode}")
        like = two_rank_grads(rank, 0, device, delay=False)
        engine = PartialAllreduce(cfg, store=store, rank=rank, world_size=world_size, like=like,
                                  backend="gloo").start()
        rounds, stats = [], []
        acc = [torch.zeros_like(t) for t in like]
        try:
            for step in range(TWO_STEPS):
                if rank == SLOW_RANK:
                    time.sleep(SLOW_SECONDS)
                result = engine.arrive(two_rank_grads(rank, step, device, delay=True))
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
        _synchronize(device)
        out[mode] = {"rounds": [[t.cpu() for t in r] for r in rounds], "stats": stats, "acc": [a.cpu() for a in acc],
                     "device": str(like[0].device), "backend": engine.backend}
    buffer = io.BytesIO()  # tensors as bytes: no file descriptors that die with this process
    torch.save(out, buffer)
    return buffer.getvalue()


def check_two_processes(device_name: str) -> None:
    world_size = 2
    raw = spawn_ranks(world_size, two_rank_run, device_name, timeout=150)
    per_rank = [torch.load(io.BytesIO(raw[r]), weights_only=False) for r in range(world_size)]
    cpu = torch.device("cpu")
    expected = [torch.zeros_like(t, dtype=torch.float64) for t in two_rank_grads(0, 0, cpu, delay=False)]
    for r in range(world_size):
        for step in range(TWO_STEPS):
            for e, g in zip(expected, two_rank_grads(r, step, cpu, delay=False)):
                e.add_(g.double())
    for mode in ("solo", "majority"):
        out = [per_rank[r][mode] for r in range(world_size)]
        assert out[0]["device"].startswith(device_name.split(":")[0]), out[0]["device"]
        assert out[0]["backend"] == "gloo"
        assert len(out[0]["rounds"]) == len(out[1]["rounds"]) == TWO_STEPS + 1, mode
        for i, (r0, r1) in enumerate(zip(out[0]["rounds"], out[1]["rounds"])):
            assert all(torch.equal(a, b) for a, b in zip(r0, r1)), f"{mode}: round {i} differs between the ranks"
        assert out[0]["stats"] == out[1]["stats"], f"{mode}: per-round stats differ between the ranks"
        for r in range(world_size):
            summed = [torch.stack([rd[i].double() for rd in out[r]["rounds"]]).sum(0) for i in range(len(expected))]
            assert all(torch.equal(s, e) for s, e in zip(summed, expected)), (
                f"{mode}, rank {r}: the sum over the rounds and the flush differs from the sum contributed"
            )
            assert all(torch.equal(a.double(), e) for a, e in zip(out[r]["acc"], expected)), (
                f"{mode}, rank {r}: the sum accumulated on the caller's stream differs from the sum contributed"
            )
        stats = out[0]["stats"]
        assert sum(s[3] for s in stats) == world_size * TWO_STEPS, f"{mode}: contributions {[s[3] for s in stats]}"
        carried = sum(1 for s in stats for st in s[2] if st is not None and st > 0)
        assert carried > 0, f"{mode}: no gradient was carried (rank {SLOW_RANK} was never late): the test proves little"


@run_if_cuda
@pytest.mark.timeout(240)
def test_two_processes_gloo_on_cuda():
    """Item 1: the engine on CUDA tensors across 2 processes on cuda:0 (gloo), solo and majority, rank 1 slow."""
    check_two_processes("cuda:0")


# =========================================================== 2: world size 1
def world1_grads(step: int, device: torch.device) -> list[torch.Tensor]:
    if device.type == "cuda":
        torch.cuda._sleep(5_000_000)  # the gradient comes after a kernel: the engine must wait for it
    base = float(step + 1)
    return [
        torch.arange(1000, device=device, dtype=torch.float32).add_(base),
        torch.full((4, 4), -base, device=device, dtype=torch.float32),
        torch.arange(33, device=device, dtype=torch.bfloat16).remainder_(7).add_(base),
        torch.arange(9, device=device, dtype=torch.float64).mul_(base),
    ]


def check_world1(device_name: str, backend: str) -> dict[str, Any]:
    """Item 2: rounds and the flush at world size 1 give the exact inputs back (solo and sync)."""
    from lightning_partial.collectives import PartialAllreduce, PartialAllreduceConfig

    device = torch.device(device_name)
    info: dict[str, Any] = {}
    for mode in ("solo", "sync"):
        cfg = PartialAllreduceConfig(mode=mode, timeout=timedelta(seconds=60), name=f"w1-{mode}")
        engine = PartialAllreduce(cfg, store=local_store(), rank=0, world_size=1, like=world1_grads(0, device),
                                  backend=backend).start()
        pairs = []
        try:
            for step in range(6):
                g = world1_grads(step, device)
                sent = [t.clone() for t in g]
                result = engine.arrive(g)
                for t in g:
                    t.fill_(-7)  # overwritten right after arrive: must not change what was sent
                pairs.append((step, sent, [t.clone() for t in result.tensors], result.stats.contributions))
                result.release()
            last_sent = world1_grads(99, device) if mode == "solo" else None
            last = engine.flush(last_sent)
            want = last_sent if last_sent is not None else [torch.zeros_like(t) for t in world1_grads(0, device)]
            pairs.append(("flush", [t.clone() for t in want], [t.clone() for t in last.tensors],
                          last.stats.contributions))
        finally:
            engine.close()
        _synchronize(device)
        assert engine.backend == backend
        assert len(engine.layout.buckets) == 3, engine.layout.buckets
        for step, sent, got, contributions in pairs:
            assert _equal(got, sent), f"{mode}, round {step}: the result differs from the input"
            want_contributions = 0 if (step == "flush" and mode == "sync") else 1
            assert contributions == want_contributions, f"{mode}, round {step}: {contributions} contributions"
        info[mode] = {"buckets": len(engine.layout.buckets), "backend": engine.backend}
    return info


@pytest.mark.timeout(180)
@pytest.mark.parametrize("device", ["cpu", cuda_param("cuda")])
def test_world1_exact(device, request):
    """Item 2: the data path at world size 1 (NCCL on CUDA, gloo on the host): exact inputs back."""
    _check_on(device, request, "check_world1")


# ============================================================ 3: no host sync
class CallerSyncWarnings:
    """Records the synchronising-CUDA-call warnings raised on *this* thread (sync debug mode ``"warn"``).

    For gloo: its worker threads stage CUDA tensors through host memory with stream
    synchronisations, which ``"error"`` mode (process-wide) would turn into failed rounds.
    """

    def __enter__(self) -> "CallerSyncWarnings":
        self.seen: list[str] = []
        self._thread = threading.current_thread()
        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("always")
        previous = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001
            if "synchroniz" in str(message):
                if threading.current_thread() is self._thread:
                    self.seen.append(str(message).splitlines()[0][:160])
            else:
                previous(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: object) -> None:
        torch.cuda.set_sync_debug_mode("default")
        self._catch.__exit__(*exc)


@contextlib.contextmanager
def sync_debug_error():
    """``torch.cuda.set_sync_debug_mode("error")`` (process-wide) for the block."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def check_no_host_sync(backend: str) -> dict[str, Any]:
    """Item 3: ``arrive`` makes no synchronising CUDA call; with NCCL it returns while the producer's kernel runs."""
    from lightning_partial.collectives import PartialAllreduce, PartialAllreduceConfig

    device = torch.device("cuda", 0)
    kernel_ms = 200.0
    # Positive controls: the instruments catch a synchronising call.
    with pytest.raises(RuntimeError, match="synchroniz"):
        with sync_debug_error():
            torch.zeros(1, device=device).item()
    with CallerSyncWarnings() as control:
        torch.zeros(1, device=device).item()
    assert control.seen, "sync debug mode 'warn' recorded no warning for .item()"

    n = 1 << 20
    cfg = PartialAllreduceConfig(mode="solo", timeout=timedelta(seconds=60), name=f"nosync-{backend}")
    engine = PartialAllreduce(cfg, store=local_store(), rank=0, world_size=1, like=torch.zeros(n, device=device),
                              backend=backend).start()
    rows = []
    try:
        for _ in range(3):  # warm-up (communicator, allocator, pool)
            engine.arrive(torch.ones(n, device=device)).release()
        for rep in range(3):
            g = torch.empty(n, device=device)
            torch.cuda.synchronize()
            _sleep_kernel(kernel_ms)
            kernel_done = torch.cuda.Event()
            kernel_done.record()
            g.fill_(float(rep + 3))  # the gradient is produced after the long kernel, on the same stream
            seen: list[str] = []
            if backend == "nccl":
                with sync_debug_error():  # any synchronising CUDA call in arrive raises here
                    result = engine.arrive(g)
            else:
                with CallerSyncWarnings() as caller:
                    result = engine.arrive(g)
                seen = caller.seen
            running = not kernel_done.query()  # right after arrive: is the long kernel still running?
            out = result.tensors[0].clone()  # read on the caller's stream
            result.release()
            torch.cuda.synchronize()
            correct = bool(torch.all(out == float(rep + 3)).item())
            rows.append({"kernel_running_after_arrive": running, "correct": correct, "syncs": seen})
    finally:
        engine.close()
    assert all(r["correct"] for r in rows), f"wrong results after synchronize: {rows}"
    assert not any(r["syncs"] for r in rows), f"synchronising CUDA calls on the caller's thread in arrive: {rows}"
    if backend == "nccl":
        assert all(r["kernel_running_after_arrive"] for r in rows), (
            f"arrive did not return before the {kernel_ms:g} ms kernel finished (it waited for the GPU): {rows}"
        )
    return {"rows": rows, "cycles_per_ms": cycles_per_ms()}


@run_if_cuda
@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_arrive_makes_no_host_sync(backend, nccl_worker):
    """Item 3 (NCCL: sync debug mode "error"; gloo, whose rounds stage through the host: "warn", caller's thread)."""
    nccl_worker.call("check_no_host_sync", backend, timeout=120)


# ======================================================== 5: group averaging
def check_group_average(device_name: str, backend: str) -> dict[str, Any]:
    """Item 5: GroupAverage at world size 1: group rounds, global rounds, consensus and flush give the model back."""
    from lightning_partial.collectives import ButterflySchedule, GroupAverage, PartialAllreduceConfig, apply_average

    device = torch.device(device_name)
    cfg = PartialAllreduceConfig(mode="solo", normalize="sum", sync_every=3, timeout=timedelta(seconds=60), name="ga")
    w = [torch.arange(1000, device=device, dtype=torch.float32), torch.ones(7, device=device, dtype=torch.bfloat16)]
    engine = GroupAverage(cfg, schedule=ButterflySchedule(world_size=1, group_size=1), store=local_store(), rank=0,
                          world_size=1, like=w, backend=backend, measure_every=2).start()
    consensus, global_rounds = [], 0
    try:
        for _ in range(7):
            for t in w:
                t.add_(1)
            result = engine.arrive(w)
            apply_average(result, w)
            consensus.append(result.stats.consensus)
            global_rounds += result.stats.group_id == -1
            result.release()
        last = engine.flush(w)
        apply_average(last, w)
        consensus.append(last.stats.consensus)
        last.release()
    finally:
        engine.close()
    _synchronize(device)
    assert engine.backend == backend
    assert torch.equal(w[0].cpu(), torch.arange(1000, dtype=torch.float32) + 7), "the model changed"
    assert torch.equal(w[1].cpu(), torch.full((7,), 8.0, dtype=torch.bfloat16)), "the model changed"
    measured = [c for c in consensus if c is not None]
    assert measured and all(c == 0 for c in measured), f"consensus distances {consensus}"
    assert global_rounds == 2, f"{global_rounds} global rounds in 7 (sync_every=3: rounds 2 and 5)"
    return {"consensus": consensus}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("device", ["cpu", cuda_param("cuda")])
def test_group_average_world1(device, request):
    """Item 5: GroupAverage at world size 1 (NCCL on CUDA)."""
    _check_on(device, request, "check_group_average")


def _nccl_inits(log_dir: str) -> int:
    """Communicators created so far in this process, from NCCL's debug log ("Init COMPLETE" per communicator)."""
    return sum(f.read_text(errors="replace").count("Init COMPLETE") for f in Path(log_dir).glob("nccl.*.log"))


def check_batched_exchange(log_dir: str) -> dict[str, Any]:
    """Hazard 2: a group round's point-to-point exchange runs on the data group's communicator.

    At world size 1 the exchange is with this rank itself (a send and a receive in one
    NCCL group call): rounds must create no communicator beyond the ones ``start()``
    made (single ``send``/``recv`` calls would create one per peer pair, lazily).
    """
    from lightning_partial.collectives import ButterflySchedule, GroupAverage, PartialAllreduceConfig

    device = torch.device("cuda:0")
    cfg = PartialAllreduceConfig(mode="solo", normalize="sum", timeout=timedelta(seconds=60), name="p2p")
    w = [torch.arange(4096, device=device, dtype=torch.float32), torch.full((9,), 3.0, device=device, dtype=torch.bfloat16)]
    engine = GroupAverage(cfg, schedule=ButterflySchedule(world_size=1, group_size=1), store=local_store(), rank=0,
                          world_size=1, like=w, backend="nccl").start()
    try:
        torch.cuda.synchronize()
        after_start = _nccl_inits(log_dir)
        flats = engine.layout.flatten(w)
        for r in range(5):
            received = {0: engine.layout.take()}
            for issued, what in engine._exchange_batched(r, flats, received):
                engine._finish(issued, r, what)
            torch.cuda.synchronize()
            assert _equal(engine.layout.unflatten(received[0]), w), f"round {r}: the exchange changed the model"
        after_rounds = _nccl_inits(log_dir)
    finally:
        engine.close()
    assert after_start >= 1, f"no 'Init COMPLETE' in NCCL's debug log under {log_dir}: the count proves nothing"
    assert after_rounds == after_start, f"{after_rounds - after_start} communicators created by 5 exchange rounds"
    return {"inits_after_start": after_start, "inits_after_rounds": after_rounds}


@pytest.mark.timeout(240)
@run_if_cuda
def test_batched_exchange_uses_the_group_communicator(tmp_path, monkeypatch):
    """Hazard 2 (NCCL's debug log counts the communicators; a worker of its own, so that the log is its own)."""
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("NCCL_DEBUG_FILE", str(tmp_path / "nccl.%p.log"))
    worker = Worker(default_backend="nccl")
    try:
        worker.call("check_batched_exchange", str(tmp_path), timeout=150)
    finally:
        worker.close()
        worker.kill()


# =================================================== 6: DelayedAllreduce state
DELAYED_TARGET = 4  # samples that request a round
DELAYED_BEFORE = 3  # rounds handed before the checkpoint's round R


def micro_batch(k: int, device: torch.device) -> list[torch.Tensor]:
    """Micro-batch ``k``'s mean gradient: integer-valued, 3 tensors in 2 buckets (float32, float64)."""
    base = float(k + 1)
    return [
        torch.arange(1000, device=device, dtype=torch.float32).remainder_(5).add_(base),
        torch.full((3, 5), -base, device=device, dtype=torch.float32),
        torch.arange(7, device=device, dtype=torch.float64).mul_(base),
    ]


def delayed_plan(R: int) -> tuple[list[int], list[list[int]]]:
    """Samples of each micro-batch, and the micro-batches of each round, at world size 1 (target 4 samples).

    Rounds ``0..R`` take one micro-batch of 4 samples each (a deposit that alone requests
    its round, and recycles no buffer); micro-batch ``R + 1`` (2 samples) is pending in the
    checkpoint and completes round ``R + 1`` with micro-batch ``R + 2`` (2 samples) after
    the restore; rounds ``R + 2``, ``R + 3`` take one each; micro-batch ``R + 5`` (2 samples)
    is pending at the end and goes to the final round ``R + 4``.
    """
    samples = [4] * (R + 1) + [2, 2, 4, 4, 2]
    rounds = [[r] for r in range(R + 1)] + [[R + 1, R + 2], [R + 3], [R + 4], [R + 5]]
    return samples, rounds


def delayed_expected(ks: list[int], samples: list[int]) -> list[torch.Tensor]:
    """A round's result: the sample-weighted mean of micro-batches ``ks`` (float64, exact here)."""
    grads = [micro_batch(k, torch.device("cpu")) for k in ks]
    total = sum(samples[k] for k in ks)
    return [sum(samples[k] * g[i].double() for k, g in zip(ks, grads)) / total for i in range(3)]


def delayed_flats(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The layout's flat buffers of ``micro_batch``-shaped tensors: [float32 a, b], [float64 c]."""
    return [torch.cat([tensors[0].reshape(-1), tensors[1].reshape(-1)]), tensors[2].reshape(-1)]


def check_delayed(device_name: str, backend: str, sleep_ms: float) -> dict[str, Any]:
    """Item 6: deposits, rounds, pause/known_round/drain, a state taken while the latest round's result is
    still behind a long kernel, restored into a fresh engine (new store and name), finish; all conserved.

    CUDA: the long kernel runs on the default stream right before the micro-batch that requests
    round R, so round R's reduction on the engine's side stream waits for it. Everything after
    that deposit (one more micro-batch, pause, drain, state_dict) runs on *another* stream: none
    of state_dict's own reads is then ordered after the kernel, and only the engine's wait for
    round R's completion event can make the saved result right.
    """
    from lightning_partial.collectives import DelayedAllreduce, DelayedConfig

    device = torch.device(device_name)
    cuda = device.type == "cuda"
    R = DELAYED_BEFORE
    samples, plan = delayed_plan(R)
    handed: list[Any] = []  # RoundResults, read once everything is done (a read would wait for the kernel)
    k = 0

    def deposit(engine: Any) -> list[Any]:
        nonlocal k
        results = engine.deposit(micro_batch(k, device), samples=samples[k])
        k += 1
        handed.extend(results)
        return results

    def config(name: str) -> DelayedConfig:
        return DelayedConfig(target_samples=DELAYED_TARGET, timeout=timedelta(seconds=60), name=name)

    a = DelayedAllreduce(config("delayed-a"), store=local_store(), rank=0, world_size=1, like=micro_batch(0, device),
                         backend=backend).start()
    kernel_running = None
    kernel_done = None
    try:
        for _ in range(R):  # rounds 0..R-1; each deposit hands the previous round
            deposit(a)
        if cuda and sleep_ms:
            torch.cuda.synchronize()
            _sleep_kernel(sleep_ms)
            kernel_done = torch.cuda.Event()
            kernel_done.record()
        deposit(a)  # requests round R, whose reduction waits for the kernel; hands round R - 1
        assert a.started_round == R, f"round {a.started_round} started, expected {R}"
        other = torch.cuda.Stream(device) if cuda else None
        with torch.cuda.stream(other) if cuda else contextlib.nullcontext():
            deposit(a)  # half of round R + 1: pending in the state
            a.pause()
            known = a.known_round()
            assert known == R, f"known_round() {known}, expected {R}"
            a.drain(known)
            if kernel_done is not None:
                kernel_running = not kernel_done.query()
            state = a.state_dict()
        _synchronize(device)
    finally:
        a.close()
    if kernel_done is not None:
        assert kernel_running, f"the {sleep_ms:g} ms kernel had finished before state_dict(): the check proves little"
    assert [r.round_index for r in handed] == list(range(R)), [r.round_index for r in handed]
    assert state["step"] == R + 1, state["step"]
    assert state["pending_samples"] == [samples[R + 1]], state["pending_samples"]
    pending = [samples[R + 1] * f.double() for f in delayed_flats(micro_batch(R + 1, torch.device("cpu")))]
    assert len(state["pending"]) == 1 and _equal(state["pending"][0], pending), "the pending micro-batch was not saved"
    assert [u["round"] for u in state["unapplied"]] == [R], [u["round"] for u in state["unapplied"]]
    saved = state["unapplied"][0]
    assert saved["divisor"] == samples[R] and list(saved["counts"]) == [samples[R]], saved
    assert _equal(saved["flats"], delayed_flats(delayed_expected(plan[R], samples))), (
        f"the saved result of round {R} differs from its value: read before its round completed on the GPU?"
    )
    assert state["global_samples"] == sum(samples[: R + 1]), state["global_samples"]

    b = DelayedAllreduce(config("delayed-b"), store=local_store(), rank=0, world_size=1, like=micro_batch(0, device),
                         backend=backend)
    b.load_state_dict(state)
    b.start()
    try:
        first = deposit(b)  # completes round R + 1 with the restored micro-batch; hands the restored round R first
        assert [r.round_index for r in first] == [R], [r.round_index for r in first]
        deposit(b)  # round R + 2
        deposit(b)  # round R + 3
        deposit(b)  # pending alone: the final round's
        assert k == len(samples)
        b.pause()
        last = b.known_round()
        assert last == R + 3, last
        b.drain(last)
        final = b.finish(last)
        handed.extend(final)
        assert [r.round_index for r in final] == [R + 3, R + 4], [r.round_index for r in final]
        assert b.global_samples == sum(samples), (b.global_samples, sum(samples))
        _synchronize(device)
        values = [([t.detach().double().cpu() for t in r.tensors], r.stats.divisor) for r in handed]
        for r in handed:
            r.release()
    finally:
        b.close()
    assert [r.round_index for r in handed] == list(range(len(plan))), [r.round_index for r in handed]
    for r, (got, divisor) in enumerate(values):
        assert divisor == sum(samples[j] for j in plan[r]), (r, divisor)
        assert _equal(got, delayed_expected(plan[r], samples)), f"round {r}: wrong result"
    # Conserved: the results times their divisors sum to every micro-batch's samples x mean gradient.
    total = [sum(got[i] * divisor for got, divisor in values) for i in range(3)]
    cpu = torch.device("cpu")
    contributed = [sum(samples[j] * micro_batch(j, cpu)[i].double() for j in range(k)) for i in range(3)]
    assert _equal(total, contributed), "the results do not sum to what was deposited"
    return {"rounds": len(values), "micro_batches": k, "kernel_running_at_state_dict": kernel_running}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("device", ["cpu", cuda_param("cuda")])
def test_delayed_checkpoint_behind_long_kernel(device, request):
    """Item 6: DelayedAllreduce state_dict/load_state_dict/finish, exact (NCCL + a 300 ms kernel on CUDA)."""
    if device == "cpu":
        out = check_delayed("cpu", "gloo", 0.0)
    else:
        out = request.getfixturevalue("nccl_worker").call("check_delayed", "cuda:0", "nccl", 300.0, timeout=120)
        assert out["kernel_running_at_state_dict"] is True
    assert out["rounds"] == DELAYED_BEFORE + 5


# =============================================================== 7: memory
def check_memory(kind: str, device_name: str, backend: str, numel: int) -> dict[str, Any]:
    """Item 7: ``MEMORY_ROUNDS`` rounds with each result released: buffer sets and peak memory after warm-up."""
    from lightning_partial.collectives import (
        ButterflySchedule,
        GroupAverage,
        PartialAllreduce,
        PartialAllreduceConfig,
        apply_average,
    )

    device = torch.device(device_name)
    cuda = device.type == "cuda"
    _synchronize(device)
    before = torch.cuda.memory_allocated(device) if cuda else 0
    inputs = [torch.zeros(numel, device=device) for _ in range(4)]
    model_bytes = sum(t.numel() * t.element_size() for t in inputs)
    if kind == "partial":
        cfg = PartialAllreduceConfig(mode="solo", timeout=timedelta(seconds=60), name="mem-partial")
        engine = PartialAllreduce(cfg, store=local_store(), rank=0, world_size=1, like=inputs, backend=backend)
    else:
        cfg = PartialAllreduceConfig(mode="solo", normalize="sum", sync_every=10, timeout=timedelta(seconds=60),
                                     name="mem-ga")
        engine = GroupAverage(cfg, schedule=ButterflySchedule(world_size=1, group_size=1), store=local_store(),
                              rank=0, world_size=1, like=inputs, backend=backend, measure_every=5)
    engine.start()
    allocations, warm, peak = [], None, None
    try:
        for step in range(MEMORY_ROUNDS):
            if step == MEMORY_WARMUP:
                _synchronize(device)
                warm = engine.layout.allocations
                if cuda:
                    torch.cuda.reset_peak_memory_stats(device)
            value = float(step + 1)
            for t in inputs:
                t.fill_(value)  # the gradient (PartialAllreduce) or the model after a local step (GroupAverage)
            result = engine.arrive(inputs)
            if kind == "group":
                apply_average(result, inputs)  # at world size 1: the model unchanged
            got = torch.stack([t[-1] for t in result.tensors] + [t[0] for t in inputs]).tolist()
            assert got == [value] * 8, f"round {step}: {got}"
            result.release()
            allocations.append(engine.layout.allocations)
        _synchronize(device)
        if cuda:
            peak = torch.cuda.max_memory_allocated(device)
        last = engine.flush(inputs) if kind == "group" else engine.flush()
        last.release()
    finally:
        engine.close()
    extra = None if peak is None else peak - before - model_bytes
    return {
        "model_bytes": model_bytes,
        "peak_extra_bytes": extra,
        "multiple": None if extra is None else extra / model_bytes,
        "allocations": allocations,
        "allocations_after_warmup": warm,
        "engine_backend": engine.backend,
    }


def _assert_memory(kind: str, out: dict[str, Any], *, bound: Optional[float]) -> None:
    warm, counts = out["allocations_after_warmup"], out["allocations"]
    assert warm is not None and warm >= 1
    assert max(counts[MEMORY_WARMUP:]) == warm, (
        f"{kind}: buffer sets allocated per round after {MEMORY_WARMUP} rounds: {counts} (pool misses grow)"
    )
    if bound is not None:
        multiple = out["multiple"]
        assert multiple is not None and multiple <= bound, (
            f"{kind}: peak memory beyond the inputs {out['peak_extra_bytes'] / 2**20:.1f} MiB = {multiple:.2f} x the "
            f"model ({out['model_bytes'] / 2**20:.0f} MiB), bound {bound:g} x; allocations {counts}"
        )


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["partial", "group"])
@pytest.mark.parametrize("device", ["cpu", cuda_param("cuda")])
def test_steady_state_memory(kind, device, request):
    """Item 7: no buffer-set allocation after 5 rounds; on CUDA (NCCL) a bounded peak memory (64 MiB model)."""
    bound = PARTIAL_ALLREDUCE_PEAK_MODELS if kind == "partial" else GROUP_AVERAGE_PEAK_MODELS
    if device == "cpu":
        out = check_memory(kind, "cpu", "gloo", 1000)
        _assert_memory(kind, out, bound=None)
    else:
        out = request.getfixturevalue("nccl_worker").call("check_memory", kind, "cuda:0", "nccl", MEMORY_NUMEL,
                                                          timeout=150)
        assert out["engine_backend"] == "nccl"
        print(f"{kind}: peak beyond the inputs {out['multiple']:.2f} x the model, allocations {out['allocations']}")
        _assert_memory(kind, out, bound=bound)


# ======================================================== 8: completion bound
def check_completion_timeout() -> dict[str, Any]:
    """Item 8: a round stuck behind a 4 s kernel fails the engine after its 1 s timeout; ``close()`` returns."""
    from lightning_partial.collectives import (
        PartialAllreduce,
        PartialAllreduceConfig,
        PartialCollectiveError,
        PartialCollectiveTimeout,
    )

    device = torch.device("cuda", 0)
    cycles_per_ms()  # measured before the engine's 1 s bounds start counting
    cfg = PartialAllreduceConfig(mode="solo", timeout=timedelta(seconds=1), setup_timeout=timedelta(seconds=60),
                                 name="watch")
    engine = PartialAllreduce(cfg, store=local_store(), rank=0, world_size=1, like=torch.zeros(1024, device=device),
                              backend="nccl").start()
    raised: Optional[PartialCollectiveError] = None
    arrivals = 0
    kernel_running = None
    try:
        engine.arrive(torch.ones(1024, device=device)).release()  # round 0: a normal one
        torch.cuda.synchronize()
        _sleep_kernel(4000.0)
        kernel_done = torch.cuda.Event()
        kernel_done.record()
        # Round 1's NCCL kernel waits behind the sleep (on the engine's side stream). Arrivals
        # every 0.25 s keep the communication thread's wait for the next activation (bounded
        # by the same 1 s timeout) short, so that only the completion bound can fire.
        deadline = time.monotonic() + 3.5
        while time.monotonic() < deadline:
            try:
                engine.arrive(torch.ones(1024, device=device))
                arrivals += 1
            except PartialCollectiveError as err:
                raised = err
                break
            time.sleep(0.25)
        kernel_running = not kernel_done.query()
    finally:
        started = time.monotonic()
        engine.close()
        close_s = time.monotonic() - started
    assert raised is not None, f"no error within 3.5 s: {arrivals} arrivals after the stuck round went through"
    message = str(raised)
    assert isinstance(raised, PartialCollectiveTimeout), f"{type(raised).__name__}, not a timeout: {message}"
    assert raised.rank == 0 and raised.round_index == 1, (raised.rank, raised.round_index, message)
    assert "rank 0" in message and "round 1" in message, message
    assert "did not complete on the GPU" in message, message  # CompletionWatch's error, not another bound's
    assert kernel_running, "the 4 s kernel had finished when arrive raised: the round was not stuck"
    assert close_s < 30, f"close() took {close_s:.1f}s"
    return {"message": message, "arrivals": arrivals, "close_s": close_s}


@run_if_cuda
@pytest.mark.timeout(180)
def test_completion_watch_times_out():
    """Item 8: CompletionWatch, in a worker of its own (the engine aborts its NCCL group)."""
    worker = Worker(default_backend="nccl")
    try:
        out = worker.call("check_completion_timeout", timeout=90)
    finally:
        problem = worker.close(timeout=20)
        worker.kill()
    print(out, f"teardown after the abort: {problem or 'clean'}")


# ============================================================ 4, 9: Lightning fits
def run_fit_script(out: Path, accelerator: str, cases: Sequence[str], timeout: float) -> dict[str, Any]:
    """Runs tests/scripts/cuda_fit.py once for ``cases`` (one process); returns {case: record}, a failed record
    (``ok`` false, with the script's output) for a case that wrote none, a time-out included."""
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARIABLES}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    command = [sys.executable, "-m", FIT_SCRIPT, "--out", str(out), "--accelerator", accelerator,
               "--cases", ",".join(cases)]
    try:
        proc = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
        tail = (proc.stdout + proc.stderr)[-6000:]
        code = proc.returncode
    except subprocess.TimeoutExpired as err:
        output = [o.decode(errors="replace") if isinstance(o, bytes) else (o or "") for o in (err.stdout, err.stderr)]
        tail = f"timed out after {err.timeout}s (killed):\n" + output[0][-3000:] + output[1][-3000:]
        code = None
    records = {}
    for case in cases:
        path = out / f"{case}.json"
        records[case] = json.loads(path.read_text()) if path.exists() else {
            "ok": False, "error": f"no record (exit code {code}); output:\n{tail}"}
    return records


@pytest.fixture(scope="module")
def lightning_fits(tmp_path_factory):
    """Runs tests/scripts/cuda_fit.py once for every case on the GPU; returns {case: record}."""
    return run_fit_script(tmp_path_factory.mktemp("cuda_fit"), "gpu", FIT_CASES, timeout=420)


def _fit_record(records: dict[str, Any], case: str) -> dict[str, Any]:
    record = records[case]
    if not record.get("ok"):
        pytest.fail(f"cuda_fit.py case {case!r} failed:\n{record.get('error')}", pytrace=False)
    return record


@run_if_cuda
@pytest.mark.timeout(480)
@pytest.mark.parametrize("case", ["fp32", "bf16"])
def test_eager_sgd_bit_identical_to_auto(case, lightning_fits):
    """Item 4: 20 steps of eager_sgd on one GPU give strategy="auto"'s weights, bit for bit."""
    out = _fit_record(lightning_fits, case)
    seen = out["seen"]
    assert out["strategy"] == "EagerSGDStrategy"
    assert out["global_step"] == 20
    assert out["trained"] and out["finite"]
    assert out["flush_round"] == 20, f"last round {out['flush_round']}, expected the flush at round 20"
    assert seen["engine_backend"] == "nccl" and seen["pg_backend"] == "nccl", seen
    assert seen["engine_device"].startswith("cuda") and seen["grad_device"].startswith("cuda"), seen
    assert out["identical"], f"weights differ from strategy='auto' (max |diff| {out['max_diff']:.3g})"


@run_if_cuda
@pytest.mark.timeout(480)
def test_eager_sgd_majority_refused_at_world_size_1(lightning_fits):
    out = _fit_record(lightning_fits, "majority")
    assert out["raised"] == "ValueError" and "majority" in out["message"], out


@run_if_cuda
@pytest.mark.timeout(480)
def test_nccl_only_on_the_communication_thread(lightning_fits):
    """Item 9: the invariant of lightning_partial/strategies/partial.py ("one thread per NCCL communicator")."""
    out = _fit_record(lightning_fits, "invariant")
    assert out["default_backend"] == "nccl", out["default_backend"]
    assert out["global_step"] == out["max_steps"] and out["validation_runs"] >= 1, out
    calls = out["calls"]
    during = [c for c in calls if c["phase"] == "train"]  # from on_train_start to on_train_end

    def nccl(c: dict[str, Any]) -> bool:
        return "nccl" in c["backend"]

    def engine_thread(c: dict[str, Any]) -> bool:
        return c["thread"].startswith("lightning_partial-")

    # The one exception: the engine's start() (at on_train_start) makes its NCCL group and tries it
    # once (collectives/nccl.py: nccl_data_group, warm_up) on the main thread, before its
    # communication thread exists: no other thread can drive a NCCL communicator then.
    setup = [c for c in during if nccl(c) and not engine_thread(c) and c["caller"].startswith("collectives/nccl.py:")]
    assert all(c["engine_alive"] is False for c in setup), f"engine set-up while an engine thread ran: {setup}"
    foreign = [c for c in during if nccl(c) and not engine_thread(c) and c not in setup]
    assert not foreign, f"NCCL collectives from other threads than the engine's during fit: {foreign[:5]}"
    assert any(nccl(c) and engine_thread(c) and c["fn"] == "all_reduce" for c in during), (
        "no NCCL allreduce from the engine's communication thread: "
        + str(sorted({(c["fn"], c["backend"], c["thread"]) for c in during}))
    )
    main = [c for c in during if not engine_thread(c) and c not in setup]
    assert all(c["backend"] == "gloo" for c in main), sorted({(c["fn"], c["backend"]) for c in main})
    names = {c["fn"] for c in main}
    assert {"all_reduce", "all_gather", "barrier"} <= names, names  # sync_dist, self.all_gather, strategy.barrier
    assert any(c["fn"] == "all_reduce" and c["validating"] for c in main), "no sync_dist reduction in validation"


@run_if_cuda
@pytest.mark.timeout(480)
def test_abs_sgd_adamw_retimes_on_the_device(lightning_fits):
    """Item 10: Adam spike compensation on CUDA state, through the strategy (world size 1: every result a
    round late; every step but a fresh optimizer's first is re-timed)."""
    out = _fit_record(lightning_fits, "abs_adamw")
    for precision, run in out["runs"].items():
        assert run["update_rule"]["staleness_rule"] == "momentum", (precision, run["update_rule"])
        assert run["finite"] and run["trained"] and run["global_step"] > 0, (precision, run)
        assert run["retimed"] and all(r["staleness"] == 1 for r in run["retimed"]), (precision, run["retimed"][:3])
        places = {(tuple(r["params"]), tuple(r["grads"]), tuple(r["moments"])) for r in run["retimed"]}
        assert places == {(("cuda:0",),) * 3}, (precision, places)
        assert run["loss_after"] < run["loss_before"], (precision, run["loss_before"], run["loss_after"])


def assert_overlap_record(out: dict[str, Any]) -> None:
    """eager_sgd's overlap at world size 1: SGD momentum with every gradient applied one step late and re-timed
    (spike compensation), bit for bit against the loop written out by hand."""
    rule = out["update_rule"]
    assert rule["overlap"] is True and rule["weight_prediction"] is False and rule["overlap_retiming"] == "momentum"
    assert out["global_step"] == 20
    # Step 0 applies nothing; step r the round of step r - 1; round 19 at the end of fit, then the flush (20).
    assert out["applied_in_loop"] == list(range(19)) and out["last_round"] == 20, out
    assert out["identical"], f"overlap differs from re-timed one-step-late SGD by {out['max_diff']:.3g}"


@run_if_cuda
@pytest.mark.timeout(480)
def test_overlap_on_the_device(lightning_fits):
    """eager_sgd's overlap on one GPU: each round's result is collected (and handed to the training stream)
    a step after the round ran; the fit equals the same delayed-gradient SGD loop written by hand."""
    out = _fit_record(lightning_fits, "overlap")
    assert out["engine_device"].startswith("cuda"), out
    assert_overlap_record(out)


@pytest.mark.timeout(240)
def test_fit_cases_on_the_host(tmp_path):
    """Items 4 and 10 on the host (gloo, no GPU): the script's own check, and the CPU suite's guard that
    eager_sgd on one device takes strategy="auto"'s steps (weight prediction is off at world size 1)."""
    records = run_fit_script(tmp_path, "cpu", ("fp32", "abs_adamw", "overlap"), timeout=200)
    assert_overlap_record(_fit_record(records, "overlap"))
    fp32, adamw = _fit_record(records, "fp32"), _fit_record(records, "abs_adamw")
    assert fp32["identical"] and fp32["trained"], f"eager_sgd differs from strategy='auto' by {fp32['max_diff']:.3g}"
    for precision, run in adamw["runs"].items():
        assert run["update_rule"]["staleness_rule"] == "momentum" and run["retimed"], (precision, run["update_rule"])
        assert {tuple(r["moments"]) for r in run["retimed"]} == {("cpu",)}
        assert run["finite"] and run["loss_after"] < run["loss_before"], (precision, run)
