"""Lightning's decisions by the clock under every strategy: real 4-process fits launched by Lightning.

``Trainer(max_time=...)``'s ``Timer`` and ``ModelCheckpoint(train_time_interval=...)``
broadcast rank 0's decision at every batch end; a time-based ``val_check_interval``
lets each rank validate by its own clock. The strategies carry rank 0's decisions
in their rounds instead (``lightning_partial.strategies.agreed_clock``): no
collective runs while the batches run, every rank ends its fit, saves and
validates at the same round, and the fit ends as at its step limit (the final
round applies what is pending; the replicas end bit-identical). Under
``abs_sgd`` the ranks run different numbers of batches, so Lightning's broadcast
pairs with other collectives: the case these tests were written for.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightning_partial.strategies.checkpoint import CHECKPOINT_KEY, resume_entry
from tests import forkrun
from tests.test_eager_sgd import FIT_ENV, assert_identical, fit_command


def timed_fit(out: Path, strategy: str, *extra: str, seconds: float = 3.0, launch: str = "fork") -> list[dict]:
    """A 4-process fit of tests/scripts/fit.py with a time limit and no other; the rank records."""
    command = fit_command(out, "--strategy", strategy, "--max-time", str(seconds), *extra, launch=launch)
    proc = forkrun.run(command, env=FIT_ENV, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((out / f"callbacks{r}.json").read_text()) for r in range(4)]


def assert_finished_alike(out: Path, records: list[dict]) -> None:
    """Every rank stopped by the time limit (not by SIGTERM) after the same optimizer steps, ended with the
    final round (nothing pending left unapplied), and holds the same weights."""
    assert not list(out.glob("stopped*")), "the fit raised SIGTERMException"
    assert all(r["should_stop"] for r in records)
    assert len({r["global_step"] for r in records}) == 1, [r["global_step"] for r in records]
    assert records[0]["global_step"] > 0
    assert all(r["last_round"]["flush"] for r in records)
    assert len({r["last_round"]["round"] for r in records}) == 1
    assert_identical(out)


def time_checkpoints(out: Path, strategy: str, family: str) -> list[int]:
    """The global steps of the time-based checkpoints, sorted; each holds every rank's engine state at one
    round (``resume_entry`` refuses one saved while the ranks were at different rounds)."""
    steps = []
    for path in sorted((out / "ckpt_time").glob("*.ckpt")):
        checkpoint = torch.load(path, weights_only=False)
        entry = resume_entry(checkpoint[CHECKPOINT_KEY], strategy=strategy, family=family, source=path)
        assert entry is not None and entry["world_size"] == 4
        steps.append(int(checkpoint["global_step"]))
    return sorted(steps)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy, launch", [("eager_sgd", "popen"), ("wagma_sgd", "fork")])
def test_a_time_limit_runs_no_collective_per_batch_and_every_rank_ends_at_the_same_step(tmp_path, strategy, launch):
    """A straggler per batch and the collective spy: from the first batch start to the last batch end no
    collective ran on any group (under Lightning's own Timer, one broadcast per batch). Under the script
    launcher (what torchrun users run) and, where the interpreters' start-up would only add time, forked
    ranks."""
    out = tmp_path / "run"
    records = timed_fit(out, strategy, "--straggle-ms", "10", "--spy", launch=launch)
    assert_finished_alike(out, records)
    for rec in records:
        assert rec["collectives_at_batch_end"][-1] == 0, rec["collective_names"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["eager_sgd", "wagma_sgd"])
def test_a_time_limit_runs_the_synchronous_finish_in_its_last_share(tmp_path, strategy):
    """``max_time`` alone, so no count of steps places the finish: once ``1 - final_sync`` of the limit has
    passed, rank 0 asks for it in a round, and every rank's rounds are synchronous from the same round on
    until the fit ends (every rank applied the same rounds, each alike; before, none of the fit's rounds
    was synchronous but ``wagma_sgd``'s periodic global averages)."""
    out = tmp_path / "run"
    records = timed_fit(out, strategy, "--straggle-ms", "10", "--strategy-kw", '{"final_sync": 0.4}', seconds=4.0)
    assert_finished_alike(out, records)
    rounds = records[0]["rounds"]
    assert all(rec["rounds"] == rounds for rec in records)
    requested = [(r, first) for r, _, first in rounds if first is not None]
    assert len(requested) == 1, requested
    request_round, first = requested[0]
    assert request_round >= 3, request_round  # by the clock, not at the first batches
    finish = [synchronous for r, synchronous, _ in rounds if r >= first]
    assert len(finish) > 1 and all(finish), rounds[-10:]  # step rounds of the finish (the final one not logged)


@pytest.mark.timeout(300)
def test_eager_sgd_saves_and_validates_by_rank_0s_clock_at_the_same_step(tmp_path):
    """Time-based checkpoints and validation (its ``sync_dist`` logging is a collective), 0.5 s intervals in a
    4 s fit: every rank validates and saves at the same global steps, several times, and each checkpoint file
    is a consistent cut (every rank's engine state at one round)."""
    out = tmp_path / "run"
    records = timed_fit(out, "eager_sgd", "--straggle-ms", "10", "--checkpoint-seconds", "0.5",
                        "--val-seconds", "0.5", seconds=4.0)
    assert_finished_alike(out, records)
    validated = [r["validated_at"] for r in records]
    assert all(v == validated[0] for v in validated), validated
    assert any(step < records[0]["global_step"] for step in validated[0]), validated  # not only the last
    saved = [r["saved_at"] for r in records]
    assert all(s == saved[0] for s in saved) and len(saved[0]) >= 2, saved
    assert time_checkpoints(out, "eager_sgd", "gradients") == sorted(saved[0])


@pytest.mark.timeout(300)
def test_ds_sync_validates_at_the_same_steps(tmp_path):
    out = tmp_path / "run"
    records = timed_fit(out, "ds_sync", "--straggle-ms", "10", "--val-seconds", "0.5")
    assert_finished_alike(out, records)
    validated = [r["validated_at"] for r in records]
    assert all(v == validated[0] for v in validated), validated
    assert any(step < records[0]["global_step"] for step in validated[0]), validated


@pytest.mark.timeout(300)
@pytest.mark.parametrize("delay", [1, 0])
def test_abs_sgd_ends_and_saves_at_the_same_round_whatever_its_batches(tmp_path, delay):
    """Speeds 1, 1, 0.5, 0.25: with the delay the fast ranks run more micro-batches than the slow ones, so
    their batch ends differ; the time limit ends every rank's fit at the same round (as ``max_steps``), and
    every rank takes part in every save, time-based and every 7 steps, in the same order (the rounds'),
    however the rounds fell into its batches (each file a consistent cut)."""
    out = tmp_path / "run"
    records = timed_fit(out, "abs_sgd", "--speed", "1,1,0.5,0.25", "--checkpoint-seconds", "0.5",
                        "--checkpoint-every", "7", "--strategy-kw", json.dumps({"delay": delay, "timeout": 60}),
                        seconds=4.0)
    assert_finished_alike(out, records)
    assert all(r["saved_names"] == records[0]["saved_names"] for r in records)  # each file named as rank 0 does
    if delay == 1:
        batches = [sum(r["epoch_batches"]) for r in records]
        assert batches[0] > batches[3], batches  # the case Lightning's per-batch broadcast cannot pair
    # Every rank takes part in every save (a rank's own global step at a save may differ: the cut is the
    # engines', made consistent by the save's quiesce).
    saved = [r["saved_at"] for r in records]
    assert len({len(s) for s in saved}) == 1, saved
    timed = time_checkpoints(out, "abs_sgd", "abs_sgd")
    assert len(timed) >= 2, timed
    by_steps = [p for p in (out / "ckpt").glob("*.ckpt") if p.name != "last.ckpt"]
    assert by_steps and len(timed) + len(by_steps) <= len(saved[0])


@pytest.mark.timeout(300)
def test_abs_sgd_arrivals_that_go_on_end_save_and_validate_alike_under_a_time_limit(tmp_path):
    """``AdaptiveBatchSize`` (arrival by samples) with ``overlap_arrival`` (the default: an arriving rank computes
    its next micro-batch while the round completes, and is handed the round in the next batch), speeds 1, 1,
    0.5, 0.25, a time limit (rank 0 asks for the finish in whatever round: usually one the ranks went on from),
    time-based saves and saves every 5 steps, validation at every epoch end: whether such a round has completed
    at a rank's next batch start differs between ranks, so each counts it once handed; every rank then ends at
    the same step, takes part in every save in the same order and validates as often, and the replicas end
    bit-identical (before, a round that ended an epoch or the fit while outstanding could pair one rank's save
    with another's validation). ``timeout`` bounds every wait at 60 s."""
    out = tmp_path / "run"
    records = timed_fit(out, "abs_sgd", "--speed", "1,1,0.5,0.25", "--adaptive", "--validate",
                        "--checkpoint-seconds", "0.5", "--checkpoint-every", "5",
                        "--strategy-kw", json.dumps({"timeout": 60}), seconds=6.0)
    assert_finished_alike(out, records)
    assert all(r["update_rule"]["overlap_arrival"] for r in records)
    assert sum(r["step_lags"].get("1", 0) for r in records) > 0, [r["step_lags"] for r in records]  # it went on
    assert all(r["saved_names"] == records[0]["saved_names"] for r in records)
    assert len({len(r["saved_at"]) for r in records}) == 1 and records[0]["saved_at"], records[0]["saved_at"]
    assert len({len(r["validated_at"]) for r in records}) == 1 and records[0]["validated_at"], records[0]
    assert time_checkpoints(out, "abs_sgd", "abs_sgd")


@pytest.mark.timeout(300)
def test_abs_sgd_saves_before_every_epoch_end_on_every_rank(tmp_path):
    """The paper's delay without the synchronous finish (every round asynchronous to the end), speeds 1, 1,
    0.5, 0.25, a step checkpoint at every step, validation (a collective) at each of 3 epoch ends: a rank
    applies a round in its own batch, so the saves of the rounds before an epoch's last round run at the end
    of the epoch's last batch on every rank, before validation; every rank saves as often and validates at
    every epoch end, and the replicas end bit-identical.

    A rank reaches a save, and an epoch end, at its own global step, yet every rank names each file as
    rank 0 does (``ModelCheckpoint``'s version counter runs a collective per name it tries) and takes the
    same epoch-end decisions (``save_last="link"`` links at an epoch end unless it saved at that step):
    ranks that decided otherwise paired their later collectives wrongly, and failed or hung. ``timeout``
    bounds every wait at 60 s, so that such a mismatch fails naming the rank instead of outlasting the test."""
    out = tmp_path / "run"
    command = fit_command(out, "--strategy", "abs_sgd", "--max-epochs", "3", "--speed", "1,1,0.5,0.25",
                          "--checkpoint-every", "1", "--save-last", "link", "--validate",
                          "--strategy-kw", json.dumps({"delay": 1, "final_sync": 0.0, "timeout": 60}),
                          launch="fork")
    proc = forkrun.run(command, env=FIT_ENV, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads((out / f"callbacks{r}.json").read_text()) for r in range(4)]
    assert len({len(r["saved_at"]) for r in records}) == 1 and records[0]["saved_at"], records[0]["saved_at"]
    assert all(len(r["validated_at"]) == 3 for r in records), [r["validated_at"] for r in records]
    assert len({r["global_step"] for r in records}) == 1
    # Some saves found the ranks at different global steps (the case); every file was named alike.
    saved = [r["saved_at"] for r in records]
    assert any(len(set(steps)) > 1 for steps in zip(*saved)), saved
    assert all(r["saved_names"] == records[0]["saved_names"] for r in records)
    assert_identical(out)
