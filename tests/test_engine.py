"""The partial-collective engine across 4 real gloo ranks (threads, TCPStore on loopback)."""

from __future__ import annotations

import contextlib
import functools
import operator
import random
import tempfile
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from lightning_partial.collectives import (
    EngineClosedError,
    PartialAllreduce,
    PartialAllreduceConfig,
    PartialCollectiveTimeout,
    RoundResult,
)

from distributed import run_threads

P = 4
MODES = [
    dict(mode="solo"),
    dict(mode="majority"),
    dict(mode="quorum", quorum=2),
    dict(mode="quorum", quorum=3),
    dict(mode="sync"),
]


def config(**kw) -> PartialAllreduceConfig:
    kw.setdefault("timeout", timedelta(seconds=30))
    # A short round timeout must not also bound the rendezvous: on a loaded CI host
    # one thread reached start() 20 s after the others.
    kw.setdefault("setup_timeout", timedelta(seconds=120))
    return PartialAllreduceConfig(**kw)


def random_delay(rng: random.Random, scale: float = 0.002) -> None:
    """Per-rank straggler delay: occasionally long, usually short."""
    time.sleep(rng.random() * scale * (8 if rng.random() < 0.1 else 1))


def train_loop(cfg, steps, grad, *, delay=None, shape=(5,), dtype=torch.float64):
    """Per rank: ``steps`` arrivals of ``grad(rank, step)``, then a flush; returns results and what was sent."""

    def fn(rank: int, store: dist.Store):
        engine = PartialAllreduce(cfg, store=store, rank=rank, world_size=P, like=torch.zeros(shape, dtype=dtype))
        engine.start()
        rng = random.Random(1000 + rank)
        sent, results = [], []
        try:
            for step in range(steps):
                if delay is not None:
                    delay(rank, step, rng)
                g = grad(rank, step)
                sent.append(g.clone())
                results.append(engine.arrive(g))
            results.append(engine.flush())
            assert engine.state_dict()["pending"] == []
        finally:
            engine.close()
        return sent, results

    return run_threads(P, fn)


def integer_grad(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank * 100003 + step)
    return torch.randint(-1000, 1000, (5,), generator=g).to(torch.float64)


def float_grad(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank * 100003 + step)
    return torch.randn(5, generator=g, dtype=torch.float64) * 1e3


def assert_identical(per_rank: list[list[RoundResult]]) -> None:
    for rank_results in per_rank[1:]:
        assert len(rank_results) == len(per_rank[0])
        for a, b in zip(per_rank[0], rank_results):
            assert a.round_index == b.round_index
            for x, y in zip(a.tensors, b.tensors):
                assert torch.equal(x, y), f"round {a.round_index} differs between ranks"
            assert dataclass_header(a) == dataclass_header(b)


def dataclass_header(r: RoundResult):
    s = r.stats
    return (s.activator, s.fresh, s.counts, s.staleness, s.progress, s.dropped, s.contributions, s.flush)


def test_sync_returns_exactly_all_reduce():
    """sync + normalize='sum' is bit-for-bit dist.all_reduce; 'world' is all_reduce / P."""
    steps = 20

    def fn(rank: int, store: dist.Store):
        ref_pg = dist.ProcessGroupGloo(dist.PrefixStore("ref", store), rank, P, timedelta(seconds=30))
        like = torch.zeros(1000, dtype=torch.float32)
        engines = [
            PartialAllreduce(config(mode="sync", normalize=n, name=n), store=store, rank=rank, world_size=P, like=like)
            for n in ("sum", "world")
        ]
        for e in engines:
            e.start()
        try:
            for step in range(steps):
                g = torch.randn(1000, generator=torch.Generator().manual_seed(rank * 7919 + step)) * 10 ** (step % 7)
                expected = g.clone()
                ref_pg.allreduce([expected]).wait()
                summed = engines[0].arrive(g)
                assert torch.equal(summed.tensors[0], expected), f"round {step}"
                assert summed.stats.fresh == (0, 1, 2, 3)
                world = engines[1].arrive(g)
                assert torch.equal(world.tensors[0], expected / P)
            for e in engines:
                assert e.flush().stats.contributions == 0
        finally:
            for e in engines:
                e.close()

    run_threads(P, fn)


@pytest.mark.parametrize("late", ["carry", "drop"])
@pytest.mark.parametrize("kw", MODES, ids=lambda kw: f"{kw['mode']}{kw.get('quorum', '')}")
def test_all_ranks_receive_identical_results(kw, late):
    per_rank = train_loop(
        config(late=late, normalize="contributors", **kw),
        steps=40,
        grad=float_grad,
        delay=lambda rank, step, rng: random_delay(rng),
        dtype=torch.float64,
    )
    assert_identical([results for _, results in per_rank])


@pytest.mark.parametrize("kw", MODES, ids=lambda kw: f"{kw['mode']}{kw.get('quorum', '')}")
def test_conservation_with_carry(kw):
    """Over 200+ rounds with random delays, what was applied sums exactly to what arrived."""
    per_rank = train_loop(
        config(late="carry", normalize="sum", **kw),
        steps=220,
        grad=integer_grad,
        delay=lambda rank, step, rng: random_delay(rng),
    )
    arrived = sum(g for sent, _ in per_rank for g in sent)
    results = per_rank[0][1]
    applied = sum(r.tensors[0] for r in results)
    assert torch.equal(applied, arrived)
    assert sum(r.stats.contributions for r in results) == P * 220
    if kw["mode"] != "sync":
        # The delays really made some gradients late (otherwise this proves nothing).
        assert any(r.stats.max_staleness > 0 for r in results)


