"""DelayedAllreduce (ABS-SGD's engine) across real gloo ranks (threads, TCPStore port=0), on exact arithmetic."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from lightning_partial.collectives import DelayedAllreduce, DelayedConfig, EngineClosedError
from lightning_partial.data import ElasticBatchSampler
from tests.distributed import run_threads

pytestmark = pytest.mark.timeout(120)

P = 4


def grad_of(rank: int, k: int) -> torch.Tensor:
    """Micro-batch ``k`` of ``rank``: small integers, so every sum below is exact in float64."""
    return torch.tensor([float(rank + 1), float(k % 7), float((rank * 3 + k) % 5)], dtype=torch.float64)


def samples_of(rank: int, k: int) -> int:
    return 1 + (rank + k) % 3


def record(results: list) -> list[tuple]:
    """What a test keeps of handed results: round, tensor, per-rank samples."""
    return [(r.round_index, r.tensors[0].clone(), r.stats.counts) for r in results]


def quiesce(engine: DelayedAllreduce, rank: int, barrier: threading.Barrier, agree: dict) -> int:
    """The strategy's quiesce: pause, agree on the last round (its barrier and MAX allreduce), drain it; returns it."""
    engine.pause()
    barrier.wait(timeout=30)
    agree[rank] = engine.known_round()
    barrier.wait(timeout=30)
    last = max(agree.values())
    engine.drain(last)
    return last


def end_of_fit(engine: DelayedAllreduce, rank: int, barrier: threading.Barrier, agree: dict) -> tuple[int, list]:
    """The strategy's end of fit: :func:`quiesce`, then finish; returns the last round and the finish's results."""
    last = quiesce(engine, rank, barrier, agree)
    return last, record(engine.finish(last))


def train(config: DelayedConfig, *, delays_ms: tuple[float, ...], agree: dict, keep_stats: bool = False,
          hold: tuple[int, ...] = (1,) * P, fill: tuple[tuple[int, ...], int] | None = None,
          go_on: bool = False) -> callable:
    """Each rank deposits micro-batches until the final round, then agrees on the last round and finishes;
    ``keep_stats``: each handed result's record carries its ``stats.busy`` and ``stats.wait_time`` too; ``hold``:
    rank ``i`` arrives with every ``hold[i]``-th micro-batch (``arrive=False`` for the others); ``fill=(sizes,
    R)``: rank ``i``'s micro-batches hold ``sizes[i]`` samples, each counted into its round in the store
    (``count_round_samples``; the counts kept as ``counted``), and a rank arrives by abs_sgd's rule
    (``closes_round``) instead of ``hold``; ``go_on``: an arriving deposit does not wait for its round
    (``wait=False``)."""
    from lightning_partial.strategies.abs_sgd import closes_round

    barrier = threading.Barrier(P)

    def fn(rank: int, store: dist.Store) -> dict:
        engine = DelayedAllreduce(config, store=store, rank=rank, world_size=P,
                                  like=[torch.zeros(3, dtype=torch.float64)]).start()
        deposits, handed_at, durations, counted = [], [], [], []
        try:
            k = 0
            while engine.final_round is None:
                time.sleep(delays_ms[rank] / 1000)
                g, b = grad_of(rank, k), samples_of(rank, k)
                arrive = (k + 1) % hold[rank] == 0
                if fill is not None:
                    sizes, target = fill
                    b = sizes[rank]
                    count = engine.count_round_samples(b)
                    counted.append(count)
                    arrive = count is None or closes_round(count, b, sum(sizes) - b, target)
                called = time.perf_counter()
                results = engine.deposit([g], samples=b, arrive=arrive, wait=not go_on)
                durations.append(time.perf_counter() - called)
                into = engine.deposit_round  # the round that takes this micro-batch
                deposits.append((g, b, into, engine.started_round))
                handed_at.append([(r.round_index, r.tensors[0].clone(), r.stats.counts)
                                  + ((r.stats.busy, r.stats.wait_time) if keep_stats else ()) for r in results])
                k += 1
                if k > 2000:
                    raise AssertionError("the final round never came")
            last, final = end_of_fit(engine, rank, barrier, agree)
            return {"deposits": deposits, "handed_at": handed_at, "durations": durations, "final": final, "last": last,
                    "counted": counted, "keys": engine_keys(store, config.name, range(engine.step + 1)),
                    "final_round": engine.final_round, "fresh_from": engine.fresh_from, "state": engine.state_dict()}
        finally:
            engine.close()

    return fn


def engine_keys(store: dist.Store, name: str, rounds) -> list[str]:
    """The rounds among ``rounds`` whose sample count (``s/<q>``) is still in the store."""
    return [q for q in rounds if store.check([f"lightning_partial/{name}/ctl/s/{q}"])]


@pytest.fixture(scope="module")
def skewed() -> list[dict]:
    """Rank 0 fast, rank 3 eight times slower; a round per 4 samples of the fastest rank; 30 rounds."""
    config = DelayedConfig(target_samples=4, max_rounds=30, timeout=timedelta(seconds=30), name="t")
    return run_threads(P, train(config, delays_ms=(2.0, 4.0, 8.0, 16.0), agree={}))


def rounds_of(record: dict) -> list[tuple[int, torch.Tensor, tuple[int, ...]]]:
    return [item[:3] for batch in record["handed_at"] for item in batch] + record["final"]


def test_every_rank_applies_the_same_results_in_order(skewed):
    reference = rounds_of(skewed[0])
    assert [r for r, _, _ in reference] == list(range(len(reference)))
    assert skewed[0]["final_round"] == 29 and skewed[0]["last"] == 29 and len(reference) == 31  # + the final round
    for record in skewed[1:]:
        mine = rounds_of(record)
        assert [r for r, _, _ in mine] == [r for r, _, _ in reference]
        for (_, a, ca), (_, b, cb) in zip(mine, reference):
            assert torch.equal(a, b) and ca == cb  # bit-identical


def test_update_is_the_sample_weighted_mean_and_nothing_is_lost(skewed):
    results = check_sums_and_conservation(skewed)  # sum of gradients / sum of samples; conservation
    for rank, record in enumerate(skewed):
        per_round = {}
        for _, b, into, _ in record["deposits"]:
            per_round[into] = per_round.get(into, 0) + b
        for r, (_, counts) in results.items():  # each round carried exactly the samples deposited for it
            assert counts[rank] == per_round.get(r, 0), (rank, r)
    assert all(sum(counts) > 0 for _, counts in results.values())


def test_delay_is_exactly_one_round(skewed):
    requested_here = 0
    for rank, record in enumerate(skewed):
        handed = -1
        for (_, _, into, started), batch in zip(record["deposits"], record["handed_at"]):
            if batch:
                handed = batch[-1][0]
            # Round r is applied once round r + 1 has started on this rank, not before and not later:
            # round `into - 1` had started before this micro-batch came (not later), and only rounds
            # before the last one started here are handed (not before). Round `into` itself may be
            # handed at this boundary: when its round completed and another rank started the next
            # one while this micro-batch was being deposited (seen under heavy load).
            assert max(into - 2, -1) <= handed <= max(started - 1, -1), (into, handed, started)
            if rank == 0 and handed == into - 1:
                requested_here += 1
    # The fastest rank requests the rounds: the micro-batch that completes round q waits for q to
    # start and applies q - 1 at once, so the next micro-batches lack only round q's update.
    assert requested_here >= 10, requested_here


