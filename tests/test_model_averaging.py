"""WAGMAStrategy and DSSyncStrategy: registry, bad input, and real 4-process fits launched by Lightning."""

from __future__ import annotations

import json
import math
import pickle
import signal
import subprocess
from pathlib import Path

import pytest
import torch

import lightning_partial
from lightning_partial import DSSyncStrategy, WAGMAStrategy
from lightning_partial.callbacks import GroupRotation
from lightning_partial.collectives import ButterflySchedule, ShuffleSchedule
from lightning_partial.strategies.checkpoint import CHECKPOINT_KEY
from tests import forkrun
from tests.test_eager_sgd import FIT_ENV, assert_identical, assert_stopped_alike, fit_command, signal_rank_when_running


def test_registry_names():
    from lightning.pytorch.strategies import StrategyRegistry

    lightning_partial.register_strategies()  # idempotent
    for name, cls, start_method in (
        ("wagma_sgd", WAGMAStrategy, "popen"),
        ("wagma_sgd_spawn", WAGMAStrategy, "spawn"),
        ("wagma_sgd_fork", WAGMAStrategy, "fork"),
        ("ds_sync", DSSyncStrategy, "popen"),
        ("ds_sync_spawn", DSSyncStrategy, "spawn"),
        ("ds_sync_fork", DSSyncStrategy, "fork"),
    ):
        strategy = StrategyRegistry.get(name)
        assert type(strategy) is cls and strategy._start_method == start_method
        pickle.loads(pickle.dumps(strategy))  # no threads or groups before setup


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: WAGMAStrategy(group_size=3), "group_size must be a power of two"),
        (lambda: WAGMAStrategy(group_size=2, schedule=ButterflySchedule(world_size=4, group_size=4)),
         "group_size and schedule both given"),
        (lambda: WAGMAStrategy(global_every=0), "tau"),
        (lambda: WAGMAStrategy(normalize="mean"), "unknown normalize"),
        (lambda: WAGMAStrategy(mode="fastest"), "unknown mode"),
        (lambda: DSSyncStrategy(num_groups=0), "num_groups"),
        (lambda: DSSyncStrategy(late="keep"), "unknown late policy 'keep'"),
        (lambda: WAGMAStrategy(late="damped"), "unknown late policy 'damped'"),
        (lambda: WAGMAStrategy(order="reference"), "unknown order 'reference'"),
        (lambda: DSSyncStrategy(order="before"), "unknown order 'before'"),
        (lambda: DSSyncStrategy(measure_every=0), "measure_every"),
        (lambda: DSSyncStrategy(average_every=0), "ds_sync: average_every must be an integer >= 1, got 0"),
        (lambda: WAGMAStrategy(average_every=2.5), "wagma_sgd: average_every must be an integer >= 1, got 2.5"),
        (lambda: WAGMAStrategy(average_every=2, finish="gradients"), "needs a round every step"),
        (lambda: GroupRotation(consensus_every=0), "consensus_every"),
        (lambda: GroupRotation(switch_at={0: ShuffleSchedule(world_size=4, num_groups=2)}), "switch_at"),
    ],
)
def test_bad_configuration_fails_at_construction(build, match):
    with pytest.raises(ValueError, match=match):
        build()


@pytest.mark.parametrize(
    "strategy, world, match",
    [
        (WAGMAStrategy(group_size=8), 4, "exceeds the world size"),
        (WAGMAStrategy(), 6, "power-of-two number of ranks"),
        (DSSyncStrategy(num_groups=3), 4, "does not divide"),
        (WAGMAStrategy(schedule=ShuffleSchedule(world_size=8, num_groups=2)), 4, "built for 8 ranks"),
        (DSSyncStrategy(mode="majority"), 1, "at least 2 ranks"),
    ],
)
def test_world_dependent_checks_fail_at_set_up(strategy, world, match):
    """Checked in ``setup`` (the world size is known there), before any rank trains."""
    with pytest.raises(ValueError, match=match):
        strategy.validate_world(world)