@pytest.mark.parametrize("kw", [dict(mode="solo"), dict(mode="majority"), dict(mode="sync")], ids=lambda kw: kw["mode"])
def test_submit_and_collect_apart_conserve_and_agree(kw):
    """Overlap (eager_sgd's): step r submits round r, then collects round r - 1. Every round is collected once,
    in order; the results are identical on every rank and sum exactly to what arrived."""
    steps = 120

    def fn(rank: int, store: dist.Store):
        engine = PartialAllreduce(config(late="carry", normalize="sum", max_staleness=2, **kw), store=store,
                                  rank=rank, world_size=P, like=torch.zeros(5, dtype=torch.float64))
        engine.start()
        rng = random.Random(2000 + rank)
        sent, results, previous = [], [], None
        try:
            for step in range(steps):
                random_delay(rng, scale=0.004 if rank == P - 1 else 0.001)  # rank 3 slower: the others run ahead
                g = integer_grad(rank, step)
                sent.append(g.clone())
                q = engine.submit(g)
                assert q == step and engine.uncollected[-1] == q
                if previous is not None:
                    with pytest.raises(ValueError, match="collect them in that order"):
                        engine.collect(q)  # round r - 1 comes first
                    results.append(engine.collect(previous))
                previous = q
            with pytest.raises(RuntimeError, match=r"not collected \(\[119\]\): collect them first"):
                engine.flush()
            results.append(engine.collect(previous))
            results.append(engine.flush())
            assert engine.state_dict()["pending"] == []
        finally:
            engine.close()
        return sent, results

    per_rank = run_threads(P, fn)
    assert_identical([results for _, results in per_rank])
    results = per_rank[0][1]
    assert [r.round_index for r in results] == list(range(steps + 1))
    assert torch.equal(sum(r.tensors[0] for r in results), sum(g for sent, _ in per_rank for g in sent))
    assert sum(r.stats.contributions for r in results) == P * steps
    # A round holds no gradient of a later step (submitted before this rank's thread took the round).
    assert all(s is None or s >= 0 for r in results for s in r.stats.staleness), "a deposit ran ahead of its round"


def test_drop_policy_accounts_for_every_gradient():
    """late='drop' discards late gradients, but every one is counted: applied + dropped = arrived."""
    per_rank = train_loop(
        config(mode="solo", late="drop", normalize="sum"),
        steps=150,
        grad=lambda rank, step: torch.full((5,), float(rank + 1), dtype=torch.float64),
        delay=lambda rank, step, rng: random_delay(rng),
    )
    results = per_rank[0][1]
    applied = sum(r.stats.contributions for r in results)
    dropped = sum(sum(r.stats.dropped) for r in results)
    assert applied + dropped == P * 150
    assert dropped > 0
    assert all(s in (0, None) for r in results for s in r.stats.staleness)  # nothing stale is ever applied
    total = sum(r.tensors[0][0].item() for r in results)
    per_rank_applied = [sum(r.stats.counts[i] for r in results) for i in range(P)]
    assert total == sum((i + 1) * n for i, n in enumerate(per_rank_applied))


def test_solo_does_not_wait_for_a_straggler():
    """Rank 3 arrives at round 5 only after ranks 0-2 have *completed* round 5 and 6.

    If round 5 waited for rank 3, this would deadlock (and fail by timeout).
    Rank 3's step-5 gradient must then appear in a later round, stale.
    """
    straggle_at = 5
    done = {5: threading.Barrier(3), 6: threading.Barrier(3)}
    others_done = threading.Event()

    def delay(rank, step, rng):
        if rank == 3 and step == straggle_at:
            assert others_done.wait(timeout=20), "the others were blocked by the straggler"

    def grad(rank, step):
        value = 1000.0 if (rank == 3 and step == straggle_at) else 1.0
        return torch.full((5,), value, dtype=torch.float64)

    cfg = config(mode="solo", normalize="sum")

    def fn(rank, store):
        engine = PartialAllreduce(cfg, store=store, rank=rank, world_size=P, like=torch.zeros(5, dtype=torch.float64))
        engine.start()
        results = []
        try:
            for step in range(12):
                delay(rank, step, None)
                results.append(engine.arrive(grad(rank, step)))
                if rank != 3 and step in done:
                    if done[step].wait(timeout=20) == 0 and step == 6:
                        others_done.set()
            results.append(engine.flush())
        finally:
            engine.close()
        return results

    per_rank = run_threads(P, fn)
    assert_identical(per_rank)
    results = per_rank[0]
    assert 3 not in results[straggle_at].stats.fresh
    assert 3 not in results[6].stats.fresh  # round 6 did not wait either
    # The 1000 appears exactly once, in a later round, with rank 3 stale there.
    landing = [r for r in results if r.tensors[0][0].item() >= 1000]
    assert len(landing) == 1 and landing[0].round_index > 6
    assert landing[0].stats.oldest_staleness[3] >= 2


def test_majority_waits_for_the_shared_initiator():
    seed = 1234
    per_rank = train_loop(
        config(mode="majority", seed=seed, normalize="sum"),
        steps=60,
        grad=integer_grad,
        delay=lambda rank, step, rng: random_delay(rng),
    )
    expected = random.Random(seed)
    initiators = [expected.randrange(P) for _ in range(60)]
    for _, results in per_rank:
        assert [r.stats.initiator for r in results[:-1]] == initiators  # same sequence on every rank
        for r in results[:-1]:
            # The round activated on its initiator's arrival, hence the initiator is fresh.
            assert r.stats.activator == r.stats.initiator
            assert r.stats.initiator in r.stats.fresh
    assert len({len(r.stats.fresh) for r in per_rank[0][1][:-1]}) > 1  # not secretly synchronous


@pytest.mark.parametrize(
    "kw, least",
    [(dict(quorum=k), k) for k in (1, 2, 3, 4)] + [(dict(backup_workers=b), P - b) for b in (1, 2)],
    ids=lambda v: "-".join(f"{key}{value}" for key, value in v.items()) if isinstance(v, dict) else None,
)
def test_quorum_never_activates_with_fewer_than_k_fresh(kw, least):
    """quorum=k waits for k fresh arrivals; backup_workers=b for P - b, and no more are needed."""
    per_rank = train_loop(
        config(mode="quorum", normalize="sum", **kw),
        steps=60,
        grad=integer_grad,
        delay=lambda rank, step, rng: random_delay(rng),
    )
    rounds = per_rank[0][1][:-1]
    for r in rounds:
        assert len(r.stats.fresh) >= least, r.stats
    if "backup_workers" in kw:
        assert any(len(r.stats.fresh) < P for r in rounds), "every round waited for every rank: not a quorum"