def test_fast_ranks_contribute_more_samples(skewed):
    totals = [sum(sum(c[rank] for _, _, c in [x]) for x in rounds_of(skewed[0])) for rank in range(P)]
    assert totals[0] > totals[1] > totals[3], totals
    assert all(t > 0 for t in totals)


def test_state_after_finish_holds_nothing(skewed):
    for record in skewed:
        state = record["state"]
        assert state["pending"] == [] and state["unapplied"] == []
        assert state["global_samples"] == sum(sum(c) for _, _, c in rounds_of(skewed[0]))


def test_reference_samples_divides_every_round_by_the_reference():
    """The linear scaling rule: every round, the final one too, returns sum of gradients / B, B = 8."""
    config = DelayedConfig(target_samples=4, reference_samples=8, max_rounds=12, timeout=timedelta(seconds=30),
                           name="ref")
    records = run_threads(P, train(config, delays_ms=(2.0, 4.0, 8.0, 16.0), agree={}))
    results = {r: (t, counts) for r, t, counts in rounds_of(records[0])}
    assert len(results) == 13  # 12 rounds and the final one
    expected_sum = {r: torch.zeros(3, dtype=torch.float64) for r in results}
    for record in records:
        for g, b, into, _ in record["deposits"]:
            expected_sum[into] += g * b
        assert [(r, c) for r, _, c in rounds_of(record)] == [(r, c) for r, (_, c) in results.items()]
    for r, (tensor, _) in results.items():
        assert torch.equal(tensor, expected_sum[r] / 8), r  # not / the round's samples
    deposited = sum(g * b for record in records for g, b, _, _ in record["deposits"])
    assert torch.equal(sum(t for t, _ in results.values()) * 8, deposited)  # nothing lost
    assert len({sum(c) for _, c in results.values()}) > 1  # rounds of different sizes: the rule mattered


def test_epochs_end_at_the_same_round_and_time_trigger():
    config = DelayedConfig(trigger="time", interval=0.01, epoch_samples=60, max_epochs=2,
                           timeout=timedelta(seconds=30), name="e")
    records = run_threads(P, train(config, delays_ms=(1.0, 2.0, 3.0, 4.0), agree={}))
    finals = {rec["final_round"] for rec in records}
    assert len(finals) == 1
    rounds = rounds_of(records[0])
    cumulative = 0
    for r, _, counts in rounds[:-1]:
        cumulative += sum(counts)
        assert (cumulative >= 120) == (r >= records[0]["final_round"]), (r, cumulative)


def check_sums_and_conservation(records: list[dict]) -> dict:
    """Every rank got the same results in order; each is its deposits' sample-weighted mean; nothing is lost."""
    results = {r: (t, counts) for r, t, counts in rounds_of(records[0])}
    assert list(results) == list(range(len(results)))
    expected_sum = {r: torch.zeros(3, dtype=torch.float64) for r in results}
    for record in records:
        mine = rounds_of(record)
        assert [(r, c) for r, _, c in mine] == [(r, c) for r, (_, c) in results.items()]
        assert all(torch.equal(t, results[r][0]) for r, t, _ in mine)  # bit-identical
        for g, b, into, _ in record["deposits"]:
            expected_sum[into] += g * b
    for r, (tensor, counts) in results.items():
        assert torch.equal(tensor, expected_sum[r] / max(sum(counts), 1)), r  # the flush may find nothing
    deposited = sum(g * b for record in records for g, b, _, _ in record["deposits"])
    assert torch.allclose(sum(t * sum(c) for t, c in results.values()), deposited, rtol=0, atol=1e-9)
    return results


@pytest.mark.parametrize("by", ["samples", "round"])
def test_synchronous_finish_runs_lock_step_rounds_of_fresh_gradients(by):
    """From the first synchronous round S on, every rank's every micro-batch joins the next round and gets
    its result back at once: rounds after S hold exactly one micro-batch of every rank, each handed in the
    call that deposited it (fresh), and S is where the global samples crossed the threshold (or sync_from)."""
    finish = {"sync_from_samples": 150} if by == "samples" else {"sync_from": 22}
    config = DelayedConfig(target_samples=4, max_rounds=30, timeout=timedelta(seconds=30), name=f"fin{by}", **finish)
    records = run_threads(P, train(config, delays_ms=(2.0, 4.0, 8.0, 16.0), agree={}))
    results = check_sums_and_conservation(records)
    fresh_from = {record["fresh_from"] for record in records}
    assert len(fresh_from) == 1 and None not in fresh_from
    first_sync = fresh_from.pop() - 1
    if by == "samples":
        cumulative = [sum(sum(results[q][1]) for q in range(r + 1)) for r in results]
        assert cumulative[first_sync - 1] >= 150 > cumulative[first_sync - 2]
    else:
        assert first_sync == 22
    assert 0 < first_sync < 29 and records[0]["final_round"] == 29
    assert any(0 in results[r][1] for r in range(first_sync)), "no round before the finish went without rank 3"
    for rank, record in enumerate(records):
        for (_, b, into, _), batch in zip(record["deposits"], record["handed_at"]):
            if into > first_sync:
                assert results[into][1][rank] == b  # one micro-batch per rank and round
                assert batch and batch[-1][0] == into  # its result is handed in the same call: fresh
        for r in range(first_sync, 30):
            assert results[r][1][rank] > 0, (rank, r)  # every rank in every synchronous round


def test_synchronous_from_the_first_round_hands_every_result_at_once_and_measures_each_ranks_work():
    """``sync_from=0`` (abs_sgd's ``delay=0``): every round, the first included, holds exactly one micro-batch of
    every rank and hands its result back in the call that deposited it (``fresh_from`` 0); the update is the
    sample-weighted sum and nothing is lost. Each round's header carries each rank's ``busy`` seconds (from its
    previous deposit's return to this deposit): at least the rank's own sleep, whatever it waited for the others,
    and the same statistics on every rank."""
    config = DelayedConfig(target_samples=4, max_rounds=12, sync_from=0, timeout=timedelta(seconds=30), name="sync0")
    delays_ms = (2.0, 4.0, 8.0, 16.0)
    records = run_threads(P, train(config, delays_ms=delays_ms, agree={}, keep_stats=True))
    results = check_sums_and_conservation(records)
    assert {record["fresh_from"] for record in records} == {0}
    for rank, record in enumerate(records):
        assert [into for _, _, into, _ in record["deposits"]] == list(range(12))
        for (_, b, into, _), batch in zip(record["deposits"], record["handed_at"]):
            assert results[into][1][rank] == b  # one micro-batch per rank and round
            assert [x[0] for x in batch] == [into]  # handed in the same call: fresh
    busy = [[x[3] for x in batch] for batch in records[0]["handed_at"]]
    assert all(record["handed_at"][k][0][3] == busy[k][0] for record in records for k in range(12))
    assert busy[0][0] == (0.0, 0.0, 0.0, 0.0)  # nothing measured before the first deposit
    for k in range(1, 12):
        assert all(busy[k][0][rank] >= delays_ms[rank] / 1000 for rank in range(P)), (k, busy[k][0])
    # Each rank's own wait for the round (``partial/wait_ms``): inside the call that handed it, and the fast
    # rank, which waits for the slowest every round, waits longer in all than the slowest rank does.
    waits = [[batch[0][4] for batch in record["handed_at"]] for record in records]
    for record, rank_waits in zip(records, waits):
        assert all(0.0 <= w <= d for w, d in zip(rank_waits, record["durations"])), (rank_waits, record["durations"])
    assert sum(waits[0]) > sum(waits[P - 1]), waits