def test_default_correction_and_order():
    """The damped correction (stable for every lag) and the local step before the average, for both."""
    for strategy in (WAGMAStrategy(), DSSyncStrategy()):
        assert (strategy.normalize, strategy.late, strategy.stale, strategy.order) == (
            "group", "damp", "skip", "step_then_average"
        )
    assert WAGMAStrategy().global_every == 5 and DSSyncStrategy().partial_config.max_staleness == 1


def test_default_schedules():
    # The phases rotate over the group rounds: the schedule knows the global period (tau = 5).
    assert WAGMAStrategy().build_schedule(4) == ButterflySchedule(world_size=4, group_size=2, global_every=5)
    assert WAGMAStrategy().build_schedule(64).group_size == 8
    assert DSSyncStrategy(seed=3).build_schedule(4) == ShuffleSchedule(world_size=4, num_groups=2, seed=3)
    # An odd world size: groups of its smallest divisor (the default had named num_groups at P = 5, 7, 9).
    for world, groups in ((1, 1), (3, 1), (5, 1), (6, 3), (7, 1), (9, 3), (15, 5)):
        DSSyncStrategy().validate_world(world)
        assert DSSyncStrategy().build_schedule(world).num_groups == groups, world


def run_fit(out: Path, strategy: str, *extra: str, launch: str = "fork") -> list[dict]:
    """A 4-process fit of tests/scripts/fit.py (``launch``: its ``--launch``); the rank records."""
    proc = forkrun.run(fit_command(out, "--strategy", strategy, *extra, launch=launch), env=FIT_ENV, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((out / f"callbacks{r}.json").read_text()) for r in range(4)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "strategy, schedule",
    [
        ("wagma_sgd", ButterflySchedule(world_size=4, group_size=2, global_every=5)),
        ("ds_sync", ShuffleSchedule(world_size=4, num_groups=2, seed=0)),
    ],
)
def test_fit_under_imbalance(tmp_path, strategy, schedule):
    """4 ranks, one 20 ms straggler per step: every rank follows the same schedule, the consensus
    distance is measured and bounded, the final average leaves the replicas bit-identical (BatchNorm
    buffers included). The synchronous finish (``final_sync=0.05`` by default: 2 of the 30 rounds) makes
    rounds 28 and 29 global averages."""
    out = tmp_path / strategy
    records = run_fit(out, strategy, "--straggle-ms", "20", "--steps", "30", "--rotation", "5", "--track", "--csv",
                      str(out / "csv"), "--batchnorm")
    states = [torch.load(out / f"rank{r}.pt") for r in range(4)]
    for other in states[1:]:
        for key, value in states[0].items():
            assert torch.equal(value, other[key]), key
    # SGD: adaptive_scaling="auto" leaves the local steps alone (averaged SGD steps already are DDP's).
    assert all(r["update_rule"]["adaptive_scaling"] == "none" for r in records)
    global_every = 5 if strategy == "wagma_sgd" else None  # WAGMAStrategy's default
    finish = 30 - math.ceil(0.05 * 30)
    by_round: dict[int, dict[int, tuple[int, ...]]] = {}
    for rank, record in enumerate(records):
        rounds = [g["round_index"] for g in record["groups"]]
        assert rounds == list(range(30)), rounds
        for g in record["groups"]:
            r = g["round_index"]
            members = tuple(g["members"])
            if global_every is not None and (r + 1) % global_every == 0 or r >= finish:
                assert members == (0, 1, 2, 3) and g["group_id"] == -1
            else:
                assert members == schedule.group_of(r, rank) and g["group_id"] == schedule.group_id(r, rank)
            by_round.setdefault(r, {})[rank] = members
            if (r + 1) % 5 == 0 or g["group_id"] == -1:
                assert g["consensus"] is not None and math.isfinite(g["consensus"]) and 0 <= g["consensus"] < 1.0
    for r, members in by_round.items():  # every rank computed the same partition
        for group in members.values():
            assert all(members[m] == group for m in group), (r, members)
    consensus = {g["round_index"]: g["consensus"] for g in records[0]["groups"] if g["consensus"] is not None}
    assert len(set(consensus)) >= 5
    assert len({json.dumps([g["consensus"] for g in rec["groups"]]) for rec in records}) == 1  # same on all ranks
    header = (out / "csv" / "fit" / "version_0" / "metrics.csv").read_text().splitlines()[0]
    for column in ("groups/group_id", "groups/members", "groups/consensus", "partial/fresh"):
        assert column in header


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy, options", [
    ("wagma_sgd", {"average_every": 4}),
    ("ds_sync", {"average_every": 4, "order": "average_then_step"}),
])
def test_local_steps_join_every_nth_round_and_the_finish_keeps_the_period(tmp_path, strategy, options):
    """``average_every=4``, 30 steps, one 20 ms straggler per step: every rank joins a round at steps 3, 7, ..., 27
    only (rounds 0-6; the steps between are local). The synchronous finish (``final_sync=0.25``: steps 22-29) keeps
    the period: its rounds, 5 and 6 (steps 23 and 27), are synchronous global averages; ``wagma_sgd``'s
    ``global_every=5`` counts rounds (round 4 is global). The same rounds at the same steps on every rank, and the
    final average leaves the replicas bit-identical. Without local steps every step is a round
    (test_fit_under_imbalance)."""
    out = tmp_path / strategy
    records = run_fit(out, strategy, "--straggle-ms", "20", "--steps", "30", "--rotation", "5", "--track",
                      "--strategy-kw", json.dumps({**options, "final_sync": 0.25}))
    global_rounds = [4, 5, 6] if strategy == "wagma_sgd" else [5, 6]
    for record in records:
        assert record["update_rule"]["average_every"] == 4
        # GroupRotation's step: the steps taken with this one (steps 3, 7, ... counted from 0).
        assert [(g["step"], g["round_index"]) for g in record["groups"]] == [
            (4, 0), (8, 1), (12, 2), (16, 3), (20, 4), (24, 5), (28, 6)]
        assert [g["round_index"] for g in record["groups"] if g["group_id"] == -1] == global_rounds
        assert [r[1] for r in record["rounds"]] == [r in global_rounds for r in range(7)]  # synchronous ones
    assert len({json.dumps([g["consensus"] for g in r["groups"]]) for r in records}) == 1  # measured alike
    assert_identical(out)