@pytest.mark.parametrize("s", [0, 1, 3])
def test_max_staleness_bounds_how_far_a_rank_runs_ahead(s):
    entered = [0] * P
    violations = []
    lock = threading.Lock()

    def delay(rank, step, rng):
        if rank == 3:
            time.sleep(0.004)  # a persistent straggler
        with lock:
            ahead = step - min(entered)
            if ahead > s:
                violations.append((rank, step, list(entered)))
            entered[rank] += 1

    per_rank = train_loop(config(mode="solo", max_staleness=s, normalize="sum"), steps=40, grad=integer_grad, delay=delay)
    assert violations == []
    for r in per_rank[0][1]:
        assert r.stats.max_staleness <= s
        if s == 0 and not r.stats.flush:
            assert r.stats.fresh == (0, 1, 2, 3)
    assert torch.equal(sum(r.tensors[0] for r in per_rank[0][1]), sum(g for sent, _ in per_rank for g in sent))


def test_sync_every_makes_periodic_rounds_synchronous():
    per_rank = train_loop(
        config(mode="solo", sync_every=4, normalize="sum"),
        steps=24,
        grad=integer_grad,
        delay=lambda rank, step, rng: random_delay(rng),
    )
    for r in per_rank[0][1][:-1]:
        if (r.round_index + 1) % 4 == 0:
            assert r.stats.synchronous and r.stats.fresh == (0, 1, 2, 3)


def test_sync_from_makes_every_later_round_synchronous_and_applies_every_carried_gradient():
    """The synchronous finish: from round ``sync_from`` on, every round holds every rank's fresh gradient, and
    the first of them also every gradient still carried; nothing computed is lost (integers: exact)."""
    steps, sync_from = 24, 16
    per_rank = train_loop(
        config(mode="solo", sync_from=sync_from, normalize="sum"),
        steps=steps,
        grad=integer_grad,
        delay=lambda rank, step, rng: time.sleep(0.004 if rank == 3 else 0.0),
    )
    results = per_rank[0][1][:-1]  # the flush is last
    partial = sum(r.stats.fresh != (0, 1, 2, 3) for r in results[:sync_from])
    assert partial > 0, "every round before the finish was complete: the test exercises nothing"
    for r in results[sync_from:]:
        assert r.stats.synchronous and r.stats.activator == -1 and r.stats.fresh == (0, 1, 2, 3)
    for r in results[sync_from + 1:]:
        # Every carried gradient went into the first synchronous round: the later ones hold exactly this step's.
        assert torch.equal(r.tensors[0], sum(sent[r.round_index] for sent, _ in per_rank))
    assert per_rank[0][1][-1].tensors[0].abs().sum() == 0  # the flush finds nothing left
    assert torch.equal(sum(r.tensors[0] for r in per_rank[0][1]), sum(g for sent, _ in per_rank for g in sent))
    for _, rank_results in per_rank[1:]:  # every rank applies the same rounds
        assert all(torch.equal(a.tensors[0], b.tensors[0]) for a, b in zip(rank_results, per_rank[0][1]))


def test_several_tensors_and_dtypes():
    like = [torch.zeros(3, 2), torch.zeros(4, dtype=torch.float64), torch.zeros(1)]

    def fn(rank, store):
        with PartialAllreduce(config(mode="sync", normalize="sum"), store=store, rank=rank, world_size=P, like=like) as e:
            e.start()
            r = e.arrive([torch.full_like(t, rank + 1) for t in like])
            assert [t.shape for t in r.tensors] == [t.shape for t in like]
            assert [t.dtype for t in r.tensors] == [t.dtype for t in like]
            assert all(torch.all(t == 10) for t in r.tensors)
            with pytest.raises(ValueError, match="changed since the first round"):
                e.arrive([torch.zeros(3, 3), torch.zeros(4, dtype=torch.float64), torch.zeros(1)])
            with pytest.raises(ValueError, match="changed since the first round"):
                e.arrive([t.float() for t in like])
            e.flush()

    run_threads(P, fn)


def test_checkpoint_carries_pending_gradients():
    """state_dict/load_state_dict keeps the round counter, RNG and carried gradients."""
    like = torch.zeros(2, dtype=torch.float64)

    def fn(rank, store):
        first = PartialAllreduce(config(mode="majority", seed=7, name="a"), store=store, rank=rank, world_size=P, like=like)
        state = first.state_dict()
        state["pending"] = [[torch.full((2,), float(rank + 1), dtype=torch.float64)]]
        state["pending_steps"] = [4]
        state["step"] = 5
        second = PartialAllreduce(
            config(mode="majority", seed=7, name="b", normalize="sum"), store=store, rank=rank, world_size=P, like=like
        )
        second.load_state_dict(state)
        second.start()
        try:
            assert second.step == 5
            r = second.flush()
            assert r.round_index == 5 and r.stats.flush
            assert torch.equal(r.tensors[0], torch.full((2,), 10.0, dtype=torch.float64))
            assert r.stats.oldest_staleness == (1, 1, 1, 1)
        finally:
            second.close()
        with pytest.raises(ValueError, match="do not match"):
            third = PartialAllreduce(config(name="c"), store=store, rank=rank, world_size=P, like=like)
            third.load_state_dict({**state, "pending": [[torch.zeros(3)]]})

    run_threads(P, fn)


def test_store_stays_flat():
    """Old keys are deleted: the store holds the same number of keys after 40 and after 240 rounds."""
    counts = {}

    def fn(rank, store):
        e = PartialAllreduce(
            config(mode="solo", max_staleness=2), store=store, rank=rank, world_size=P, like=torch.zeros(1)
        )
        e.start()
        try:
            for step in range(240):
                e.arrive(torch.ones(1))
                if rank == 0 and step in (40, 239):
                    time.sleep(0.05)  # let deferred deletions run (not a timing assert)
                    counts[step] = store.num_keys()
            e.flush()
        finally:
            e.close()

    run_threads(P, fn)
    assert counts[239] <= counts[40] + 2 * P, counts


def test_a_late_wake_leaves_no_key_behind():
    """A caller reads its thread's waiting round, then wakes it; if the round ran and was collected in between,
    the wake creates its activation key again. The next collection deletes it (here the late wake is made by
    hand, after round 1 completed, i.e. after round 0 was collected)."""
    def fn(rank, store):
        e = PartialAllreduce(config(mode="solo", name="latewake"), store=store, rank=rank, world_size=2,
                             like=torch.zeros(1))
        e.start()
        try:
            for step in range(4):
                e.arrive(torch.ones(1))
                if step == 1:
                    e._control.wake(0)  # as a deposit() that read round 0 as the one its thread waits for
            e.flush()
            return store.check([f"lightning_partial/latewake/ctl/go/0/{rank}"])
        finally:
            e.close()

    assert run_threads(2, fn, timeout=60) == [False, False]


