"""Liveness apart from slowness: a frozen rank ends the job quickly and is named; a slow one never is.

Each rank is its own process, started by hand as torchrun or SLURM would start
them on separate machines (``LOCAL_RANK``/``WORLD_SIZE``/``MASTER_PORT`` set, so
Lightning launches nothing): a survivor's exit is its own, not a launcher's. Each is
forked from the tests' preloaded server (``tests/forkrun.py``), a sibling of the
others, so that four ranks do not pay four interpreters' imports of Lightning
(``LP_TESTS_FORKSERVER=0``: fresh interpreters).
``collective_timeout`` is 4 s here (60 s by default); the bounds below are the
acceptance bound (``collective_timeout + 30 s``) plus the time a 2-core host
needs to start and tear down four Lightning processes, and they are hang
detectors, not timing targets.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from lightning_partial.collectives import Heartbeat

from tests.scripts.ports import free_port
from tests import forkrun

SCRIPT = "tests.scripts.fit"  # run as `python -m` from the repository root
WORLD = 4
# 60 (the default) to measure at the defaults: LIVENESS_COLLECTIVE_TIMEOUT_S=60 pytest -s -k frozen ...
COLLECTIVE_TIMEOUT_S = int(os.environ.get("LIVENESS_COLLECTIVE_TIMEOUT_S", "4"))
STRATEGIES = ["eager_sgd", "wagma_sgd", "ds_sync", "abs_sgd"]


def start_ranks(out: Path, *options: str) -> list[forkrun.Forked | subprocess.Popen]:
    """``WORLD`` processes of tests/scripts/fit.py, one per rank, each logging to ``out/rank<R>.log``."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs: list[forkrun.Forked | subprocess.Popen] = []
    for rank in range(WORLD):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "LOCAL_RANK": str(rank),
               "NODE_RANK": "0", "WORLD_SIZE": str(WORLD), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        command = [sys.executable, "-m", SCRIPT, "--out", str(out), "--devices", str(WORLD), *options]
        if forkrun.server_on():
            procs.append(forkrun.Forked(command, env, None, log=out / f"rank{rank}.log"))
            continue
        with open(out / f"rank{rank}.log", "w") as log:
            procs.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL))
    return procs


def wait_all(procs: list[forkrun.Forked | subprocess.Popen], seconds: float) -> list[int | None]:
    """Each process's exit code, or ``None`` for one still running after ``seconds``.

    Prints how long each took (the closing note's figures at the defaults come from it).
    """
    started = time.monotonic()
    deadline = started + seconds
    ended: dict[int, float] = {}
    while time.monotonic() < deadline and len(ended) < len(procs):
        for i, p in enumerate(procs):
            if i not in ended and p.poll() is not None:
                ended[i] = time.monotonic() - started
        time.sleep(0.2)  # polling the processes (not a timing assert)
    print("exits after (s):", {i: round(t, 1) for i, t in sorted(ended.items())})
    return [p.poll() for p in procs]