@pytest.mark.timeout(300)
def test_local_steps_with_a_backup_worker_average_all_but_one_rank_in_every_round(tmp_path):
    """One group of every rank (``group_size=4``, no periodic global average), a round every 4th step,
    ``mode="quorum", backup_workers=1``: a round activates once 3 of the 4 ranks have arrived, so each of its
    averages holds at least 3 models of the round itself (solo rounds of the same group often hold one, the rest
    late); the synchronous finish (``final_sync=0.25``: rounds 5 and 6) holds all 4; the replicas end
    bit-identical."""
    out = tmp_path / "quorum"
    records = run_fit(out, "wagma_sgd", "--straggle-ms", "20", "--steps", "30", "--strategy-kw",
                      json.dumps({"group_size": 4, "global_every": None, "average_every": 4, "mode": "quorum",
                                  "backup_workers": 1, "final_sync": 0.25}))
    for record in records:
        assert [r[0] for r in record["rounds"]] == list(range(7))
        members = record["round_members"]  # per round: [averaged, fresh]
        assert all(len(fresh) >= 3 and set(fresh) <= set(averaged) for averaged, fresh in members), members
        assert [len(fresh) for _, fresh in members[5:]] == [4, 4] and all(r[1] for r in record["rounds"][5:])
    # Every member saw the same rounds (one group: the same members too).
    assert len({json.dumps([r["rounds"], r["round_members"]]) for r in records}) == 1
    assert_identical(out)