def _control_stores(kind: str):
    """The store two ControlPlanes share (each opens its own clients of it), of each kind c10d has."""
    if kind.startswith("tcp"):
        return dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timedelta(seconds=30), wait_for_workers=False,
                             use_libuv=kind == "tcp_libuv")
    if kind == "file":
        return dist.FileStore(tempfile.mktemp(prefix="lp_control_"), 2)
    return dist.HashStore()


@pytest.mark.parametrize("kind", ["tcp_libuv", "tcp_classic", "file", "hash"])
def test_a_wake_wakes_its_thread_and_never_hides_another_ranks_activation(kind):
    """The activation key a rank's own wake() shares with the rounds, on every kind of store: a wake
    unblocks that rank's thread waiting for the round; a round that another rank activated reads as
    activated on this rank whichever came first (a wake that replaced an activation left a paused rank's
    communication thread waiting for an activation of its own); a wake alone reads as a wake."""
    from lightning_partial.collectives.control import ControlPlane

    store = _control_stores(kind)
    me, other = (ControlPlane(store, name=f"wake-{kind}", rank=r, world_size=2, timeout=timedelta(seconds=30))
                 for r in range(2))
    waited: list[BaseException | None] = []

    def wait() -> None:
        try:
            me.wait_activated(5, timedelta(seconds=30))
            waited.append(None)
        except BaseException as err:  # noqa: BLE001 - reported by the assert below
            waited.append(err)

    thread = threading.Thread(target=wait)
    thread.start()
    thread.join(0.5)  # let it block in the store's wait (the wake ends the wait whenever it comes)
    me.wake(5)
    thread.join(60)
    assert waited == [None] and me.only_woken(5) and not me.is_activated(5), waited

    other.activate_from_comm(7)
    me.wake(7)  # after another rank's activation
    me.wake(8)
    other.activate_from_comm(8)  # before it
    for r in (7, 8):
        assert me.is_activated(r) and not me.only_woken(r)
    me.wake(9)
    me.wake(9)
    assert not me.is_activated(9) and me.only_woken(9)


def test_close_is_bounded_and_idempotent():
    def fn(rank, store):
        e = PartialAllreduce(config(mode="sync"), store=store, rank=rank, world_size=P, like=torch.zeros(1))
        e.start()
        e.arrive(torch.ones(1))
        # The communication thread now blocks waiting for round 1, which never comes.
        e.close(timeout=5)
        e.close(timeout=5)
        # Unwoken, the thread would still block in the store (30 s timeout) after close's 5 s bound.
        assert not e._thread.is_alive()
        with pytest.raises(EngineClosedError, match=f"rank {rank}"):
            e.arrive(torch.ones(1))

    run_threads(P, fn)


def _a_stalled_rank_is_named_behind(engines_per_rank: int) -> None:
    """Sync mode, ``engines_per_rank`` engines per rank (the first ones 8 rounds on, as optimizers stepping at
    different rates): rank 2 stays alive but stops arriving at the last engine's round 2; the others raise,
    naming rank and round and, by the heartbeats (alive: no verdict), rank 2 behind in that engine's rounds."""
    from lightning_partial.collectives import Heartbeat

    raised = threading.Semaphore(0)
    several = engines_per_rank > 1

    def fn(rank, store):
        engines = [PartialAllreduce(config(mode="sync", timeout=timedelta(seconds=2), name=f"e{i}"), store=store,
                                    rank=rank, world_size=P, like=torch.zeros(1)) for i in range(engines_per_rank)]
        beat = Heartbeat(store, rank=rank, world_size=P, timeout=timedelta(seconds=60), interval=0.05, name="t",
                         on_dead=lambda err: None, progress=lambda: max(e.round_reached for e in engines),
                         rounds_comparable=not several,
                         engine_rounds=(lambda: [e.round_reached for e in engines]) if several else None)
        for i, e in enumerate(engines):
            e.attach_liveness(beat, engine=i if several else None)
        beat.start()
        for e in engines:
            e.start()
        try:
            for e in engines[:-1]:
                for _ in range(8):
                    e.arrive(torch.ones(1))
            for step in range(3):
                if rank == 2 and step == 2:
                    # Stay alive (a stalled rank, not a dead one) until the others gave up.
                    assert all(raised.acquire(timeout=20) for _ in range(P - 1))
                    return "absent"
                engines[-1].arrive(torch.ones(1))
        except PartialCollectiveTimeout as err:
            raised.release()
            assert f"rank {rank}" in str(err) and "round 2" in str(err), str(err)
            assert "behind by their last heartbeats: rank 2 (round 2), the others at round 3" in str(err), str(err)
            return "timeout"
        finally:
            for e in engines:
                e.close(timeout=2)
            beat.stop()
        return "completed"

    assert run_threads(P, fn, timeout=40) == ["timeout", "timeout", "absent", "timeout"]


def test_missing_rank_times_out_with_rank_and_round():
    """In sync mode a live rank that stops arriving makes the others raise, naming rank and round, and, by the
    ranks' heartbeats (alive: no verdict), the rank that is behind."""
    _a_stalled_rank_is_named_behind(1)


def test_a_timed_out_round_of_one_of_several_engines_names_the_ranks_behind_in_its_own_rounds():
    """Two engines per rank (two optimizers), the first 8 rounds ahead of the second: the beats carry the
    largest round of any, which cannot compare the second engine's rounds; each engine's round rides beside it,
    and a timed-out round of the second engine names the rank behind in that engine's rounds."""
    _a_stalled_rank_is_named_behind(2)


def test_setup_timeout_bounds_the_rendezvous_and_timeout_the_rounds():
    """Ranks may reach start() further apart than the round timeout (within setup_timeout);
    a round with a missing rank still fails after the round timeout, naming rank and round."""
    # The ranks that time out close only once all of them have raised: a rank whose close came first
    # would end the others' allreduce with gloo's "connection closed" before their own bound fired.
    raised = threading.Barrier(P - 1)

    def fn(rank, store):
        e = PartialAllreduce(
            config(mode="sync", timeout=timedelta(seconds=1), setup_timeout=timedelta(seconds=60)),
            store=store, rank=rank, world_size=P, like=torch.zeros(1),
        )
        if rank == P - 1:
            time.sleep(3)  # three round timeouts after the others
        e.start()
        assert e._data_pg.options._timeout == timedelta(seconds=1)  # its collectives: the round's bound
        try:
            if rank == P - 1:
                time.sleep(8)  # absent from round 0 until the others gave up
                return "absent"
            # The round's 1 s bound applies, not the 60 s set-up bound: whichever of this rank's
            # waits on it expires first (the caller's wait for the result, or the communication
            # thread's allreduce) names it.
            with pytest.raises(PartialCollectiveTimeout, match=rf"rank {rank}, round 0\] .*timed out after 1s"):
                e.arrive(torch.ones(1))
            raised.wait(timeout=20)
            return "timeout"
        finally:
            e.close(timeout=2)

    assert run_threads(P, fn, timeout=60) == ["timeout"] * (P - 1) + ["absent"]


