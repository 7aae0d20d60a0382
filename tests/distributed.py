"""Real multi-rank harnesses for the tests: gloo ranks as threads or as processes.

Nothing here mocks torch.distributed: every rank builds real gloo process
groups over a real ``TCPStore`` (``port=0``) and talks over loopback.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import threading
import traceback
from typing import Any, Callable, Iterator

import torch.distributed as dist


def master_store(world_size: int) -> dist.TCPStore:
    """A fresh TCPStore server on a free loopback port."""
    return dist.TCPStore(
        "127.0.0.1", 0, world_size, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False
    )


def run_threads(world_size: int, fn: Callable[[int, dist.Store], Any], *, timeout: float = 120.0) -> list[Any]:
    """Runs ``fn(rank, store)`` on ``world_size`` threads; returns their results in rank order.

    Re-raises the first rank's exception; fails (never hangs) if a rank is still
    running after ``timeout`` seconds.
    """
    store = master_store(world_size)
    results: list[Any] = [None] * world_size
    errors: list[tuple[int, BaseException, str]] = []

    def target(rank: int) -> None:
        try:
            results[rank] = fn(rank, store.clone())
        except BaseException as err:  # noqa: BLE001
            errors.append((rank, err, traceback.format_exc()))

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    stuck = [r for r, t in enumerate(threads) if t.is_alive()]
    if errors:
        ordered = sorted(errors, key=lambda e: e[0])
        rank, err, _ = ordered[0]
        report = "\n".join(f"rank {r} failed:\n{tb}" for r, _, tb in ordered)
        raise AssertionError(report) from err
    if stuck:
        raise AssertionError(f"ranks {stuck} still running after {timeout}s: hang")
    return results


def _process_entry(target: Callable[..., Any], rank: int, world_size: int, port: int, queue: Any, args: tuple) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        queue.put((rank, "ok", target(rank, world_size, port, *args)))
    except BaseException as err:  # noqa: BLE001
        queue.put((rank, "error", f"{type(err).__name__}: {err}"))
        raise SystemExit(3) from err


def run_processes(
    world_size: int, target: Callable[..., Any], *args: Any, timeout: float = 120.0
) -> tuple[dict[int, tuple[str, Any]], dict[int, int | None], Any]:
    """Spawns ``target(rank, world_size, port, *args)`` in ``world_size`` processes.

    The parent hosts the TCPStore on ``port``. Returns ``(reports, exitcodes, store)``:
    what each rank reported (``("ok", value)`` or ``("error", message)``) and
    its exit code; processes still alive after ``timeout`` are killed and
    reported with exit code ``None``.
    """
    store = master_store(world_size)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_process_entry, args=(target, r, world_size, store.port, queue, args), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    reports: dict[int, tuple[str, Any]] = {}
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    for p in procs:
        p.join(timeout=max(0.1, (deadline - datetime.datetime.now()).total_seconds()))
    exitcodes: dict[int, int | None] = {}
    for r, p in enumerate(procs):
        if p.is_alive():
            p.kill()
            p.join(5)
            exitcodes[r] = None
        else:
            exitcodes[r] = p.exitcode
    while True:
        try:
            rank, status, value = queue.get(timeout=0.5)
        except Exception:  # queue.Empty
            break
        reports[rank] = (status, value)
    return reports, exitcodes, store


@contextlib.contextmanager
def in_process_fit() -> Iterator[None]:
    """Around a Trainer fit run in the test process: it leaves nothing behind for later launches.

    Lightning writes the rendezvous variables (MASTER_PORT, WORLD_SIZE, ...) into
    ``os.environ`` and keeps the default group and its store open. conftest.py restores
    the variables after each test, but a module fixture runs before that snapshot, so a
    fixture's fit would leak them into every later subprocess launch (seen: 11 launches
    hung until their timeouts).
    """
    saved = dict(os.environ)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved)