def kill_all(procs: list[forkrun.Forked | subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.kill()
        p.wait()
        if isinstance(p, forkrun.Forked):
            p.close()


def strategy_options(strategy: str, **extra: object) -> list[str]:
    kw = {"collective_timeout": COLLECTIVE_TIMEOUT_S, **extra}
    return ["--strategy", strategy, "--strategy-kw", json.dumps(kw)]


# -- the heartbeat alone: threads on a real TCPStore ----------------------------------
def heartbeats(store: dist.Store, world: int, seconds: float = 1.0) -> tuple[list[Heartbeat], dict[int, str]]:
    verdicts: dict[int, str] = {}
    beats = [
        Heartbeat(store, rank=r, world_size=world, timeout=timedelta(seconds=seconds), name="t",
                  on_dead=lambda err, r=r: verdicts.setdefault(r, str(err)), progress=lambda: 7)
        for r in range(world)
    ]
    return beats, verdicts


@pytest.mark.timeout(60)
def test_a_silent_heartbeat_is_named_on_every_rank_and_a_stopped_one_is_not() -> None:
    store = dist.TCPStore("127.0.0.1", 0, 4, True, wait_for_workers=False)
    beats, verdicts = heartbeats(store, 4)
    for b in beats:
        b.start()
    beats[3].stop()  # a clean stop: "done", never a verdict
    time.sleep(2.5)  # longer than the 1 s bound (not a timing assert: nothing may happen here)
    assert verdicts == {}
    beats[1]._stopped.set()  # rank 1 stops beating without saying so (as a frozen process would)
    deadline = time.monotonic() + 20
    while len(verdicts) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert set(verdicts) == {0, 2}, verdicts  # rank 0 watches rank 1; rank 2 reads the verdict
    assert all("rank 1 has not answered" in v and "round 7" in v and "noticed by rank 0" in v
               for v in verdicts.values()), verdicts
    for b in beats:
        b.stop()


@pytest.mark.timeout(60)
def test_a_fresh_verdict_read_returns_after_one_read_not_at_the_bound() -> None:
    """``wait_verdict(fresh=True)`` (a collective failed because a peer's process is gone): the store thread reads
    at once, between its beats, and the wait ends with that read: a verdict another rank published is returned,
    and without one the wait ends with ``None`` after a read begun after the call (beats 20 s apart, a 10 s
    bound: without the fresh read no read would come before the bound, which would end the wait instead)."""
    store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
    verdicts: dict[int, str] = {}
    beat = Heartbeat(store, rank=0, world_size=2, timeout=timedelta(seconds=60), interval=20.0, name="t",
                     on_dead=lambda err: verdicts.setdefault(0, str(err)), progress=lambda: 7)
    beat.start()
    try:
        started = time.monotonic()
        assert beat.wait_verdict(10.0, fresh=True) is None
        assert beat._read_through >= started and verdicts == {}  # ended by the poke's read, not by the bound
        dist.PrefixStore("lightning_partial/t/hb", store).set("dead", "rank 1 has not answered (noticed by rank 5)")
        verdict = beat.wait_verdict(40.0, fresh=True)
        assert verdict is not None and "rank 1 has not answered (noticed by rank 5)" in str(verdict)
        assert "rank 1 has not answered" in verdicts[0]
    finally:
        beat.stop()


@pytest.mark.timeout(60)
def test_a_connection_closed_at_the_rounds_bound_waits_for_the_verdict() -> None:
    """A peer whose collective timed out closes its connections: the others see "connection closed" when their
    own round has waited about as long as the bound, and the verdict on the stalled rank follows within a beat.
    Such a failure waits (up to two beats) for it, as a timeout does; one early in the round (a peer's process
    gone) takes one fresh read and returns without a verdict."""
    from lightning_partial.collectives import PartialAllreduce, PartialAllreduceConfig, PartialCollectiveError

    store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
    # Beats 2 s apart, a 20 s bound: the wait for the verdict (two beats) leaves seconds of margin on a loaded host.
    beat = Heartbeat(store, rank=0, world_size=2, timeout=timedelta(seconds=60), interval=2.0, name="t",
                     on_dead=lambda err: None, progress=lambda: 85)
    engine = PartialAllreduce(PartialAllreduceConfig(mode="solo", collective_timeout=timedelta(seconds=20)),
                              store=store, rank=0, world_size=2, like=torch.zeros(3))
    engine.attach_liveness(beat)
    beat.start()
    closed = PartialCollectiveError("header allreduce failed (Connection closed by peer)", rank=0, round_index=85)
    try:
        engine._reduce_began = time.monotonic() - 0.2  # early in the round: a peer's process is gone
        assert engine._explain(closed) is closed
        engine._reduce_began = time.monotonic() - 19.0  # at the bound: a peer's own timeout
        publish = threading.Timer(0.3, lambda: dist.PrefixStore("lightning_partial/t/hb", store).set(
            "dead", "rank 2 has not answered for 4 s (noticed by rank 1)"))
        publish.start()
        named = engine._explain(closed)
        publish.join()
        assert "rank 2 has not answered" in str(named) and "Connection closed by peer" in str(named), named
        assert "round 85" in str(named)
        assert str(named).count("[partial allreduce") == 1, named  # one prefix: this rank, this round
    finally:
        beat.stop()


@pytest.mark.timeout(60)
def test_a_rank_that_never_beats_is_named() -> None:
    store = dist.TCPStore("127.0.0.1", 0, 3, True, wait_for_workers=False)
    beats, verdicts = heartbeats(store, 3)
    beats[0].start(), beats[1].start()  # rank 2 never starts
    deadline = time.monotonic() + 20
    while len(verdicts) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert set(verdicts) == {0, 1} and all("rank 2 has not answered" in v and "never sent one" in v
                                           for v in verdicts.values()), verdicts
    for b in beats:
        b.stop()


@pytest.mark.timeout(60)
def test_a_frozen_store_host_is_named() -> None:
    """The store's host (rank 0's process in a job) frozen: the heartbeats name it instead of waiting."""
    host = subprocess.Popen([sys.executable, "-c", (
        "import sys, time, torch.distributed as dist\n"
        "s = dist.TCPStore('127.0.0.1', 0, 1, True, wait_for_workers=False)\n"
        "print(s.port, flush=True)\n"
        "time.sleep(120)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert host.stdout is not None
        port = int(host.stdout.readline())
        client = dist.TCPStore("127.0.0.1", port, 1, False, timeout=timedelta(seconds=10))
        beats, verdicts = heartbeats(client, 2)
        for b in beats:
            b.start()
        host.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 20
        while len(verdicts) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert set(verdicts) == {0, 1} and all("hosted by rank 0, has not answered" in v
                                               for v in verdicts.values()), verdicts
        for b in beats:
            b.stop()
    finally:
        host.send_signal(signal.SIGCONT)
        host.kill()
        host.wait()


def test_bad_heartbeat_configuration_is_refused() -> None:
    store = dist.HashStore()
    with pytest.raises(ValueError, match="timeout"):
        Heartbeat(store, rank=0, world_size=2, timeout=5, on_dead=print)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="interval"):
        Heartbeat(store, rank=0, world_size=2, timeout=timedelta(seconds=1), on_dead=print, interval=2.0)
    with pytest.raises(ValueError, match="rank"):
        Heartbeat(store, rank=2, world_size=2, timeout=timedelta(seconds=1), on_dead=print)


@pytest.mark.timeout(60)
def test_a_stop_that_leaves_a_thread_running_does_not_queue_on_its_store_client() -> None:
    """stop() joins each thread for a bounded time. A store thread still running after it (here held in its progress
    callback, between its beat's two halves; in a job, blocked on the store) may hold the client's one connection:
    the "done" write would queue behind it, so it is left out, and stop() returns."""
    store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
    hold, inside, release = threading.Event(), threading.Event(), threading.Event()

    def progress() -> int:
        if hold.is_set():
            inside.set()
            release.wait(30)
        return 7

    # Rank 1 never starts: rank 0 watches it, silent well within the 60 s bound (no verdict).
    beat = Heartbeat(store, rank=0, world_size=2, timeout=timedelta(seconds=60), interval=0.05, name="t",
                     on_dead=lambda err: None, progress=progress)
    beat.start()
    threads = list(beat._threads)
    try:
        hold.set()
        assert inside.wait(20), "the store thread never beat again"
        beat.stop()
        assert dist.PrefixStore("lightning_partial/t/hb", store).get("0") != b"done"
    finally:
        release.set()
        for thread in threads:  # it ends with its beat, before the store's server goes
            thread.join(timeout=10)


# -- whole fits, one process per rank -----------------------------------------------
@pytest.mark.timeout(240 + 2 * COLLECTIVE_TIMEOUT_S)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_frozen_rank_is_named_and_every_other_rank_exits(tmp_path: Path, strategy: str) -> None:
    """SIGSTOP to rank 2 mid-fit: every other rank exits non-zero with an error naming rank 2."""
    out = tmp_path / strategy
    procs = start_ranks(out, *strategy_options(strategy), "--steps", "100000", "--straggle-ms", "5")
    codes: list[int | None] = []
    try:
        deadline = time.monotonic() + 150
        while len(list((out / "pids").glob("*.pid"))) < WORLD:
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "the fit did not start"
            time.sleep(0.2)  # polling for the ranks' pid files (not a timing assert)
        time.sleep(2)  # let some steps run (not a timing assert)
        os.kill(int((out / "pids" / "rank2.pid").read_text()), signal.SIGSTOP)
        survivors = [p for r, p in enumerate(procs) if r != 2]
        codes = wait_all(survivors, COLLECTIVE_TIMEOUT_S + 30 + 30)
    finally:
        kill_all(procs)
    logs = {r: (out / f"rank{r}.log").read_text(errors="replace") for r in range(WORLD)}
    for rank, code in zip([0, 1, 3], codes):
        assert code is not None, f"rank {rank} still running: a hang\n{logs[rank][-3000:]}"
        assert code != 0, logs[rank][-3000:]
        assert "rank 2 has not answered" in logs[rank], logs[rank][-3000:]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy", ["eager_sgd", "wagma_sgd", "abs_sgd"])  # ds_sync: wagma_sgd's engine
def test_a_rank_slower_than_the_collective_bound_is_not_declared_dead(tmp_path: Path, strategy: str) -> None:
    """Rank 1 sleeps 3x ``collective_timeout`` inside one training step: the fit completes, replicas identical.
    (Forked ranks: nothing here needs a process of its own per rank, and they skip the imports.)"""
    out = tmp_path / strategy
    proc = forkrun.run(
        [sys.executable, "-m", SCRIPT, "--out", str(out), "--devices", str(WORLD), "--launch", "fork",
         *strategy_options(strategy), "--steps", "16", "--sleep-at", f"5:1:{3 * COLLECTIVE_TIMEOUT_S}"],
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}, timeout=200,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    states = [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]
    for other in states[1:]:
        for key, value in states[0].items():
            assert torch.equal(value, other[key]), key