def test_a_rank_that_never_starts_fails_the_others_start_naming_the_rank():
    def fn(rank, store):
        e = PartialAllreduce(
            config(mode="solo", setup_timeout=timedelta(seconds=2)), store=store, rank=rank, world_size=P,
            like=torch.zeros(1),
        )
        if rank == P - 1:
            return "never started"
        with pytest.raises(PartialCollectiveTimeout, match=rf"rank {rank}\].*setup_timeout.*every rank must call start"):
            e.start()
        e.close()  # not started: nothing to stop
        return "raised"

    assert run_threads(P, fn, timeout=60) == ["raised"] * (P - 1) + ["never started"]


def test_close_with_nothing_in_flight_releases_the_groups_at_once(retired):
    """After a flush, or while the communication thread waits for a round, close() drops the
    groups itself; only an engine that may have a collective in flight retires them."""
    barrier = threading.Barrier(P)

    def fn(rank, store):
        engines = []
        for name, flush in (("flushed", True), ("waiting", False)):
            e = PartialAllreduce(config(mode="solo", name=name), store=store, rank=rank, world_size=P,
                                 like=torch.zeros(2))
            e.start()
            for _ in range(3):
                e.arrive(torch.ones(2))
            if flush:
                e.flush()
            barrier.wait(timeout=30)  # no rank arrives any more: every thread waits for round 3
            e.close()
            engines.append(e)
        return [(e._header_pg, e._data_pg) for e in engines]

    for groups in run_threads(P, fn):
        assert groups == [(None, None), (None, None)]
    assert retired == []


def test_close_during_a_collective_retires_the_groups(retired):
    """Rank 0 alone in a synchronous round: its thread is inside the allreduce when it closes. The engine lets go of
    its store clients as well (the stuck thread keeps its own reference), as every closed engine does."""

    def fn(rank, store):
        e = PartialAllreduce(config(mode="sync", timeout=timedelta(seconds=30)), store=store, rank=rank,
                             world_size=P, like=torch.zeros(1))
        e.start()
        if rank == 0:
            def arrive():
                with contextlib.suppress(Exception):
                    e.arrive(torch.ones(1))

            caller = threading.Thread(target=arrive, daemon=True)
            caller.start()
            deadline = time.monotonic() + 30
            while not e._in_round:  # its communication thread has entered round 0's allreduce
                assert time.monotonic() < deadline, "rank 0's thread never entered round 0"
                time.sleep(0.01)
            e.close(timeout=1)  # the thread stays inside the collective: stuck
            caller.join(timeout=10)
        else:
            e.close()  # waiting for its own arrival: nothing in flight
        return e._data_pg is None and e._control is None and e._store is None

    assert run_threads(P, fn, timeout=60) == [True] * P
    assert retired == [0]


def test_flush_at_different_steps_is_an_error():
    def fn(rank, store):
        e = PartialAllreduce(
            config(mode="solo", timeout=timedelta(seconds=3)), store=store, rank=rank, world_size=P, like=torch.zeros(1)
        )
        e.start()
        try:
            if rank == 0:
                e.flush()
            else:
                e.arrive(torch.ones(1))
            return "no error"
        except Exception as err:  # noqa: BLE001
            return str(err)
        finally:
            e.close(timeout=2)

    messages = run_threads(P, fn, timeout=30)
    # The flusher always fails clearly. The others fail too when the flusher's mark
    # reached round 0's header; when their arrivals ran round 0 before rank 0
    # flushed, round 0 was an ordinary round for them (their next one would fail).
    assert "same step" in messages[0] and "round 0" in messages[0], messages
    assert all(m == "no error" or "same step" in m for m in messages[1:]), messages


def test_world_size_one():
    def fn(rank, store):
        with PartialAllreduce(config(mode="solo"), store=store, rank=0, world_size=1, like=torch.zeros(2)) as e:
            e.start()
            assert torch.equal(e.arrive(torch.ones(2)).tensors[0], torch.ones(2))
            e.flush()

    run_threads(1, fn)


