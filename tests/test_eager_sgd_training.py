"""EagerSGDStrategy inside Lightning, on exact arithmetic: nothing computed is lost.

Each test runs ``tests/scripts/exact.py`` (a real 4-process fit through
Lightning's launcher) whose gradients do not depend on the weights, so the
final weights follow from what the ranks computed, bit for bit (see the
script's docstring). Rank 3 is persistently slow, so in solo and majority mode
its gradients arrive late, are carried, and must still land exactly once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_partial.strategies.checkpoint import CHECKPOINT_KEY
from tests import forkrun

SCRIPT = "tests.scripts.exact"  # run as `python -m` from the repository root
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}

pytestmark = pytest.mark.timeout(240)


def run(out: Path, *extra: str) -> list[dict]:
    """A 4-process fit of tests/scripts/exact.py; the rank records. Forked ranks (no imports of their own)
    unless the fit evaluates after it (``--evaluate`` needs the script launcher)."""
    launch = "popen" if "--evaluate" in extra else "fork"
    proc = forkrun.run([sys.executable, "-m", SCRIPT, "--out", str(out), "--launch", launch, *extra], env=ENV,
                       timeout=200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


def computed(records: list[dict], *, before: int | None = None) -> torch.Tensor:
    """Sum over every rank and batch of sum(x) (steps < ``before`` if given)."""
    total = torch.zeros(len(records[0]["seen"][0]["x"]), dtype=torch.float64)
    for rec in records:
        for item in rec["seen"]:
            if before is None or item["step"] < before:
                total += torch.tensor(item["x"], dtype=torch.float64)
    return total


def expected(w0: list[float], total: torch.Tensor, *, lr: float, world: int, scale: float = 1.0) -> list[float]:
    return (torch.tensor(w0, dtype=torch.float64) - lr / world * scale * total).tolist()


def assert_identical_replicas(records: list[dict], key: str = "final") -> None:
    for rec in records[1:]:
        assert rec[key] == records[0][key], f"rank {rec['rank']} differs from rank 0"


@pytest.fixture(scope="module")
def solo_accumulate(tmp_path_factory) -> list[dict]:
    return run(tmp_path_factory.mktemp("solo"), "--strategy", "eager_sgd", "--accumulate", "2", "--evaluate", "--spy")


@pytest.fixture(scope="module")
def ddp_accumulate(tmp_path_factory) -> list[dict]:
    return run(tmp_path_factory.mktemp("ddp"), "--strategy", "ddp", "--accumulate", "2", "--evaluate", "--spy")


def test_solo_with_accumulation_applies_every_gradient_exactly_once(solo_accumulate):
    records = solo_accumulate
    assert_identical_replicas(records)
    # Gradient accumulation: Lightning divides each micro-batch's loss by A = 2.
    want = expected(records[0]["w0"]["w"], computed(records), lr=records[0]["lr"], world=4, scale=1 / 2)
    assert records[0]["final"]["w"] == want
    assert records[0]["final"]["v"] == expected(records[0]["w0"]["v"], computed(records), lr=records[0]["lr"], world=4)
    assert all(r["global_step"] == 12 for r in records)
    assert all(len(r["seen"]) == 24 for r in records)  # 12 optimizer steps x 2 micro-batches


def test_ddp_obeys_the_same_formula(ddp_accumulate):
    """The reference: DDP averages every step, and lands on the same closed form."""
    records = ddp_accumulate
    assert_identical_replicas(records)
    want = expected(records[0]["w0"]["w"], computed(records), lr=records[0]["lr"], world=4, scale=1 / 2)
    assert records[0]["final"]["w"] == want


def test_no_collective_on_the_default_group_while_batches_run(solo_accumulate, ddp_accumulate):
    # eager_sgd: nothing between the first batch start and the last batch end.
    for rec in solo_accumulate:
        assert rec["collectives_at_batch_end"][-1] == 0, rec["collective_names"]
    # The spy works: under DDP it sees Lightning's per-batch SIGTERM broadcast.
    for rec in ddp_accumulate:
        assert rec["collectives_at_batch_end"][-1] >= 23, rec["collectives_at_batch_end"]


def test_sampler_logging_and_evaluation_behave_as_under_ddp(solo_accumulate, ddp_accumulate):
    for records in (solo_accumulate, ddp_accumulate):
        seen = [set(r["train_indices"]) for r in records]
        assert all(len(s) == 24 * 4 for s in seen)  # 24 micro-batches of 4 samples
        for i in range(4):
            for j in range(i + 1, 4):
                assert not seen[i] & seen[j], "DistributedSampler: ranks must see disjoint samples"
        for rec in records:
            # sync_dist=True: the mean of the ranks 0..3 on every rank, in training and evaluation.
            assert rec["train_rank_mean"] == rec["val_rank_mean"] == rec["test_rank_mean"] == 1.5
            assert rec["predicted"] == 16  # 64 samples / 4 ranks
            assert rec["final_after_evaluate"] == rec["final"]  # evaluation never touches the engine


def test_manual_optimization_with_two_optimizers_majority_bf16_mixed(tmp_path):
    records = run(tmp_path, "--strategy", "eager_sgd_majority", "--manual", "--precision", "bf16-mixed")
    assert_identical_replicas(records)
    # manual_backward, then opt.step(): the gradients exist before the step, at the current weights; weight
    # prediction (on by default) cannot move them, and the strategy counts such steps (and warns once).
    assert all(r["unpredicted_steps"] == r["global_step"] > 0 for r in records), records[0]["unpredicted_steps"]
    total = computed(records)
    lr = records[0]["lr"]
    assert records[0]["final"]["w"] == expected(records[0]["w0"]["w"], total, lr=lr, world=4)
    assert records[0]["final"]["v"] == expected(records[0]["w0"]["v"], total, lr=lr, world=4, scale=2)


def test_several_optimizers_bound_by_max_steps_end_with_their_synchronous_finish(tmp_path):
    """Manual optimization, two optimizers stepping every batch: ``max_steps=40`` counts both, so each engine
    runs 20 rounds, and a finish placed at the fit's step 30 (``final_sync=0.25``) would never come. Rank 0
    asks for it at that global step instead: each engine's last rounds are synchronous, the same on every rank,
    and every gradient still lands exactly once."""
    records = run(tmp_path, "--strategy", "eager_sgd", "--manual", "--steps", "40",
                  "--strategy-kw", '{"final_sync": 0.25}')
    assert_identical_replicas(records)
    total = computed(records)
    lr = records[0]["lr"]
    assert records[0]["final"]["w"] == expected(records[0]["w0"]["w"], total, lr=lr, world=4)
    assert records[0]["final"]["v"] == expected(records[0]["w0"]["v"], total, lr=lr, world=4, scale=2)
    rounds = records[0]["rounds"]
    assert sorted(rounds) == ["0", "1"] and all(rec["rounds"] == rounds for rec in records)
    for index, applied in rounds.items():
        assert [r for r, _, _ in applied] == list(range(20)), index  # the step rounds (the final one not logged)
        requested = [first for _, _, first in applied if first is not None]
        # Asked at global step 30 - 2 optimizers x a margin of 3 = 24 (batch 12): rounds from 15 or 16 on.
        assert len(requested) == 1 and 15 <= requested[0] <= 16, (index, applied)
        assert all(synchronous for r, synchronous, _ in applied if r >= requested[0]), (index, applied)
        assert not all(synchronous for _, synchronous, _ in applied[:requested[0]]), (index, applied)


def test_bf16_true_replicas_identical(tmp_path):
    records = run(tmp_path, "--strategy", "eager_sgd", "--precision", "bf16-true", "--steps", "8")
    assert_identical_replicas(records)
    assert records[0]["final"]["w"] != records[0]["w0"]["w"]


def test_resume_from_a_mid_run_checkpoint_loses_no_carried_gradient(tmp_path):
    first = run(tmp_path / "first", "--strategy", "eager_sgd", "--steps", "10", "--save-at", "6")
    checkpoint = torch.load(tmp_path / "first" / "mid.ckpt", weights_only=False)
    entry = checkpoint[CHECKPOINT_KEY]
    assert entry["world_size"] == 4 and entry["strategy"] == "eager_sgd"
    states = entry["engines"][0]
    assert {s["step"] for s in states} == {6}
    # The slow rank's late gradients were pending at the save: the test has teeth.
    assert sum(len(s["pending"]) for s in states) >= 1, states

    second = run(tmp_path / "second", "--strategy", "eager_sgd", "--steps", "10", "--resume", str(tmp_path / "first" / "mid.ckpt"))
    assert_identical_replicas(second)
    assert all(item["step"] >= 6 for rec in second for item in rec["seen"])
    total = computed(first, before=6) + computed(second)
    want = expected(first[0]["w0"]["w"], total, lr=first[0]["lr"], world=4)
    assert second[0]["final"]["w"] == want


OVERLAP = json.dumps({"overlap": True})


@pytest.mark.parametrize("kw", [{"final_sync": 0.0}, {"overlap": True}], ids=["carried", "overlap"])
def test_a_fit_resumed_from_its_last_steps_checkpoint_applies_what_the_checkpoint_held(tmp_path, kw):
    """A checkpoint saved at the fit's last step (``max_steps``) holds what the end of fit applies after it: the
    slow rank's carried gradients (``final_sync=0``: the last rounds are solo), or the last round's result
    (``overlap``). Resumed, Lightning's loop has nothing to run and calls no training hook; the strategy still
    ends the fit at teardown, so nothing is lost: the closed form over what the first fit computed, bit for bit,
    and the first fit's own weights (before, the resumed weights lacked it)."""
    first = run(tmp_path / "first", "--strategy", "eager_sgd", "--steps", "12", "--save-at", "12",
                "--strategy-kw", json.dumps(kw))
    checkpoint = torch.load(tmp_path / "first" / "mid.ckpt", weights_only=False)
    from lightning_partial.strategies.overlap import IN_FLIGHT_KEY

    held = sum(len(s["pending"]) for s in checkpoint[CHECKPOINT_KEY]["engines"][0])
    assert held or IN_FLIGHT_KEY in checkpoint, "nothing was pending at the save: the test proves nothing"
    second = run(tmp_path / "second", "--strategy", "eager_sgd", "--steps", "12", "--resume",
                 str(tmp_path / "first" / "mid.ckpt"), "--strategy-kw", json.dumps(kw))
    assert all(not rec["seen"] for rec in second)  # no batch ran
    assert_identical_replicas(second)
    want = expected(first[0]["w0"]["w"], computed(first), lr=first[0]["lr"], world=4)
    assert first[0]["final"]["w"] == want
    assert second[0]["final"]["w"] == want