@pytest.mark.timeout(300)
def test_a_fit_resumed_inside_a_period_of_local_steps_joins_the_rounds_at_the_same_steps(tmp_path):
    """``average_every=4`` and ``final_sync=0.25`` of 12 steps (steps 9-11: its round is the one at step 11). The
    checkpoint saved after step 5 holds each optimizer's local steps since its last round (2: the round was at
    step 3); the resumed fit joins its rounds at the steps the uninterrupted one did (7, then 11, synchronous),
    with the same round numbers, where counting its period from the resume would have put them at steps 9
    (then synchronous) and 13 (after the fit)."""
    options = json.dumps({"average_every": 4, "final_sync": 0.25})
    first = tmp_path / "first"
    uninterrupted = run_fit(first, "wagma_sgd", "--straggle-ms", "10", "--steps", "12", "--save-at", "6",
                            "--rotation", "1000", "--strategy-kw", options)
    from lightning_partial.strategies.local_steps import LOCAL_STEPS_KEY

    assert torch.load(first / "mid.ckpt", weights_only=False)[LOCAL_STEPS_KEY] == {0: 2}
    # (steps taken with the round's, round, group id: -1 global)
    want = [(4, 0, 1), (8, 1, 1), (12, 2, -1)]
    for record in uninterrupted:
        assert [(g["step"], g["round_index"], -1 if g["group_id"] == -1 else 1) for g in record["groups"]] == want
    second = tmp_path / "second"
    resumed = run_fit(second, "wagma_sgd", "--straggle-ms", "10", "--steps", "12", "--rotation", "1000",
                      "--resume", str(first / "mid.ckpt"), "--strategy-kw", options)
    for record in resumed:
        assert [(g["step"], g["round_index"], -1 if g["group_id"] == -1 else 1)
                for g in record["groups"]] == want[1:]
    assert_identical(second)


@pytest.mark.timeout(300)
def test_reference_order_averages_before_the_step(tmp_path):
    """``order="average_then_step"`` (the WAGMA reference code): the average runs inside the closure,
    after the backward and before the optimizer's step. A 4-process fit: every round runs on every
    rank, and the final average still leaves the replicas bit-identical."""
    out = tmp_path / "run"
    records = run_fit(out, "wagma_sgd", "--strategy-kw", json.dumps({"order": "average_then_step"}),
                      "--straggle-ms", "10", "--steps", "12", "--rotation", "3")
    for record in records:
        assert [g["round_index"] for g in record["groups"]] == list(range(12))
    assert_identical(out)


@pytest.mark.timeout(300)
def test_adaptive_scaling_rescales_local_adam_steps_and_is_logged(tmp_path):
    """AdamW with decoupled weight decay, 4 processes, every round synchronous (deterministic):
    ``adaptive_scaling="auto"`` resolves to ``"global_batch"`` (logged as a hyperparameter), in both orders
    (``average_then_step`` notes the weights after the average, inside the closure); the final average leaves
    the replicas bit-identical; the weights differ from the same fit with ``"none"`` (the reference codes'
    local steps). The rule's arithmetic is pinned in tests/test_units.py; under SGD "auto" resolves to
    "none" (test_fit_under_imbalance runs SGD)."""
    finals = {}
    for setting, order in (("auto", "step_then_average"), ("none", "step_then_average"),
                           ("auto", "average_then_step")):
        out = tmp_path / f"{setting}-{order}"
        records = run_fit(out, "wagma_sgd", "--optimizer", "adamw", "--weight-decay", "0.01", "--steps", "12",
                          "--track", "--csv", str(out / "csv"), "--strategy-kw",
                          json.dumps({"mode": "sync", "adaptive_scaling": setting, "order": order}))
        resolved = "global_batch" if setting == "auto" else "none"
        assert [r["update_rule"]["adaptive_scaling"] for r in records] == [resolved] * 4
        hparams = (out / "csv" / "fit" / "version_0" / "hparams.yaml").read_text()
        assert f"partial/adaptive_scaling: {resolved}" in hparams
        assert_identical(out)
        finals[setting, order] = torch.load(out / "rank0.pt")
    auto, none = finals["auto", "step_then_average"], finals["none", "step_then_average"]
    assert any(not torch.equal(auto[k], none[k]) for k in none)