def test_rounds_that_close_on_samples_hold_the_step_to_within_half_a_micro_batch():
    """``sync_from=0``, micro-batches of 6, 6, 3 and 2 samples at different speeds, each counted into its round in
    the store (``count_round_samples``) and arriving by abs_sgd's rule (``closes_round``, ``R = 40``): every round
    holds exactly the samples counted for it (the last count any rank read), each rank's column the micro-batches
    it counted there, and 40 to within half the largest micro-batch (37-43) however the ranks interleaved; the
    update is the sample-weighted sum, nothing lost; rank 0 deleted every completed round's count (the store
    stays flat). Before the first synchronous round (asynchronous rounds) nothing is counted: ``None``."""
    sizes, target = (6, 6, 3, 2), 40
    config = DelayedConfig(target_samples=4, max_rounds=10, sync_from=0, timeout=timedelta(seconds=30), name="fill")
    records = run_threads(P, train(config, delays_ms=(1.0, 1.5, 2.0, 4.0), agree={}, fill=(sizes, target)))
    results = check_sums_and_conservation(records)
    assert sorted(results) == list(range(11))  # ten rounds and the end of fit's (which found nothing pending)
    last_count: dict[int, int] = {}
    for rank, record in enumerate(records):
        per_round: dict[int, int] = {}
        for (_, b, into, _), count in zip(record["deposits"], record["counted"]):
            assert count is not None and b == sizes[rank]
            per_round[into] = per_round.get(into, 0) + b
            last_count[into] = max(last_count.get(into, 0), count)
        for r in range(10):
            assert results[r][1][rank] == per_round[r], (rank, r)  # each micro-batch joined the round it counted in
    for r in range(10):
        held = sum(results[r][1])
        assert held == last_count[r] and 37 <= held <= 43, (r, held, results[r][1])
    assert records[0]["keys"] == [], records[0]["keys"]  # each deleted after its round or at finish
    engine = DelayedAllreduce(DelayedConfig(target_samples=4, name="async"), store=dist.HashStore(), rank=0,
                              world_size=1, like=[torch.zeros(2)]).start()
    try:
        assert engine.count_round_samples(3) is None  # an asynchronous round takes what the rank holds
    finally:
        engine.close()


def test_an_arrival_that_goes_on_is_handed_its_round_at_the_next_deposit_which_does_not_arrive():
    """As above (arrival by samples), each arriving deposit with ``wait=False``: it returns once its round ``q``
    was taken, without ``q``'s result; the rank's next micro-batch goes into ``q + 1``, and that deposit does not
    arrive (whatever it asked) and hands ``q``, alone: every round is handed once, in order, and every round
    before the one a rank arrives at was handed before it arrives. Every round goes on, on every rank, the
    final one included (it is not known final before it completes). Every round holds exactly the samples
    counted for it, each rank's column the micro-batches it counted there; the update is the sample-weighted
    sum, bit-identical everywhere, nothing lost; no count left in the store."""
    sizes, target, rounds = (6, 6, 3, 2), 40, 12
    config = DelayedConfig(target_samples=4, max_rounds=rounds, sync_from=0, timeout=timedelta(seconds=30),
                           name="goon")
    records = run_threads(P, train(config, delays_ms=(1.0, 1.5, 2.0, 4.0), agree={}, fill=(sizes, target), go_on=True))
    results = check_sums_and_conservation(records)
    assert sorted(results) == list(range(rounds + 1))  # and the end of fit's round
    last_count: dict[int, int] = {}
    for rank, record in enumerate(records):
        into = [d[2] for d in record["deposits"]]
        handed = [[x[0] for x in batch] for batch in record["handed_at"]]
        per_round: dict[int, int] = {}
        for (_, b, q, _), count in zip(record["deposits"], record["counted"]):
            per_round[q] = per_round.get(q, 0) + b
            if count is not None:  # None: counted after the final round (the end of fit's round takes it)
                last_count[q] = max(last_count.get(q, 0), count)
        went_on = []
        for q in range(rounds):
            assert results[q][1][rank] == per_round[q], (rank, q)  # each micro-batch joined the round it counted in
            k = max(i for i, r in enumerate(into) if r == q)  # the deposit that arrived at q
            if handed[k] and handed[k][-1] == q:
                continue  # waited: q handed at once
            went_on.append(q)
            assert q not in handed[k], (rank, q, handed[k])
            if k + 1 == len(into):  # the final round completed before the loop looked again: the finish hands it
                assert q == rounds - 1 and record["final"][0][0] == q, (rank, q, [x[0] for x in record["final"]])
                continue
            assert handed[k + 1] == [q] and into[k + 1] == q + 1, (rank, q, handed[k:k + 2])
            # The deposit that handed q did not arrive at q + 1 (after the final round the loop ends there).
            assert q == rounds - 1 or into[k + 2] == q + 1, (rank, q)
        assert went_on == list(range(rounds)), (rank, went_on)
    for q in range(rounds):
        assert sum(results[q][1]) == last_count[q], (q, results[q][1])
    assert records[0]["keys"] == [], records[0]["keys"]


def test_a_round_a_rank_went_on_from_counts_in_progress_once_handed():
    """One rank, epochs of 4 samples: a deposit of 4 that goes on (``wait=False``) completes round 0, which ends
    epoch 0, but ``progress()`` leaves it out (no epoch completed, no epoch-end round) until the next deposit
    hands it, whatever the time in between (read before and after the round completed); the same with the final
    round (``max_epochs=2``): ``progress()`` names it final only once it was handed."""
    config = DelayedConfig(target_samples=1, sync_from=0, epoch_samples=4, max_epochs=2,
                           timeout=timedelta(seconds=30), name="hidden")
    engine = DelayedAllreduce(config, store=dist.HashStore(), rank=0, world_size=1,
                              like=[torch.zeros(2, dtype=torch.float64)]).start()
    try:
        g = torch.ones(2, dtype=torch.float64)

        def until(done) -> None:  # the round completes on the communication thread
            deadline = time.monotonic() + 10
            while not done() and time.monotonic() < deadline:
                time.sleep(0.01)

        assert engine.deposit([g], samples=4, wait=False) == []  # round 0 taken, not handed
        assert engine.progress().epochs_completed == 0  # completed or not yet: hidden either way
        until(lambda: engine.global_samples >= 4)
        assert engine.global_samples == 4  # completed: it ended epoch 0 ...
        hidden = engine.progress()
        assert (hidden.epochs_completed, hidden.epoch_end_rounds, hidden.final_round) == (0, {}, None)  # ... hidden
        handed = engine.deposit([g], samples=4, wait=False)  # held: hands round 0, does not arrive at round 1
        assert [r.round_index for r in handed] == [0]
        shown = engine.progress()
        assert (shown.epochs_completed, shown.epoch_end_rounds) == (1, {0: 0})
        assert engine.deposit([g], samples=4, wait=False) == []  # arrives at round 1 (both micro-batches), goes on
        until(lambda: engine.final_round is not None)
        assert engine.final_round == 1 and engine.progress().final_round is None  # completed, final, hidden
        assert [r.round_index for r in engine.deposit([g], samples=4, wait=False)] == [1]  # handed, nothing arrives
        assert engine.progress().final_round == 1 and engine.progress().epochs_completed == 3
    finally:
        engine.close()