class TestBadInput:
    @pytest.mark.parametrize(
        "kw, match",
        [
            (dict(mode="eager"), "unknown mode 'eager'"),
            (dict(mode="quorum"), "needs either quorum=k"),
            (dict(mode="quorum", quorum=2, backup_workers=1), "needs either quorum=k"),
            (dict(mode="quorum", backup_workers=-1), "backup_workers must be an integer >= 1"),
            (dict(mode="quorum", backup_workers=True), "backup_workers must be an integer >= 1"),
            (dict(mode="majority", backup_workers=1), "backup_workers=1 is only meaningful with mode='quorum'"),
            (dict(mode="quorum", quorum=0), "quorum must be an integer >= 1"),
            (dict(mode="solo", quorum=2), "only meaningful with mode='quorum'"),
            (dict(late="keep"), "unknown late policy"),
            (dict(normalize="mean"), "unknown normalize"),
            (dict(max_staleness=-1), "max_staleness must be an integer >= 0"),
            (dict(sync_every=0), "sync_every must be an integer >= 1"),
            (dict(sync_from=-1), "sync_from must be an integer >= 0"),
            (dict(sync_from=2.5), "sync_from must be an integer >= 0"),
            (dict(timeout=timedelta(0)), "timeout must be a positive"),
            (dict(timeout=5), "timeout must be a positive"),
            (dict(setup_timeout=timedelta(seconds=-1)), "setup_timeout must be a positive"),
            (dict(setup_timeout=60), "setup_timeout must be a positive"),
            (dict(name="a/b"), "name must be"),
        ],
    )
    def test_config(self, kw, match):
        with pytest.raises(ValueError, match=match):
            PartialAllreduceConfig(**kw)

    @pytest.mark.parametrize(
        "kw, world, rank, match",
        [
            (dict(mode="quorum", quorum=5), 4, 0, r"quorum must be in 1..4"),
            (dict(mode="quorum", backup_workers=4), 4, 0, r"backup_workers must be below the world size 4"),
            (dict(mode="majority"), 1, 0, "majority' needs at least 2 ranks"),
            (dict(mode="solo"), 4, 4, r"rank must be in 0..3"),
            (dict(mode="solo"), 0, 0, "world size must be an integer >= 1, got 0"),
            (dict(mode="solo"), True, 0, "world size must be an integer >= 1, got True"),
            (dict(mode="solo"), 2.5, 0, r"world size must be an integer >= 1, got 2\.5"),
        ],
    )
    def test_engine(self, kw, world, rank, match):
        with pytest.raises(ValueError, match=match):
            PartialAllreduce(PartialAllreduceConfig(**kw), store=dist.HashStore(), rank=rank, world_size=world, like=torch.zeros(1))

    def test_empty_and_non_tensor(self):
        with pytest.raises(ValueError, match="at least one tensor"):
            PartialAllreduce(PartialAllreduceConfig(), store=dist.HashStore(), rank=0, world_size=1, like=[])
        with pytest.raises(ValueError, match="not a torch.Tensor"):
            PartialAllreduce(PartialAllreduceConfig(), store=dist.HashStore(), rank=0, world_size=1, like=[1.0])

    def test_arrive_before_start(self):
        e = PartialAllreduce(PartialAllreduceConfig(), store=dist.HashStore(), rank=0, world_size=1, like=torch.zeros(1))
        with pytest.raises(EngineClosedError, match="call start"):
            e.arrive(torch.zeros(1))
        e.close()


def test_released_buffers_are_reused_without_aliasing_kept_results():
    """release() recycles memory; results that were not released are never overwritten."""

    def fn(rank, store):
        like = torch.zeros(3, dtype=torch.float64)
        with PartialAllreduce(config(mode="solo", normalize="sum"), store=store, rank=rank, world_size=P, like=like) as e:
            e.start()
            kept = [e.arrive(torch.full((3,), float(step), dtype=torch.float64)) for step in range(5)]
            snapshot = [r.tensors[0].clone() for r in kept]
            for step in range(5, 40):
                r = e.arrive(torch.full((3,), float(step), dtype=torch.float64))
                r.release()
                r.release()  # idempotent: the buffer is pooled once
            e.flush().release()
            for r, before in zip(kept, snapshot):
                assert torch.equal(r.tensors[0], before)
            return [r.tensors[0].clone() for r in kept]

    per_rank = run_threads(P, fn)
    assert all(torch.equal(a, b) for other in per_rank[1:] for a, b in zip(per_rank[0], other))


@pytest.mark.parametrize("mode", ["solo", "sync"])
def test_resume_with_max_staleness_and_store_cleanup(mode):
    """A run resumed at step k does not wait for gates of steps before k; no key survives the flush."""
    like = torch.zeros(1)
    def fn(rank, store):
        e = PartialAllreduce(config(mode=mode, max_staleness=2, normalize="sum"), store=store, rank=rank, world_size=P, like=like)
        e.load_state_dict({**e.state_dict(), "step": 10})
        e.start()
        results = [e.arrive(torch.ones(1)) for _ in range(30)]
        results.append(e.flush())
        e.close()
        return [r.round_index for r in results], sum(r.tensors[0].item() for r in results)

    per_rank = run_threads(P, fn)
    assert per_rank[0][0] == list(range(10, 41))
    assert all(total == P * 30 for _, total in per_rank)


def test_no_round_key_survives_the_flush():
    """After flush and close, no arrival, gate or activation key of any round is left in the store."""
    configs = {
        "a": dict(mode="solo", max_staleness=2),
        "b": dict(mode="majority", max_staleness=3),
        "c": dict(mode="sync", max_staleness=1),
        "d": dict(mode="quorum", quorum=2),
        "e": dict(mode="solo", sync_every=3, max_staleness=1),
    }
    steps = 25
    all_closed = threading.Barrier(P)

    def fn(rank, store):
        for name, kw in configs.items():
            e = PartialAllreduce(config(name=name, **kw), store=store, rank=rank, world_size=P, like=torch.zeros(1))
            e.start()
            for _ in range(steps):
                e.arrive(torch.ones(1))
            e.flush()
            e.close()
        all_closed.wait(timeout=30)
        left = []
        if rank == 0:
            for name in configs:
                ctl = dist.PrefixStore(f"lightning_partial/{name}/ctl", store)
                for r in range(steps + 6):
                    for key in [f"n/{r}", f"g/{r}"] + [f"go/{r}/{i}" for i in range(P)]:
                        if ctl.check([key]):
                            left.append(f"{name}: {key}")
        return left

    assert run_threads(P, fn)[0] == []


def test_close_wakes_a_caller_blocked_in_arrive():
    def fn(rank, store):
        e = PartialAllreduce(config(mode="sync", timeout=timedelta(seconds=20)), store=store, rank=rank, world_size=P, like=torch.zeros(1))
        e.start()
        if rank != 0:
            time.sleep(0.5)  # straggler delay: rank 0 is then blocked in arrive, waiting for them
            e.close()
            return "closed"
        closer = threading.Timer(0.2, e.close)
        closer.start()
        # Without the wake-up this would be a PartialCollectiveTimeout after 20 s instead.
        with pytest.raises(EngineClosedError, match="rank 0"):
            e.arrive(torch.ones(1))
        closer.join()
        return "woken"

    assert run_threads(P, fn) == ["woken", "closed", "closed", "closed"]


@pytest.mark.parametrize("mode", ["solo", "majority"])
def test_request_stop_ends_every_rank_at_the_same_round(mode):
    """One rank asks to stop: all ranks learn it in the same round R, and none runs a round after R."""

    def fn(rank, store):
        e = PartialAllreduce(config(mode=mode), store=store, rank=rank, world_size=P, like=torch.zeros(2))
        e.start()
        rng = random.Random(rank)
        rounds = []
        try:
            for step in range(200):
                random_delay(rng)
                if rank == 2 and step == 10:
                    e.request_stop()
                result = e.arrive(torch.ones(2))
                rounds.append(result.round_index)
                if result.stats.stop:
                    with pytest.raises(EngineClosedError, match="requested a stop"):
                        e.arrive(torch.ones(2))
                    return result.round_index, rounds
            return None, rounds
        finally:
            e.close()

    per_rank = run_threads(P, fn)
    stops = {stop for stop, _ in per_rank}
    assert len(stops) == 1 and None not in stops
    (stop,) = stops
    assert stop >= 10
    assert all(rounds == list(range(stop + 1)) for _, rounds in per_rank)