def test_overlap_applies_every_gradient_exactly_once(tmp_path):
    """overlap=True: each step applies the previous step's round (the first step nothing, the last round at the
    end of fit); with accumulation, every micro-batch's gradient still lands exactly once."""
    records = run(tmp_path, "--strategy", "eager_sgd", "--accumulate", "2", "--strategy-kw", OVERLAP)
    assert_identical_replicas(records)
    want = expected(records[0]["w0"]["w"], computed(records), lr=records[0]["lr"], world=4, scale=1 / 2)
    assert records[0]["final"]["w"] == want
    assert all(r["global_step"] == 12 for r in records)


def test_catch_up_skips_batches_and_applies_every_computed_gradient_exactly_once(tmp_path):
    """catch_up=True with a slow rank and no bound: the slow rank skips the batches whose rounds ran without it
    (no training_step, no backward) and applies their results; the formula over what was computed holds bit for
    bit, every rank takes the same optimizer steps, and the replicas end identical."""
    records = run(tmp_path, "--strategy", "eager_sgd", "--steps", "24", "--slow-ms", "60",
                  "--strategy-kw", json.dumps({"catch_up": True, "max_staleness": None}))
    assert_identical_replicas(records)
    want = expected(records[0]["w0"]["w"], computed(records), lr=records[0]["lr"], world=4)
    assert records[0]["final"]["w"] == want
    assert all(r["global_step"] == 24 for r in records)
    slow = records[3]
    assert slow["skipped_steps"] > 0, "the slow rank never skipped: the test proves nothing"
    for r in records:
        assert len(r["seen"]) + r["skipped_steps"] == 24, r["rank"]  # a batch is computed or skipped, never both