def test_a_synchronous_round_takes_every_micro_batch_a_rank_held_before_it_arrived():
    """``sync_from=0``, ranks 0 and 1 arriving with every third and second micro-batch (``arrive=False`` before):
    every round holds exactly each rank's micro-batches since its last arrival, a held deposit returns at once
    with no result, an arriving one with its own round's; the update is the sample-weighted sum of all of them
    (bit-identical on every rank, nothing lost), and the round's busy seconds for a rank add up the work of all
    its micro-batches (at least each one's sleep)."""
    hold, delays_ms = (3, 2, 1, 1), (2.0, 2.0, 6.0, 6.0)
    config = DelayedConfig(target_samples=4, max_rounds=8, sync_from=0, timeout=timedelta(seconds=30), name="held")
    records = run_threads(P, train(config, delays_ms=delays_ms, agree={}, keep_stats=True, hold=hold))
    results = check_sums_and_conservation(records)
    assert {record["fresh_from"] for record in records} == {0} and len(results) == 9  # and the finish's empty round
    for rank, record in enumerate(records):
        assert [into for _, _, into, _ in record["deposits"]] == [k // hold[rank] for k in range(8 * hold[rank])]
        for k, ((_, _, into, _), batch) in enumerate(zip(record["deposits"], record["handed_at"])):
            if (k + 1) % hold[rank]:
                assert batch == [], (rank, k)  # held: no round yet
            else:
                assert [x[0] for x in batch] == [into]  # arrived: its round's result, at once
                mine = record["deposits"][k + 1 - hold[rank]:k + 1]
                assert results[into][1][rank] == sum(n for _, n, _, _ in mine)  # every held micro-batch
    busy = [batch[0][3] for batch in records[3]["handed_at"]]  # rank 3 arrives with every micro-batch
    for r in range(1, 8):
        assert all(busy[r][rank] >= hold[rank] * delays_ms[rank] / 1000 for rank in range(P)), (r, busy[r])


def test_busy_seconds_leave_out_the_time_paused():
    """One rank, synchronous rounds: a micro-batch's busy seconds run from the previous deposit's return, or from
    ``resume()`` when the caller paused in between (a checkpoint's agreement and save are not its work): bounded
    by the time from just before ``resume()`` to the deposit's return, which leaves the pause out."""
    config = DelayedConfig(target_samples=1, max_rounds=4, sync_from=0, timeout=timedelta(seconds=30), name="busy")

    def fn(rank: int, store: dist.Store) -> list[float]:
        engine = DelayedAllreduce(config, store=store, rank=rank, world_size=1,
                                  like=[torch.zeros(3, dtype=torch.float64)]).start()
        busy, since_resume = [], 0.0
        try:
            for k in range(4):
                if k == 2:  # a save between two deposits
                    engine.pause()
                    time.sleep(0.2)
                    before_resume = time.monotonic()
                    engine.resume()
                time.sleep(0.02)
                busy += [r.stats.busy[0] for r in engine.deposit([grad_of(rank, k)], samples=1)]
                if k == 2:
                    since_resume = time.monotonic() - before_resume
            return busy, since_resume
        finally:
            engine.close()

    busy, since_resume = run_threads(1, fn)[0]
    assert len(busy) == 4 and busy[0] == 0.0  # nothing measured before the first deposit
    assert all(b >= 0.02 for b in busy[1:]), busy  # at least each micro-batch's own sleep
    assert busy[2] <= since_resume + 1e-6, (busy, since_resume)  # the pause is not counted (1e-6: microseconds)


def test_work_since_arrival_is_what_the_next_arrival_reports_as_busy():
    """One rank, synchronous rounds: ``work_since_arrival()`` before a deposit is the work the round's header will
    report for this rank (the held micro-batches' busy and the time since the last return), to within the
    time between the two reads; an arrival starts it afresh, and neither a pause nor what comes before
    ``restart_work_clock()`` (an epoch's end) is counted. Every bound is a bracket of clock readings taken
    around the calls (no threshold on how fast the host runs): each excludes the 0.1 s sleeps that must not
    count, which an engine counting them would exceed."""
    config = DelayedConfig(target_samples=1, max_rounds=3, sync_from=0, timeout=timedelta(seconds=30), name="work")

    def fn(rank: int, store: dist.Store) -> dict[str, float]:
        engine = DelayedAllreduce(config, store=store, rank=rank, world_size=1,
                                  like=[torch.zeros(3, dtype=torch.float64)]).start()
        try:
            assert engine.work_since_arrival() == 0.0  # nothing deposited yet
            first = time.monotonic()
            engine.deposit([grad_of(rank, 0)], samples=1)  # arrives: the work starts from its return
            for k in (1, 2):  # two held micro-batches, then the arrival with the third
                time.sleep(0.03)
                engine.deposit([grad_of(rank, k)], samples=1, arrive=False)
            held = time.monotonic() - first  # at least the held micro-batches' busy
            engine.pause()
            time.sleep(0.1)  # a save: not work
            resumed = time.monotonic()
            engine.resume()
            time.sleep(0.03)
            before = engine.work_since_arrival()
            began = time.monotonic()
            results = engine.deposit([grad_of(rank, 3)], samples=1)
            returned = time.monotonic()
            after = engine.work_since_arrival()
            after_bound = time.monotonic() - began
            time.sleep(0.1)  # an epoch's end: validation, hooks
            restart = time.monotonic()
            engine.restart_work_clock()
            restarted = engine.work_since_arrival()
            return {"before": before, "before_bound": held + began - resumed, "busy": results[-1].stats.busy[0],
                    "slack": returned - began, "after": after, "after_bound": after_bound,
                    "restarted": restarted, "restarted_bound": time.monotonic() - restart}
        finally:
            engine.close()

    r = run_threads(1, fn)[0]
    assert 0.09 <= r["before"] <= r["before_bound"], r  # three sleeps of 30 ms; the pause left out
    assert r["before"] <= r["busy"] <= r["before"] + r["slack"] + 1e-6, r
    assert 0.0 <= r["after"] <= r["after_bound"], r  # from the arrival's return
    assert 0.0 <= r["restarted"] <= r["restarted_bound"], r  # from the restart


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"target_samples": 4, "sync_from": -1}, "sync_from must be an integer >= 0"),
        ({"target_samples": 4, "sync_from_samples": 2.5}, "sync_from_samples must be an integer >= 0"),
        ({"trigger": "tide", "target_samples": 4}, "unknown trigger 'tide'"),
        ({"target_samples": 0}, "target_samples must be an integer >= 1"),
        ({"target_samples": None}, "target_samples must be an integer >= 1"),
        ({"trigger": "time", "interval": 0}, "needs interval > 0"),
        ({"target_samples": 4, "interval": 1.0}, "only meaningful with trigger='time'"),
        ({"trigger": "time", "interval": 1.0, "target_samples": 4}, "target_samples is only meaningful with "
                                                                     "trigger='samples'"),
        ({"target_samples": 4, "max_epochs": 2}, "max_epochs needs epoch_samples"),
        ({"target_samples": 4, "max_rounds": -1}, "max_rounds must be"),
        ({"target_samples": 4, "reference_samples": 0}, "reference_samples must be an integer >= 1"),
        ({"target_samples": 4, "setup_timeout": timedelta(0)}, "setup_timeout must be a positive"),
    ],
)
def test_bad_configuration_fails_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DelayedConfig(**kwargs)