def test_request_stop_is_refused_in_pure_sync_mode():
    e = PartialAllreduce(config(mode="sync"), store=dist.HashStore(), rank=0, world_size=1, like=torch.zeros(1))
    with pytest.raises(ValueError, match="header"):
        e.request_stop()
    with pytest.raises(ValueError, match="header"):
        e.request_finish()
    with pytest.raises(ValueError, match="header"):
        e.announce(1)


@pytest.mark.parametrize("flags", [0, -1, 1 << 62, True, 1.0])
def test_announce_refuses_bits_outside_its_range(flags):
    e = PartialAllreduce(config(mode="solo"), store=dist.HashStore(), rank=0, world_size=1, like=torch.zeros(1))
    with pytest.raises(ValueError, match=r"announce\(\) takes bits"):
        e.announce(flags)


@pytest.mark.parametrize("mode", ["solo", "majority"])
def test_announcements_and_a_finish_reach_every_rank_in_the_same_round(mode):
    """Rank 0 announces bits twice and asks to finish; rank 3 announces once: every rank sees each
    announcement in exactly one round, the same on every rank (bits announced together arrive together), and
    the finish from the same round on, while the rounds go on to the flush."""

    def fn(rank, store):
        e = PartialAllreduce(config(mode=mode), store=store, rank=rank, world_size=P, like=torch.zeros(2))
        e.start()
        rng = random.Random(rank)
        announced, finish = {}, None
        try:
            for step in range(40):
                random_delay(rng)
                if rank == 0 and step in (5, 6):
                    e.announce(1 << step)
                if rank == 3 and step == 12:
                    e.announce(2)
                if rank == 0 and step == 20:
                    e.request_finish()
                result = e.arrive(torch.ones(2))
                if result.stats.announced:
                    announced[result.round_index] = result.stats.announced
                if finish is None and result.stats.finish:
                    finish = result.round_index
                assert finish is None or result.stats.finish, "a finish, once seen, is in every later round"
            last = e.flush()
            return announced, finish, last.round_index
        finally:
            e.close()

    per_rank = run_threads(P, fn)
    assert all(r == per_rank[0] for r in per_rank), per_rank
    announced, finish, last = per_rank[0]
    assert sum(bin(bits).count("1") for bits in announced.values()) == 3, announced
    assert functools.reduce(operator.or_, announced.values()) == (1 << 5) | (1 << 6) | 2
    assert finish is not None and 20 <= finish < 40 and last == 40


@pytest.mark.parametrize(
    "kw, overlap",
    [(dict(mode="solo", max_staleness=1), False), (dict(mode="solo", max_staleness=None), False),
     (dict(mode="majority", max_staleness=2), False), (dict(mode="solo", max_staleness=1), True),
     (dict(mode="quorum", quorum=2, max_staleness=None), True)],
    ids=["solo-s1", "solo-unbounded", "majority-s2", "solo-s1-overlap", "quorum-overlap"],
)
def test_a_requested_synchronous_finish_begins_at_the_same_round_on_every_rank(kw, overlap):
    """Rank 0 asks for the synchronous finish at step 30 (``request_sync``; twice, the second changes nothing)
    while rank 3 straggles: every rank finds the request in the same round R, with the first synchronous round
    at ``R + max_staleness + 2``; from there every round is synchronous and holds every rank's gradient of its
    own step (the late ones applied in the first of them), and what arrived is summed exactly (nothing lost).
    With ``overlap`` each step submits its round before collecting the previous one (eager_sgd's overlap)."""
    steps = 80

    def fn(rank: int, store: dist.Store):
        engine = PartialAllreduce(config(late="carry", normalize="sum", **kw), store=store, rank=rank,
                                  world_size=P, like=torch.zeros(5, dtype=torch.float64))
        engine.start()
        rng = random.Random(3000 + rank)
        sent, results, previous, seen = [], [], None, []
        try:
            for step in range(steps):
                random_delay(rng, scale=0.006 if rank == P - 1 else 0.001)
                if rank == 0 and step in (30, 31):
                    engine.request_sync()
                g = integer_grad(rank, step)
                sent.append(g.clone())
                if overlap:
                    q = engine.submit(g)
                    if previous is not None:
                        results.append(engine.collect(previous))
                    previous = q
                else:
                    results.append(engine.arrive(g))
                if results and results[-1].stats.sync_from is not None:
                    seen.append((results[-1].round_index, results[-1].stats.sync_from, engine.sync_from))
            if previous is not None:
                results.append(engine.collect(previous))
            results.append(engine.flush())
            assert engine.state_dict()["pending"] == []
        finally:
            engine.close()
        return sent, results, seen

    per_rank = run_threads(P, fn)
    assert_identical([results for _, results, _ in per_rank])
    seen = per_rank[0][2]
    assert all(other == seen for _, _, other in per_rank), [s for _, _, s in per_rank]
    assert len(seen) == 1, seen  # the second request rode no round of its own, or changed nothing
    request_round, first, in_force = seen[0]
    # Rank 0's thread had taken round 29 (28 with overlap) when its caller asked at step 30.
    assert request_round >= 30 - overlap and first == request_round + (kw["max_staleness"] or 0) + 2
    assert in_force == first
    results = per_rank[0][1]
    assert [r.round_index for r in results] == list(range(steps + 1))
    assert first < steps
    for r in results[first:steps]:
        assert r.stats.synchronous and r.stats.fresh == tuple(range(P)), (r.round_index, r.stats)
    assert all(s == 0 for r in results[first + 1:steps] for s in r.stats.staleness)
    # The straggler made some earlier rounds partial (otherwise this proves nothing).
    assert any(r.stats.fresh != tuple(range(P)) for r in results[:request_round])
    assert torch.equal(sum(r.tensors[0] for r in results), sum(g for sent, _, _ in per_rank for g in sent))