def test_overlap_resume_applies_the_round_in_flight_at_the_save(tmp_path):
    """The checkpoint takes the round in flight (every rank, before the gather): its result is in the file,
    and the resumed fit's first step applies it; nothing is lost or applied twice."""
    first = run(tmp_path / "first", "--strategy", "eager_sgd", "--steps", "10", "--save-at", "6",
                "--strategy-kw", OVERLAP)
    checkpoint = torch.load(tmp_path / "first" / "mid.ckpt", weights_only=False)
    assert {s["step"] for s in checkpoint[CHECKPOINT_KEY]["engines"][0]} == {6}
    from lightning_partial.strategies.overlap import IN_FLIGHT_KEY

    held = checkpoint[IN_FLIGHT_KEY][0]
    assert held["applied"] is True
    assert any(t.abs().sum() > 0 for t in held["tensors"]), "round 5's result, not yet applied at the save"
    second = run(tmp_path / "second", "--strategy", "eager_sgd", "--steps", "10", "--resume",
                 str(tmp_path / "first" / "mid.ckpt"), "--strategy-kw", OVERLAP)
    assert_identical_replicas(second)
    total = computed(first, before=6) + computed(second)
    assert second[0]["final"]["w"] == expected(first[0]["w0"]["w"], total, lr=first[0]["lr"], world=4)
    # The uninterrupted fit lands on the same closed form.
    assert first[0]["final"]["w"] == expected(first[0]["w0"]["w"], computed(first), lr=first[0]["lr"], world=4)

    # Without overlap the held result would be lost: refused, until dropped explicitly.
    refused = forkrun.run(
        [sys.executable, "-m", SCRIPT, "--out", str(tmp_path / "refused"), "--strategy", "eager_sgd", "--steps", "10",
         "--resume", str(tmp_path / "first" / "mid.ckpt"), "--launch", "fork"],
        env=ENV, timeout=200,
    )
    assert refused.returncode != 0 and "saved with overlap=True" in refused.stdout + refused.stderr
    from lightning_partial.strategies.checkpoint import drop_engine_state

    assert drop_engine_state(tmp_path / "first" / "mid.ckpt", tmp_path / "dropped.ckpt") >= 1
    assert IN_FLIGHT_KEY not in torch.load(tmp_path / "dropped.ckpt", weights_only=False)