def test_deposit_checks_the_samples():
    engine = DelayedAllreduce(DelayedConfig(target_samples=1), store=dist.HashStore(), rank=0, world_size=1,
                              like=[torch.zeros(2)])
    with pytest.raises(RuntimeError, match="deposit"):
        engine.deposit([torch.zeros(2)], samples=1)  # not started
    with pytest.raises(RuntimeError, match="finish"):
        engine.flush()


@pytest.mark.parametrize("kwargs, match", [
    ({"samples": 0}, "rank 0: samples must be an integer >= 1, got 0"),
    ({"samples": 2.0}, "rank 0: samples must be an integer >= 1, got 2.0"),
    ({"samples": 1, "epoch": -1}, "rank 0: epoch must be an integer >= 0 or None, got -1"),
    ({"samples": 1, "epoch": 0.5}, "rank 0: epoch must be an integer >= 0 or None, got 0.5"),
])
def test_a_started_engine_refuses_bad_samples_and_epochs_and_keeps_nothing(kwargs, match):
    """A bad deposit fails naming the rank and the argument, before anything enters the send buffer."""
    def fn(rank: int, store: dist.Store) -> None:
        config = DelayedConfig(target_samples=4, timeout=timedelta(seconds=10), name=f"bad{len(match)}")
        engine = DelayedAllreduce(config, store=store, rank=0, world_size=1, like=[torch.zeros(2)]).start()
        try:
            with pytest.raises(ValueError, match=match):
                engine.deposit([torch.ones(2)], **kwargs)
            assert engine.state_dict()["pending_samples"] == []
        finally:
            engine.close()

    run_threads(1, fn)


def test_draining_the_round_that_carried_a_stop_returns_and_every_rank_is_handed_it():
    """A stop ends the rounds with the round that carried it: the communication threads publish it and return, so
    it never completes as an ordinary round. drain() of it, or of any later round (none follows a stop), returns
    once it is published (not at the timeout), and the next deposit hands it, the same on both ranks."""
    barrier = threading.Barrier(2)
    agree: dict[int, int] = {}
    config = DelayedConfig(target_samples=1, timeout=timedelta(seconds=10), name="drainstop")

    def fn(rank: int, store: dist.Store) -> tuple:
        engine = DelayedAllreduce(config, store=store, rank=rank, world_size=2,
                                  like=[torch.zeros(3, dtype=torch.float64)]).start()
        try:
            handed = []
            if rank == 0:
                engine.request_stop()
                handed += engine.deposit([grad_of(0, 0)], samples=1)  # requests round 0, which carries the stop
            last = quiesce(engine, rank, barrier, agree)
            engine.drain(last + 1)
            handed += engine.deposit([grad_of(rank, 1)], samples=1)
            return last, [(r.round_index, r.tensors[0].clone(), r.stats.counts, r.stats.stop) for r in handed]
        finally:
            engine.close()

    (last0, handed0), (last1, handed1) = run_threads(2, fn, timeout=60)
    assert last0 == last1 == 0
    for handed in (handed0, handed1):
        assert [(r, counts, stop) for r, _, counts, stop in handed] == [(0, (1, 0), True)], handed
        assert torch.equal(handed[0][1], grad_of(0, 0))


def test_known_round_counts_a_round_that_ran_while_it_asked_the_store():
    """known_round() reads the last round its thread took, then asks the store whether the next one is activated.
    Rank 1's store answer is held back until rank 0 has activated round 0 and rank 1's thread has run it and
    deleted its key (as a descheduled caller's thread would see it): the round that ran still counts."""
    asked = threading.Barrier(2)
    agreed = threading.Barrier(2)
    config = DelayedConfig(target_samples=1, timeout=timedelta(seconds=10), name="knownrace")

    def fn(rank: int, store: dist.Store) -> tuple:
        engine = DelayedAllreduce(config, store=store, rank=rank, world_size=2,
                                  like=[torch.zeros(3, dtype=torch.float64)]).start()
        try:
            if rank == 0:
                asked.wait(timeout=30)  # rank 1 has read its last round taken (none) and asks the store
                engine.deposit([grad_of(0, 0)], samples=1)  # activates round 0 for both ranks
                engine.pause()
                known = engine.known_round()
            else:
                engine.pause()
                control = engine._control
                answer = control.is_activated

                def late_answer(r: int) -> bool:
                    asked.wait(timeout=30)
                    engine.drain(r)  # round r ran here, and its key is deleted (ControlPlane.collect)
                    return answer(r)

                control.is_activated = late_answer
                try:
                    known = engine.known_round()
                finally:
                    control.is_activated = answer
            started = engine.started_round
            agreed.wait(timeout=30)
            engine.drain(known)
            return known, started, record(engine.finish(known))
        finally:
            engine.close()

    (known0, started0, final0), (known1, started1, final1) = run_threads(2, fn, timeout=60)
    assert (known0, started0) == (known1, started1) == (0, 0)
    assert [r for r, _, _ in final0] == [r for r, _, _ in final1] == [0, 1]  # round 0, then the finish's
    assert all(torch.equal(a, b) for (_, a, _), (_, b, _) in zip(final0, final1))


def test_a_drain_ends_when_the_engine_is_closed():
    """close() from another thread ends a drain() that waits for a round, as it ends the other waits for a round's
    completion: with EngineClosedError naming rank and round, not at the timeout."""
    def fn(rank: int, store: dist.Store) -> None:
        config = DelayedConfig(target_samples=1, timeout=timedelta(seconds=10), name="drainclosed")
        engine = DelayedAllreduce(config, store=store, rank=0, world_size=1, like=[torch.zeros(2)]).start()
        closer = threading.Timer(0.2, engine.close)  # no round was requested: round 0 never runs
        closer.start()
        try:
            with pytest.raises(EngineClosedError, match=r"rank 0, round 0\] close\(\) was called while draining"):
                engine.drain(0)
        finally:
            closer.join()
            engine.close()

    run_threads(1, fn)


def test_elastic_sampler_never_ends_and_follows_the_batch_size():
    sampler = ElasticBatchSampler(10, batch_size=3, num_replicas=2, rank=1, seed=4)
    it = iter(sampler)
    first = [next(it) for _ in range(4)]  # 12 indices from a 5-sample shard: a second pass
    assert all(len(b) == 3 for b in first)
    flat = [i for b in first for i in b]
    assert set(flat[:5]) == set(flat[5:10]) and len(set(flat[:5])) == 5
    other = ElasticBatchSampler(10, batch_size=3, num_replicas=2, rank=0, seed=4)
    assert not set(flat[:5]) & set(i for b in [next(iter(other)), next(iter(other))] for i in b[:2])
    sampler.batch_size = 1
    assert len(next(it)) == 1
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
        ElasticBatchSampler(10, batch_size=0, num_replicas=2, rank=0)