def test_request_sync_is_refused_where_it_cannot_ride_and_the_configured_finish_is_kept_where_it_comes_first():
    e = PartialAllreduce(config(mode="sync"), store=dist.HashStore(), rank=0, world_size=1, like=torch.zeros(1))
    with pytest.raises(ValueError, match="header"):
        e.request_sync()
    from lightning_partial.collectives import DelayedAllreduce, DelayedConfig

    delayed = DelayedAllreduce(DelayedConfig(target_samples=4), store=dist.HashStore(), rank=0, world_size=1, like=torch.zeros(1))
    with pytest.raises(NotImplementedError, match="request_sync"):
        delayed.request_sync()
    assert delayed.sync_from is None  # its own finish: none configured
    e = PartialAllreduce(config(mode="solo", sync_from=50), store=dist.HashStore(), rank=0, world_size=1,
                         like=torch.zeros(1))
    assert e.sync_from == 50
    e._requested_sync_from = 30
    assert e.sync_from == 30 and e._known_sync(30) and not e._known_sync(29)
    e._requested_sync_from = 70
    assert e.sync_from == 50 and e._known_sync(50)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_header_rides_in_the_data_allreduce_exactly(dtype):
    """gloo and host tensors: one collective a round, and the header survives it exactly.

    The header travels as 8-bit limbs in the data buffer's tail; step numbers
    beyond 2**40 (a resumed run) and bfloat16 data (8 significant bits) must
    still come back exact, and the data must not see the tail.
    """
    start = 2**40 + 3
    steps = 4

    def fn(rank: int, store: dist.Store):
        cfg = config(mode="quorum", quorum=P)  # every rank fresh every round: a known header
        engine = PartialAllreduce(cfg, store=store, rank=rank, world_size=P, like=torch.zeros(7, dtype=dtype))
        state = engine.state_dict()
        engine.load_state_dict({**state, "step": start})
        issued: list[str] = []
        inner = engine._start

        def counting_start(pg, tensor, r, what):
            issued.append(what)
            return inner(pg, tensor, r, what)

        engine._start = counting_start
        engine.start()
        try:
            results = [engine.arrive(torch.full((7,), float(rank + step), dtype=dtype)) for step in range(steps)]
            last = engine.flush()
        finally:
            engine.close()
        return issued, results, last

    out = run_threads(P, fn)
    for issued, results, last in out:
        assert issued == ["data"] * (steps + 1), "the header must ride in the data allreduce"
        for step, res in enumerate(results):
            r = start + step
            assert res.round_index == r
            assert res.stats.fresh == tuple(range(P))
            assert res.stats.counts == (1,) * P
            assert res.stats.staleness == (0,) * P
            assert res.stats.progress == (r + 1,) * P
            assert res.stats.dropped == (0,) * P
            expected = sum(rank + step for rank in range(P)) / P  # small integers / 4: exact in bfloat16
            assert torch.equal(res.tensors[0], torch.full((7,), expected, dtype=dtype))
        assert last.stats.flush and last.stats.contributions == 0 and last.round_index == start + steps


def test_header_has_its_own_allreduce_in_sync_mode():
    """Pure sync mode keeps buffers of the data's own length (bit-identical to dist.all_reduce): no tail."""

    def fn(rank: int, store: dist.Store):
        engine = PartialAllreduce(config(mode="sync"), store=store, rank=rank, world_size=P, like=torch.zeros(3))
        assert engine.layout.tail == 0
        engine.start()
        try:
            engine.arrive(torch.ones(3))
            return engine.flush().stats.flush
        finally:
            engine.close()

    assert run_threads(P, fn) == [True] * P


@pytest.mark.parametrize("s", [None, 2])
def test_skip_catches_up_and_conserves_what_was_sent(s):
    """A persistently slow rank that skips every step whose round ran without it (``behind``) stays within a round
    or two of the others instead of falling further behind; every result is identical on every rank, the
    applied sum equals exactly what was sent (a skip sends nothing), and ``stats.skipped`` marks the skips."""
    steps = 60
    skipped_steps: dict[int, list[int]] = {}
    lag: list[int] = []
    entered = [0] * P
    lock = threading.Lock()

    def fn(rank, store):
        engine = PartialAllreduce(config(mode="solo", normalize="sum", max_staleness=s), store=store, rank=rank,
                                  world_size=P, like=torch.zeros(5, dtype=torch.float64))
        engine.start()
        sent, results, skipped = [], [], []
        try:
            for step in range(steps):
                with lock:
                    entered[rank] = step
                    if rank == 3:
                        lag.append(max(entered) - step)
                if engine.behind:
                    skipped.append(step)
                    results.append(engine.skip())
                    continue
                if rank == 3:
                    time.sleep(0.06)  # many times the others' step: it cannot keep up by computing
                else:
                    time.sleep(0.004)
                g = integer_grad(rank, step)
                sent.append(g.clone())
                results.append(engine.arrive(g))
            results.append(engine.flush())
        finally:
            engine.close()
        skipped_steps[rank] = skipped
        return sent, results

    per_rank = run_threads(P, fn)
    assert_identical([results for _, results in per_rank])
    results = per_rank[0][1]
    assert torch.equal(sum(r.tensors[0] for r in results), sum(g for sent, _ in per_rank for g in sent))
    assert sum(r.stats.contributions for r in results) == sum(len(sent) for sent, _ in per_rank)
    assert len(skipped_steps[3]) >= steps // 3, skipped_steps  # the slow rank skipped, and so kept up
    # Within what the others run during one of its steps; computing every step, it would end most of the fit behind.
    assert max(lag) < steps // 2, lag
    for rank, (_, rank_results) in enumerate(per_rank):
        assert [r.round_index for r in rank_results if r.stats.skipped] == skipped_steps[rank]
        for q in skipped_steps[rank]:
            assert rank not in rank_results[q].stats.fresh


def test_skip_is_refused_where_a_round_waits_for_every_gradient():
    def fn(rank, store):
        engine = PartialAllreduce(config(mode="sync"), store=store, rank=rank, world_size=P,
                                  like=torch.zeros(5, dtype=torch.float64))
        engine.start()
        try:
            with pytest.raises(ValueError, match=r"skip\(\) at step 0, whose round is synchronous"):
                engine.skip()
            engine.arrive(torch.ones(5, dtype=torch.float64))
            engine.flush()
        finally:
            engine.close()

    run_threads(P, fn)
