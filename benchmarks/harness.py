"""What the benchmarks share: the launch environment, threads, the CPU stolen meanwhile, process groups.

Standard library and torch only: the parents and the calibration processes
import this module, and importing Lightning costs seconds a process.

* :data:`RANK_VARIABLES`, :func:`free_port`, :func:`launch_environment`: a
  fresh launch of a fit's ranks (``recipes/launch.py``, shared with the main job).
* :func:`set_threads`, :func:`thread_environment`: intra-op threads of a rank.
* :func:`cpu_ticks`, :func:`steal_between`, :func:`retry_while_stolen`: a fit
  during which the host's hypervisor took much of the CPU is run again.
* :func:`run_in_group`, :func:`live_group_members`, :func:`kill_group`: a fit runs in its
  own process group (``start_new_session=True``), killed whole when it ends or times out.
* :func:`add_device_argument`, :func:`emulated_device`: ``--device-ms-per-sample``,
  compute emulated as an accelerator's, during which the host's cores are free.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from importlib import metadata
from pathlib import Path
from queue import Empty
from typing import Any, Callable, Iterator, Optional

import torch

from recipes.launch import RANK_VARIABLES, free_port, launch_environment

log = logging.getLogger("benchmarks.harness")

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"


#: The Trainer options of every benchmark fit: nothing but the fit (no logger, checkpoints,
#: progress bar, model summary or sanity check), so that only the strategy differs between fits.
BARE_TRAINER: dict[str, Any] = {
    "logger": False, "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False,
    "num_sanity_val_steps": 0,
}


def module_command(module: str, *argv: str) -> list[str]:
    """``python -m <module> argv...``: how a benchmark starts its workers (run with ``cwd=REPO``)."""
    return [sys.executable, "-m", module, *argv]


# ---------------------------------------------------------------------- threads
def set_threads(threads: int) -> None:
    """``threads`` intra-op threads in this process (and in the processes it starts, through the environment)."""
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


def thread_environment(threads: int) -> dict[str, str]:
    """Environment variables of a fit's processes: ``threads`` intra-op threads (Lightning's launcher hands
    them on to ranks 1..P-1)."""
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


# ---------------------------------------------------------------------- emulated devices
def non_negative_ms(value: str) -> float:
    """argparse type: a finite number of milliseconds >= 0."""
    try:
        number = float(value)
    except ValueError:
        number = -1.0
    if not number >= 0 or number == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {value!r}")
    return number


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    """``--device-ms-per-sample`` (default 0: the real compute only)."""
    parser.add_argument("--device-ms-per-sample", type=non_negative_ms, default=0.0,
                        help="emulated device time: every micro-batch also sleeps this many ms per sample after its "
                             "backward (divided by the rank's speed factor, where the benchmark has one), as a "
                             "rank whose compute runs on an accelerator while its host's cores stay free "
                             "(default 0: the real compute only)")


def emulated_device(ms_per_sample: float, speed: Optional[tuple[float, ...]] = None) -> Any:
    """A Lightning callback: after each backward, sleeps ``ms_per_sample x samples / f`` (``f``: the rank's
    entry in ``speed``, 1 without one; ``samples``: the micro-batch's first tensor's length).

    On 4 ranks sharing 2 cores, the ranks' compute, gloo's threads and the communication
    threads compete for the CPU, so a rank that waits frees a core for the others and a
    collective's CPU comes out of the compute. An accelerator's compute does neither: the host
    thread blocks while the device works. The sleep stands for that part; the model still
    trains on its real gradients. ``LoadImbalance(speed=...)`` scales the real compute (CPU
    time, which excludes this sleep), so the two add up to a device ``1/f`` times slower.
    """
    import lightning.pytorch as pl  # here, not at module level: parents do not import Lightning

    class EmulatedDevice(pl.Callback):
        def __init__(self) -> None:
            self.samples = 0
            self.factor = 1.0
            self.slept_s = 0.0

        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            self.factor = speed[trainer.global_rank] if speed is not None else 1.0

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self.samples = len(batch[0])

        def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
            seconds = ms_per_sample * 1e-3 * self.samples / self.factor
            self.slept_s += seconds
            time.sleep(seconds)

    return EmulatedDevice()


def positive_int(value: str) -> int:
    """argparse type: an int >= 1 (``--threads``)."""
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {number}")
    return number


def process_reports(queue: Any, procs: list[Any], timeout: float) -> list[Any]:
    """One report per process in ``procs`` from their ``multiprocessing`` queue.

    Fails at once if a process has exited with an error (the others then wait for it: in a collective, at a
    barrier) and after ``timeout`` seconds in any case, naming the processes; either way it kills them all.
    """
    reports: list[Any] = []
    deadline = time.monotonic() + timeout
    while len(reports) < len(procs):
        try:
            reports.append(queue.get(timeout=min(1.0, max(deadline - time.monotonic(), 0.01))))
            continue
        except Empty:
            pass
        dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
        if dead or time.monotonic() >= deadline:
            for p in procs:
                p.kill()
            if dead:
                raise RuntimeError(f"process(es) {dead} exited with {[procs[i].exitcode for i in dead]}")
            raise RuntimeError(f"{len(procs) - len(reports)} of {len(procs)} processes sent no report within "
                               f"{timeout:g}s")
    return reports


def package_version(name: str) -> Optional[str]:
    """The installed version of ``name``, or ``None``."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