@pytest.mark.parametrize("then", ["deposit", "arrive"])
def test_a_rank_arrives_at_the_first_synchronous_round_only_after_every_earlier_round_but_the_last_is_handed(then):
    """The switch to the synchronous finish (``sync_from=S``, two ranks): rank 0 is handed round ``S - 2`` when
    its micro-batch starts round ``S - 1``, and at its next micro-batch boundary runs something collective of the
    callers' (abs_sgd: a step checkpoint's save), which rank 1 joins once it too was handed round ``S - 2``. Rank
    1's one slow micro-batch spans rounds up to ``S - 1``: its next deposit lands in round ``S``, synchronous,
    with rounds before ``S - 1`` not yet handed. It must not arrive and wait for round ``S`` (rank 0 arrives there
    only after the collective: a deadlock): it holds the micro-batch and is handed the rounds up to ``S - 2`` at
    once; its next deposit arrives with both micro-batches, and gets rounds ``S - 1`` and ``S`` (or, ``arrive``,
    it arrives with the held one alone: abs_sgd at an epoch's last batch). Nothing is lost, every rank gets the
    same results."""
    s, world = 6, 2
    config = DelayedConfig(target_samples=2, max_rounds=s + 3, sync_from=s, timeout=timedelta(seconds=20),
                           name=f"switch{then}")
    collective, agree = threading.Barrier(world), {}  # the callers' collective, bounded

    def fn(rank: int, store: dist.Store) -> dict:
        engine = DelayedAllreduce(config, store=store, rank=rank, world_size=world,
                                  like=[torch.zeros(3, dtype=torch.float64)]).start()
        deposits, handed_at, joined, holding = [], [], False, []
        try:
            k = 0
            while engine.final_round is None:
                if handed_at and not joined and any(r[0] >= s - 2 for batch in handed_at for r in batch):
                    collective.wait(timeout=10)  # at the batch start after round S - 2 was handed
                    joined = True
                    holding.append(engine.holding)
                    time.sleep(0.2)  # the save's work: a held micro-batch must not be taken meanwhile
                    if then == "arrive" and engine.holding:
                        arrived = engine.arrive()
                        handed_at.append(record(arrived))
                        deposits.append((torch.zeros(3, dtype=torch.float64), 0, s, engine.started_round))
                        assert not engine.holding and engine.arrive() == []
                if rank == 1 and k == 1:
                    # The slow micro-batch: done once this rank's thread has taken round S - 1.
                    deadline = time.monotonic() + 10
                    while engine.started_round < s - 1:
                        assert time.monotonic() < deadline, "round S - 1 never started"
                        time.sleep(0.002)
                else:
                    time.sleep(0.002)
                g, b = grad_of(rank, k), 1
                results = engine.deposit([g], samples=b)
                deposits.append((g, b, engine.deposit_round, engine.started_round))
                handed_at.append(record(results))
                k += 1
                assert k < 2000, "the final round never came"
            _, final = end_of_fit(engine, rank, collective, agree)
            return {"deposits": deposits, "handed_at": handed_at, "final": final, "joined": joined,
                    "holding": holding}
        finally:
            engine.close()

    records = run_threads(world, fn, timeout=60)
    results = check_sums_and_conservation(records)
    assert [record["holding"] for record in records] == [[False], [True]]
    slow = records[1]
    assert [into for _, _, into, _ in slow["deposits"][1:3]] == [s, s]  # held, then arrived: the same round
    assert [x[0] for x in slow["handed_at"][1]][-1] == s - 2  # held: handed up to S - 2
    assert [x[0] for x in slow["handed_at"][2]] == [s - 1, s]  # arrived: S - 1 and S at once
    assert results[s][1][1] == (2 if then == "deposit" else 1)  # both micro-batches, or the held one, in round S


@pytest.mark.parametrize("finish", ["samples", "round"])
def test_a_batch_that_began_before_its_epochs_last_round_completed_does_not_arrive_after_it(finish):
    """The epoch ends at the last asynchronous round ``E``, two ranks run abs_sgd's loop: a batch that starts after
    ``E`` completed ends the epoch, arrives, and is followed by a collective epoch-end hook. Rank 1's batch starts
    while ``E`` is in flight (not its last) and deposits into the first synchronous round ``E + 1`` (``samples``:
    after ``E`` completed, which made the finish known; ``round``: ``sync_from`` given, at once): with ``epoch=0``
    it is held once ``E`` completed (arriving would let round ``E + 1`` complete without it in its last batch; that
    last batch would then arrive at ``E + 2`` and wait there for rank 0, which waits in the hook for it). No batch
    that does not end epoch 0 arrives after ``E``; both ranks' last batches arrive at ``E + 1``; nothing is lost.
    ``round``: only rank 1 contributes before the finish (2 samples a round), so ``E`` is round 5 and ``sync_from``
    6; rank 0's first batch spans them."""
    world = 2
    finishes = {"samples": {"sync_from_samples": 12}, "round": {"sync_from": 6}}
    config = DelayedConfig(target_samples=2, epoch_samples=12, max_epochs=2, timeout=timedelta(seconds=20),
                           name=f"epochend{finish}", **finishes[finish])
    hook, agree = threading.Barrier(world), {}

    def fn(rank: int, store: dist.Store) -> dict:
        engine = DelayedAllreduce(config, store=store, rank=rank, world_size=world,
                                  like=[torch.zeros(3, dtype=torch.float64)]).start()
        deposits, handed_at, batches, last_rounds = [], [], [], []
        try:
            k, epoch = 0, 0
            while engine.final_round is None:
                last = engine.progress().epochs_completed > epoch  # the batch start
                if finish == "round" and rank == 0 and k == 0:
                    engine.drain(5)  # a first batch spanning every asynchronous round
                elif finish == "samples" and rank == 1 and not last and engine.progress().sync_from is None:
                    engine.drain(engine.started_round)  # a batch spanning the round in flight
                elif rank == 0 or finish == "samples":
                    time.sleep(0.005 if rank == 0 else 0.001)
                g, b = grad_of(rank, k), 2 if rank == 1 else 1
                results = engine.deposit([g], samples=b, epoch=None if last else epoch)
                arrived = any(r.round_index == engine.deposit_round for r in results)  # its own round, at once
                batches.append((epoch, last, engine.deposit_round, arrived))
                if last and engine.holding:
                    results += engine.arrive()  # abs_sgd: at the batch's end, before the hooks
                deposits.append((g, b, engine.deposit_round, engine.started_round))
                handed_at.append(record(results))
                k += 1
                if last:
                    last_rounds.append(max((r.round_index for r in results), default=None))
                    hook.wait(timeout=10)  # the epoch-end hooks: collective
                    epoch += 1
                assert k < 2000, "the final round never came"
            _, final = end_of_fit(engine, rank, hook, agree)
            return {"deposits": deposits, "handed_at": handed_at, "final": final, "batches": batches,
                    "last_rounds": last_rounds, "fresh_from": engine.fresh_from}
        finally:
            engine.close()

    records = run_threads(world, fn, timeout=60)
    results = check_sums_and_conservation(records)
    s = records[0]["fresh_from"] - 1  # the first synchronous round: E + 1
    if finish == "round":
        assert s == 6 and [sum(results[r][1]) for r in range(6)] == [2] * 6  # E = 5: 12 samples
    for record_ in records:
        spanning = [b for b in record_["batches"] if b[0] == 0 and not b[1] and b[2] >= s]
        assert not any(arrived for *_, arrived in spanning), record_["batches"]  # never arrived after E
    assert [r["last_rounds"][0] for r in records] == [s, s]  # every rank's last batch of epoch 0 arrived at E + 1
    assert any(b[0] == 0 and not b[1] and b[2] == s for b in records[1]["batches"]), "rank 1 never spanned E"