def test_16_mixed_is_refused_with_a_clear_error():
    from lightning.pytorch.plugins.precision import MixedPrecision

    from lightning_partial import EagerSGDStrategy

    strategy = EagerSGDStrategy(precision_plugin=MixedPrecision("16-mixed", "cpu"))
    with pytest.raises(ValueError, match="16-mixed"):
        strategy.check_precision()
    EagerSGDStrategy(precision_plugin=MixedPrecision("bf16-mixed", "cpu")).check_precision()  # no scaler: fine


def test_processes_created_by_torchrun(tmp_path):
    """torchrun starts the 4 processes; Lightning's TorchElasticEnvironment finds them."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
        "-m", SCRIPT, "--out", str(tmp_path), "--strategy", "eager_sgd", "--steps", "6",
    ]
    proc = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert_identical_replicas(records)
    assert records[0]["final"]["w"] == expected(records[0]["w0"]["w"], computed(records), lr=records[0]["lr"], world=4)


def test_processes_created_by_slurm(tmp_path):
    """Four processes started as srun would (SLURM_* variables); Lightning's SLURMEnvironment finds them."""
    from tests.scripts.ports import free_port

    port = free_port()
    procs = []
    for rank in range(4):
        env = {
            **ENV, "SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "4", "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank), "SLURM_NODEID": "0", "SLURM_NODELIST": "127.0.0.1",
            "SLURM_JOB_NAME": "lightning_partial_test", "SLURM_JOB_ID": "4242", "MASTER_PORT": str(port),
        }
        command = [sys.executable, "-m", SCRIPT, "--out", str(tmp_path), "--strategy", "eager_sgd", "--steps", "6"]
        procs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        outputs = [p.communicate(timeout=200)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outputs)
    assert "SLURM" in outputs[0]
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert_identical_replicas(records)
    assert records[0]["final"]["w"] == expected(records[0]["w0"]["w"], computed(records), lr=records[0]["lr"], world=4)


def test_checkpoint_states_split_for_another_world_size():
    from lightning_partial.strategies.checkpoint import state_for_rank

    def state(rank: int, step: int = 5) -> dict:
        return {"step": step, "initiator_rng": None, "pending": [[torch.full((2,), float(rank))]],
                "pending_steps": [step - 1], "dropped": rank}

    old = [state(r) for r in range(4)]
    assert state_for_rank(old, rank=2, world_size=4) is old[2]
    halves = [state_for_rank(old, rank=r, world_size=2) for r in range(2)]
    # Old rank j's pending goes to new rank j % 2: nothing is lost, nothing duplicated.
    assert [[float(p[0][0]) for p in h["pending"]] for h in halves] == [[0.0, 2.0], [1.0, 3.0]]
    assert all(h["step"] == 5 for h in halves)
    with pytest.raises(ValueError, match="different rounds"):
        state_for_rank([state(0, 5), state(1, 6)], rank=0, world_size=2)