# ---------------------------------------------------------------------- CPU stolen by the hypervisor
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


def _threads_cpu() -> Iterator[tuple[int, str, float]]:
    """This process's threads: (native id, the kernel's thread name, CPU seconds so far), from ``/proc/self/task``."""
    tick = os.sysconf("SC_CLK_TCK")
    for task in Path("/proc/self/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            comm = (task / "comm").read_text().strip()
        except OSError:  # the thread ended meanwhile
            continue
        yield int(task.name), comm, (int(fields[11]) + int(fields[12])) / tick  # utime + stime


def thread_cpu() -> dict[int, tuple[str, float]]:
    """This process's threads: native id -> (role, CPU seconds so far), from ``/proc/self/task`` (Linux).

    Roles: ``main`` (the training loop), ``communication`` (the engine's thread, named ``lightning_partial-...``),
    ``other`` (threads Python does not know: gloo's, the ``TCPStore`` server's).
    """
    names = {t.native_id: t.name for t in threading.enumerate()}
    out = {}
    for tid, _, seconds in _threads_cpu():
        name = names.get(tid, "")
        role = "main" if name == "MainThread" else "communication" if name.startswith("lightning_partial") else "other"
        out[tid] = (role, seconds)
    return out


def cpu_by_thread_name() -> dict[str, float]:
    """CPU seconds so far per kernel thread name, summed over the threads of that name (gloo's TCP loop
    ``gloo_tcp_loop``, its workers ``pt_gloo_runloop``, the ``TCPStore``'s ``pt_tcpstore_uv``, the main thread
    under the process's name)."""
    out: dict[str, float] = {}
    for _, comm, seconds in _threads_cpu():
        out[comm] = out.get(comm, 0.0) + seconds
    return out


def cpu_by_role(first: dict[int, tuple[str, float]], last: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds each role's threads used between two :func:`thread_cpu` snapshots."""
    spent = {"main": 0.0, "communication": 0.0, "other": 0.0}
    for tid, (role, seconds) in last.items():
        spent[role] += seconds - first.get(tid, (role, 0.0))[1]
    return spent


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


# ---------------------------------------------------------------------- process groups
def live_group_members(pgid: int) -> list[int]:
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


def kill_group(pgid: int) -> None:
    """SIGKILL a fit's whole process group (rank 0 and the ranks Lightning started); gone already is fine."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_in_group(cmd: list[str], *, records: list[Path], timeout: float, env: dict[str, str],
                 stdout: Any = None) -> Optional[int]:
    """Runs a fit's launcher ``cmd`` (``cwd=REPO``) in a session of its own; returns its exit status, ``None`` if
    the fit ran past ``timeout`` seconds.

    The fit's ranks (the launcher and the processes Lightning starts) form one process group.
    The launcher may exit before the other ranks wrote their ``records`` (a fit that ends
    without a barrier, whose slowest rank trains longest): after a clean exit this waits
    while any member still runs and a record is missing, within the same ``timeout``. The
    group is killed at the end whatever happened (also on ``KeyboardInterrupt``): nothing
    outlives its fit.
    """
    deadline = time.monotonic() + timeout
    proc = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.STDOUT if stdout is not None else None, env=env,
                            cwd=REPO, start_new_session=True)
    try:
        rc: Optional[int] = proc.wait(timeout=timeout)
        while rc == 0 and not all(p.exists() for p in records) and live_group_members(proc.pid):
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(cmd, timeout)
            time.sleep(0.2)
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        kill_group(proc.pid)
        proc.wait()
    return rc


__all__ = [
    "BARE_TRAINER", "RANK_VARIABLES", "REPO", "RESULTS", "add_device_argument", "add_steal_arguments", "cpu_by_role",
    "cpu_by_thread_name", "cpu_ticks",
    "emulated_device", "free_port", "kill_group", "launch_environment", "live_group_members", "module_command",
    "non_negative_ms", "package_version", "positive_int", "retry_while_stolen", "run_in_group", "set_threads",
    "steal_between", "thread_cpu", "thread_environment",
]