def test_an_epoch_that_ends_two_rounds_before_the_finish_ends_without_an_arrival_at_its_first_round():
    """The strategy's third rule (``ABSSGDStrategy._epoch_end_arrival``) on the engine: the epoch's last round ``E``
    is ``S - 2``. Rank 0's last micro-batch lands in round ``E + 1`` (asynchronous: rank 0 goes on to the epoch-end
    hooks). Rank 1's batch that began before ``E`` completed requests ``E + 1`` (and is handed ``E``: the engine's
    own rule for a rank behind does not hold its next deposit); its last lands in ``S`` once ``E + 1`` completed.
    Arriving there, rank 1 would wait in ``S`` for rank 0, which waits in the hooks for rank 1; so the rule has no
    rank arrive with its epoch's last batch, and each arrives with its next epoch's first. Both ranks' loops end,
    every result identical, nothing lost. Rank 1 alone fills epoch 0 (rounds 0-5, 2 samples each: ``E = 5``);
    ``sync_from = 7``."""
    from lightning_partial.strategies.abs_sgd import ABSSGDStrategy

    world, e, s = 2, 5, 7
    config = DelayedConfig(target_samples=2, epoch_samples=12, max_epochs=2, sync_from=s,
                           timeout=timedelta(seconds=20), name="epochend3")
    hook, agree, rank0_last_in = threading.Barrier(world), {}, threading.Event()

    def fn(rank: int, store: dist.Store) -> dict:
        engine = DelayedAllreduce(config, store=store, rank=rank, world_size=world,
                                  like=[torch.zeros(3, dtype=torch.float64)]).start()
        deposits, handed_at, lasts = [], [], []
        try:
            k, epoch = 0, 0
            while engine.final_round is None:
                if (rank, k) in ((0, 0), (1, e + 2)):
                    engine.drain(e)  # rank 0 idles through epoch 0; rank 1's last batch of it begins after E
                if rank == 1 and k == e + 1:
                    # A batch that began before E completed (the strategy read the progress just before): not the
                    # epoch's last. It requests E + 1 once rank 0's last micro-batch is in it.
                    last = False
                    assert rank0_last_in.wait(timeout=10)
                else:
                    last = engine.progress().epochs_completed > epoch  # the batch start
                if rank == 1 and last and epoch == 0:
                    engine.drain(e + 1)  # rank 1's last batch spans round E + 1
                elif k > 0:
                    time.sleep(0.002)
                # One sample a micro-batch on rank 0 (the first requests no round), two on rank 1 (each requests).
                g, b = grad_of(rank, k), 1 if rank == 0 else 2
                arrive = True
                if last:
                    progress = engine.progress()
                    arrive = ABSSGDStrategy._epoch_end_arrival("epoch", progress, progress.epoch_end_rounds[epoch])
                results = engine.deposit([g], samples=b, arrive=arrive, epoch=None if last else epoch)
                deposits.append((g, b, engine.deposit_round, engine.started_round))
                handed_at.append(record(results))
                k += 1
                if last:
                    lasts.append((epoch, engine.deposit_round, arrive, engine.holding))
                    if rank == 0 and epoch == 0:
                        rank0_last_in.set()
                    hook.wait(timeout=10)  # the epoch-end hooks: collective
                    epoch += 1
                assert k < 2000, "the final round never came"
            _, final = end_of_fit(engine, rank, hook, agree)
            return {"deposits": deposits, "handed_at": handed_at, "final": final, "lasts": lasts,
                    "fresh_from": engine.fresh_from}
        finally:
            engine.close()

    records = run_threads(world, fn, timeout=60)
    results = check_sums_and_conservation(records)
    assert records[0]["fresh_from"] == s + 1
    assert [sum(results[r][1]) for r in range(e + 1)] == [2] * (e + 1)  # E = 5: 12 samples, rank 1's
    assert results[e + 1][1] == (1, 2)  # E + 1: rank 0's last micro-batch and rank 1's batch that spanned E
    assert [x[0] for x in records[1]["handed_at"][e + 1]][-1] == e  # so rank 1 was handed E: not behind at S
    # The alignment the rule is for: rank 0's last micro-batch of epoch 0 in E + 1, rank 1's in S, neither arrived.
    assert records[0]["lasts"][0][:3] == (0, e + 1, False), records[0]["lasts"]
    assert records[1]["lasts"][0] == (0, s, False, True), records[1]["lasts"]  # held, not waiting in S


def one_rank_fit(config: DelayedConfig, rounds: int) -> tuple[DelayedAllreduce, dict]:
    """A one-rank engine that ran ``rounds`` rounds of one sample each, then paused and drained (as a checkpoint
    is taken): the engine (closed) and its state."""
    store = dist.HashStore()
    engine = DelayedAllreduce(config, store=store, rank=0, world_size=1, like=[torch.zeros(2)]).start()
    try:
        for _ in range(rounds):
            engine.deposit([torch.ones(2)], samples=1)
        engine.pause()
        engine.drain(engine.known_round())
        return engine, engine.state_dict()
    finally:
        engine.close()


def restored(config: DelayedConfig, state: dict) -> DelayedAllreduce:
    """A new engine (not started) with ``state`` loaded, as a resumed fit's."""
    engine = DelayedAllreduce(config, store=dist.HashStore(), rank=0, world_size=1, like=[torch.zeros(2)])
    engine.load_state_dict(state)
    return engine


@pytest.mark.parametrize("thresholds", [{"sync_from_samples": 4}, {"sync_from_samples": 4, "sync_from": 100}])
def test_a_resumed_engine_keeps_where_the_finish_began_and_where_the_epochs_ended(thresholds):
    """A checkpoint taken in the synchronous finish resumes with the round where it began (so the first resumed
    round is fresh, as it was in the fit that saved it) and with the rounds that ended each epoch (abs_sgd decides
    its epoch-end arrivals from them). With both thresholds the finish begins at whichever comes first, in the
    running engine as in the resumed one. At least one sample a round: the finish begins by round 4."""
    config = DelayedConfig(target_samples=1, epoch_samples=3, timeout=timedelta(seconds=20), name="resume",
                           **thresholds)
    engine, state = one_rank_fit(config, 10)
    progress = engine.progress()
    assert progress.sync_from is not None and progress.sync_from <= 4 and engine.fresh_from == progress.sync_from + 1
    assert sorted(progress.epoch_end_rounds) == [0, 1, 2]
    assert state["step"] > engine.fresh_from  # saved inside the finish
    resumed = restored(config, state)
    assert resumed.progress() == progress
    assert resumed.fresh_from == engine.fresh_from and resumed.is_fresh(state["step"])
    # A checkpoint from before these were saved: the resumed round is the finish's first (not fresh), no epochs.
    old = {k: v for k, v in state.items() if k not in ("sync_from", "epoch_end_rounds")}
    assert restored(config, old).fresh_from == state["step"] + 1
    assert restored(config, old).progress().epoch_end_rounds == {}