@pytest.mark.timeout(300)
def test_resume_from_a_mid_run_checkpoint_continues_the_rounds(tmp_path):
    """The checkpoint carries the round counter (the schedule goes on where it stopped), never models. The
    resumed fit's synchronous finish (``final_sync=0.25`` of its 12 steps) is placed by the fit's steps from
    its first, not from the resume: rounds 9, 10 and 11 are global averages."""
    first = tmp_path / "first"
    run_fit(first, "wagma_sgd", "--straggle-ms", "10", "--steps", "12", "--save-at", "6", "--batchnorm")
    entry = torch.load(first / "mid.ckpt", weights_only=False)[CHECKPOINT_KEY]
    assert entry["strategy"] == "wagma_sgd" and entry["family"] == "models" and entry["world_size"] == 4
    assert all(s["step"] == 6 and s["pending"] == [] for s in entry["engines"][0])

    second = tmp_path / "second"
    records = run_fit(second, "wagma_sgd", "--straggle-ms", "10", "--steps", "12", "--rotation", "3",
                      "--batchnorm", "--resume", str(first / "mid.ckpt"), "--strategy-kw", '{"final_sync": 0.25}')
    schedule = ButterflySchedule(world_size=4, group_size=2, global_every=5)
    for rank, record in enumerate(records):
        assert [g["round_index"] for g in record["groups"]] == list(range(6, 12))
        for g in record["groups"]:
            r = g["round_index"]
            want = (0, 1, 2, 3) if r >= 9 else schedule.group_of(r, rank)  # the finish (and global_every=5's 9)
            assert tuple(g["members"]) == want, (rank, g)
    assert_identical(second)