def test_a_rank_resumed_with_unapplied_results_arrives_at_the_first_synchronous_round_only_after_they_are_handed():
    """The switch's first rule after a resume: a checkpoint saved after round 2 with rank 0's result of round 3
    unapplied (every rank resumes with it, its weights are rank 0's); the finish begins at round 5. Rank 0's first
    micro-batch lands in round 4 (asynchronous) and is handed round 3; it then waits in a callers' collective (a
    step save that round 3 queued) for rank 1. Rank 1's first micro-batch, slow, lands in round 5: it has been
    handed nothing since the checkpoint, so it holds (as a rank not handed round 3 would in the fit that saved it),
    is handed round 3, joins the collective, and arrives with its next micro-batch. Before, its restored result did
    not count as unhanded: it arrived, and waited in round 5 for rank 0, which waited for it."""
    world = 2
    config = DelayedConfig(target_samples=1, sync_from=5, timeout=timedelta(seconds=10), name="resumebehind")
    save = threading.Barrier(world)

    def fn(rank: int, store: dist.Store) -> dict:
        engine = DelayedAllreduce(config, store=store, rank=rank, world_size=world, like=[torch.zeros(2)])
        state = engine.state_dict()
        flats = [f.detach().clone() for f in engine.layout.data(engine.layout.flatten([torch.full((2,), 3.0)]))]
        state.update(step=4, global_samples=8, unapplied=[{"round": 3, "flats": flats, "counts": [1, 1],
                                                            "divisor": 2.0}])
        engine.load_state_dict(state)
        engine.start()
        handed, holding = [], []
        try:
            if rank == 1:
                engine.drain(4)  # a slow first micro-batch: round 4 completes with rank 0's alone
            handed.append(record(engine.deposit([torch.full((2,), float(rank + 1))], samples=1)))
            holding.append(engine.holding)
            save.wait(timeout=5)  # the step save round 3 queued: collective
            handed.append(record(engine.deposit([torch.full((2,), float(rank + 1))], samples=1)))
            return {"handed": [[r for r, _, _ in h] for h in handed], "holding": holding,
                    "tensors": {r: t for h in handed for r, t, _ in h}}
        finally:
            engine.close()

    records = run_threads(world, fn, timeout=60)
    assert records[0]["handed"] == [[3], [4, 5]] and records[0]["holding"] == [False]
    assert records[1]["handed"] == [[3], [4, 5]] and records[1]["holding"] == [True]
    tensors = [r["tensors"] for r in records]
    assert all(torch.equal(tensors[0][r], tensors[1][r]) for r in (3, 4, 5))  # bit-identical on both ranks
    assert torch.equal(tensors[0][3], torch.full((2,), 3.0))  # the restored result, handed once
    assert torch.equal(tensors[0][4], torch.full((2,), 1.0))  # rank 0's first micro-batch alone
    assert torch.equal(tensors[0][5], torch.full((2,), 5.0 / 3.0))  # rank 0's second, rank 1's two: (1 + 2 + 2) / 3


def test_a_synchronous_engine_resumed_from_a_delayed_fit_decides_its_first_fresh_round_from_the_shared_state():
    """``sync_from=0`` (abs_sgd's ``delay=0``) resumed from a checkpoint: from a delayed fit (no finish begun) its
    first round holds gradients computed before the restored results are applied (fresh from the next); from a
    synchronous fit every round is fresh. Decided from the state every rank shares (where the saved fit's finish
    began), not from this rank's own send buffer, which a new world size may leave empty on some ranks."""
    delayed = DelayedConfig(target_samples=1, timeout=timedelta(seconds=20), name="wasdelayed")
    synchronous = DelayedConfig(target_samples=1, sync_from=0, timeout=timedelta(seconds=20), name="wassync")
    _, state = one_rank_fit(delayed, 6)
    empty = {**state, "pending": [], "pending_steps": [], "pending_samples": [], "pending_first": [],
             "unapplied": []}  # what a rank dealt nothing holds
    for loaded in (state, empty):
        assert restored(synchronous, loaded).fresh_from == state["step"] + 1
    _, state = one_rank_fit(synchronous, 6)
    assert state["sync_from"] == 0 and restored(synchronous, state).fresh_from == 0


def test_a_checkpoint_saved_after_the_final_round_resumes_with_nothing_but_the_finish_and_its_clock_decisions():
    """Saved after the final round (``max_rounds=6``: round 5), a resumed engine with the same limits knows round 5
    as final: a micro-batch deposited then starts no round 6 and joins the finish's round, as in the fit that saved
    it; with a later limit the fit goes on. An unapplied result keeps what the strategy acts on as it is applied
    (rank 0's clock decisions, the round's busy times, whether it was synchronous)."""
    config = DelayedConfig(target_samples=1, max_rounds=6, timeout=timedelta(seconds=20), name="afterfinal")
    store = dist.HashStore()
    engine = DelayedAllreduce(config, store=store, rank=0, world_size=1, like=[torch.zeros(2)]).start()
    try:
        while engine.final_round is None:
            if engine.deposit_round == 4:
                engine.announce(0b101)  # rides in the next round's header: round 5, unapplied at the save
            engine.deposit([torch.ones(2)], samples=1)
        engine.pause()
        engine.drain(engine.known_round())
        state = engine.state_dict()
    finally:
        engine.close()
    assert engine.final_round == 5 and state["step"] == 6
    assert restored(DelayedConfig(target_samples=1, max_rounds=10, timeout=timedelta(seconds=20),
                                  name="later"), state).final_round is None
    resumed = restored(config, state)
    assert resumed.final_round == 5
    resumed.start()
    try:
        handed = resumed.deposit([torch.full((2,), 2.0)], samples=1)
        assert [r.round_index for r in handed] == [5] and resumed.deposit_round == 6  # round 6 is not started
        resumed.pause()
        assert resumed.known_round() == 5
        resumed.drain(5)
        results = resumed.finish(5)
    finally:
        resumed.close()
    held = sum(state["pending_samples"])  # deposited after round 5 was taken, before it completed: saved
    assert [r.round_index for r in results][-1] == 6 and results[-1].stats.counts == (held + 1,)
    assert torch.equal(results[-1].tensors[0], torch.full((2,), (held + 2.0) / (held + 1)))
    # The unapplied result a save keeps carries the announcement and the round's facts, as it came.
    assert [x["round"] for x in state["unapplied"]] == [5] and state["unapplied"][0]["announced"] == 0b101
    assert handed[0].stats.announced == 0b101 and handed[0].stats.synchronous is False
    assert len(handed[0].stats.busy) == 1


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_checkpoint_resumed_on_another_world_size_keeps_the_rounds_decisions_on_every_rank(world_size):
    """abs_sgd's per-rank engine states from a 2-rank delayed fit (old rank 0 holding a micro-batch, old rank 1
    nothing), resumed on 2 and on 4 ranks into a synchronous engine (``delay=0``): every rank gets where the epochs
    ended and where the finish began, and so decides the same first fresh round, whatever send buffer it was dealt
    (on 4 ranks, ranks 1-3 got none; they decided from their own buffer and disagreed with rank 0)."""
    from types import SimpleNamespace

    from lightning_partial.strategies.abs_sgd import ABSSGDStrategy

    _, state = one_rank_fit(DelayedConfig(target_samples=1, epoch_samples=3, timeout=timedelta(seconds=20),
                                          name="wasdelayed2"), 6)
    old0 = {**state, "unapplied": [], "pending": [[torch.ones(2)]], "pending_steps": [state["step"]],
            "pending_samples": [1], "pending_first": [state["step"]]}
    old1 = {**state, "unapplied": [], "pending": [], "pending_steps": [], "pending_samples": [], "pending_first": []}
    synchronous = DelayedConfig(target_samples=1, sync_from=0, epoch_samples=3, timeout=timedelta(seconds=20),
                                name="nowsync")
    decided = []
    for rank in range(world_size):
        strategy = SimpleNamespace(world_size=world_size, global_rank=rank)
        loaded = restored(synchronous, ABSSGDStrategy._engine_state(strategy, [old0, old1]))
        decided.append((loaded.fresh_from, loaded.progress().epoch_end_rounds))
    assert decided == [(state["step"] + 1, state["epoch_end_rounds"])] * world_size
    assert len(state["epoch_end_rounds"]) == 2  # the epochs ended at rounds the state holds