@pytest.mark.timeout(300)
def test_resume_across_families_is_refused_unless_the_engine_state_is_dropped(tmp_path):
    """eager_sgd's checkpoint holds pending gradients; wagma_sgd cannot use them: the resume is refused before
    any batch, naming both strategies; after drop_engine_state (the explicit choice) it starts afresh."""
    from lightning_partial.strategies.checkpoint import drop_engine_state

    first = tmp_path / "first"
    run_fit(first, "eager_sgd", "--straggle-ms", "10", "--steps", "8", "--save-at", "4")
    assert torch.load(first / "mid.ckpt", weights_only=False)[CHECKPOINT_KEY]["family"] == "gradients"
    refused = tmp_path / "refused"
    proc = forkrun.run(
        fit_command(refused, "--strategy", "wagma_sgd", "--steps", "8", "--rotation", "2", "--resume",
                    str(first / "mid.ckpt"), launch="fork"),
        env=FIT_ENV, timeout=240,
    )
    assert proc.returncode != 0
    assert "CheckpointMismatchError" in proc.stderr and "written by strategy 'eager_sgd'" in proc.stderr, (
        proc.stderr[-3000:]
    )
    assert not (refused / "pids").exists()  # refused before on_train_start on every rank: no batch ran
    drop_engine_state(first / "mid.ckpt", first / "weights.ckpt")
    second = tmp_path / "second"
    proc = forkrun.run(
        fit_command(second, "--strategy", "wagma_sgd", "--steps", "8", "--rotation", "2", "--resume",
                    str(first / "weights.ckpt"), launch="fork"),
        env=FIT_ENV, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    record = json.loads((second / "callbacks0.json").read_text())
    # 4 more steps; the rounds numbered on from the resumed step, as with engine state (the finish and the
    # schedule count in them).
    assert [g["round_index"] for g in record["groups"]] == list(range(4, 8))
    assert_identical(second)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("resumed_from", ["ddp", "4 ranks"])
def test_a_resumed_fit_runs_its_synchronous_finish_as_the_last_rounds_it_runs(tmp_path, resumed_from):
    """``ds_sync`` resumed (a) from a DDP checkpoint at step 40 of 64, without engine state: its rounds go on from
    40 and the finish (``final_sync=0.05``: 4 of 64 rounds) is 60-63, where its first round was 0 and the finish
    was never reached; (b) on 2 ranks from a 4-rank checkpoint at the end of epoch 0 (2 epochs, 32 batches an
    epoch on 4 ranks, 64 on 2): the rounds go on from 32 for 64 more, and the finish is their last 7 (the 5% of
    the 128 a fit on 2 ranks runs), where it fell after the fit's end."""
    first, second = tmp_path / "first", tmp_path / "second"
    if resumed_from == "ddp":
        run_fit(first, "ddp", "--max-epochs", "2", "--save-at", "40")
        records = run_fit(second, "ds_sync", "--max-epochs", "2", "--rotation", "1000", "--resume",
                          str(first / "mid.ckpt"))
        want_rounds, want_finish = list(range(40, 64)), [60, 61, 62, 63]
    else:
        run_fit(first, "ds_sync", "--max-epochs", "2", "--save-epoch", "0")
        proc = forkrun.run(fit_command(second, "--strategy", "ds_sync", "--devices", "2", "--max-epochs", "2",
                                       "--rotation", "1000", "--resume", str(first / "mid.ckpt"), launch="fork"),
                           env=FIT_ENV, timeout=240)
        assert proc.returncode == 0, proc.stderr[-4000:]
        records = [json.loads((second / f"callbacks{r}.json").read_text()) for r in range(2)]
        want_rounds, want_finish = list(range(32, 96)), list(range(89, 96))
    for record in records:
        assert [g["round_index"] for g in record["groups"]] == want_rounds
        assert [g["round_index"] for g in record["groups"] if g["group_id"] == -1] == want_finish


def endless_fit(out, strategy: str, launch: str = "popen") -> forkrun.Forked | subprocess.Popen:
    """A 4-process fit of tests/scripts/fit.py that runs until a signal ends it (stderr piped)."""
    return forkrun.start(
        fit_command(out, "--strategy", strategy, "--steps", "100000", "--straggle-ms", "5", launch=launch),
        env=FIT_ENV,
    )


@pytest.mark.timeout(300)
def test_sigterm_to_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    out = tmp_path / "run"
    proc = endless_fit(out, "wagma_sgd", launch="fork")
    stderr = signal_rank_when_running(proc, out, 1, signal.SIGTERM)
    assert proc.returncode == 0, stderr[-3000:]
    assert_stopped_alike(out, "fork")  # the replicas differ between global averages: not compared


@pytest.mark.timeout(300)
def test_killed_rank_ends_the_fit_with_a_clear_error(tmp_path):
    """SIGKILL to rank 2 mid-fit, forked ranks (test_eager_sgd.py's version runs the script launcher's)."""
    out = tmp_path / "run"
    proc = endless_fit(out, "ds_sync", launch="fork")
    stderr = signal_rank_when_running(proc, out, 2, signal.SIGKILL)
    assert proc.returncode != 0
    assert ("[partial allreduce, rank" in stderr and "round" in stderr) or "terminated with code -9" in stderr, (
        stderr[-3000:]
    )


def test_group_rotation_installs_a_switching_schedule_before_the_engines_start():
    from types import SimpleNamespace

    from lightning_partial.collectives import SwitchingSchedule

    strategy = WAGMAStrategy()
    rotation = GroupRotation(switch_at={100: ShuffleSchedule(world_size=4, num_groups=2, seed=9)}, consensus_every=7)
    rotation.setup(SimpleNamespace(strategy=strategy, world_size=4), None, "fit")
    schedule = strategy.schedule
    assert isinstance(schedule, SwitchingSchedule) and schedule.starts == (0, 100)
    assert schedule.groups(1) == [(0, 2), (1, 3)]  # the strategy's butterfly until round 100
    assert schedule.groups(150) == ShuffleSchedule(world_size=4, num_groups=2, seed=9).groups(150)
    assert strategy.measure_every == 7
    with pytest.raises(ValueError, match="built for 8 ranks"):
        GroupRotation(schedule=ButterflySchedule(world_size=8, group_size=2)).setup(
            SimpleNamespace(strategy=WAGMAStrategy(), world_size=4), None, "fit"
        )
    with pytest.raises(ValueError, match="needs a model-averaging strategy"):
        GroupRotation(schedule=ButterflySchedule(world_size=4, group_size=2)).setup(
            SimpleNamespace(strategy=object(), world_size=4), None, "fit"
        )
