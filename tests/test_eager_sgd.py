"""EagerSGDStrategy: registry, and real 4-process fits launched by Lightning."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lightning_partial
from lightning_partial import EagerSGDStrategy
from tests import forkrun

SCRIPT = "tests.scripts.fit"  # run as `python -m` from the repository root


def test_registry_names_resolve_to_the_right_mode_and_launcher():
    from lightning.pytorch.strategies import StrategyRegistry

    lightning_partial.register_strategies()  # idempotent: a second registration is harmless
    expected = {
        "eager_sgd": ("solo", "popen"),
        "eager_sgd_spawn": ("solo", "spawn"),
        "eager_sgd_fork": ("solo", "fork"),
        "eager_sgd_majority": ("majority", "popen"),
        "eager_sgd_majority_spawn": ("majority", "spawn"),
        "eager_sgd_majority_fork": ("majority", "fork"),
        "eager_sgd_backup": ("quorum", "popen"),
        "eager_sgd_backup_spawn": ("quorum", "spawn"),
        "eager_sgd_backup_fork": ("quorum", "fork"),
    }
    for name, (mode, start_method) in expected.items():
        strategy = StrategyRegistry.get(name)
        assert isinstance(strategy, EagerSGDStrategy)
        assert strategy.partial_config.mode == mode and strategy._start_method == start_method
        if mode == "quorum":  # one backup worker: P - 1 arrivals activate a round, whatever P
            assert strategy.partial_config.backup_workers == 1 and strategy.partial_config.quorum is None
            assert [strategy.partial_config.activation_count(p, sync_round=False) for p in (2, 4, 8)] == [1, 3, 7]
        pickle.loads(pickle.dumps(strategy))  # no threads or groups before setup


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(mode="fastest"), "unknown mode"),
        (dict(mode="quorum"), "needs either quorum=k"),
        (dict(mode="quorum", quorum=3, backup_workers=1), "needs either quorum=k"),
        (dict(mode="quorum", backup_workers=0), "backup_workers must be an integer >= 1"),
        (dict(mode="solo", backup_workers=1), "backup_workers=1 is only meaningful with mode='quorum'"),
        (dict(max_staleness=-2), "max_staleness"),
        (dict(start_method="forkserver"), "start_method"),
        (dict(staleness_rule="gap"), "unknown staleness_rule 'gap'"),
        (dict(find_unused_parameters="yes"), "find_unused_parameters must be a bool"),
    ],
)
def test_bad_configuration_fails_at_construction(kw, match):
    with pytest.raises(ValueError, match=match):
        EagerSGDStrategy(**kw)


FIT_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def fit_command(out: Path, *extra: str, launch: str = "popen") -> list[str]:
    """tests/scripts/fit.py's command; ``launch``: its ``--launch`` (``"fork"``: the ranks skip the imports;
    ``"popen"``: the script launcher, what torchrun and SLURM users run, e.g. for a killed rank)."""
    return [sys.executable, "-m", SCRIPT, "--out", str(out), "--launch", launch, *extra]


def fit(tmp_path: Path, strategy: str, *extra: str, launch: str = "fork") -> list[dict[str, torch.Tensor]]:
    """A 4-process fit (``launch``: see :func:`fit_command`); the ranks' final states."""
    out = tmp_path / strategy.replace(":", "_")
    proc = forkrun.run(fit_command(out, "--strategy", strategy, *extra, launch=launch), env=FIT_ENV, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [torch.load(out / f"rank{r}.pt") for r in range(4)]


def assert_identical(out: Path) -> dict[str, torch.Tensor]:
    """Asserts that the 4 ranks' final states under ``out`` are bit-identical; returns rank 0's."""
    states = [torch.load(out / f"rank{r}.pt") for r in range(4)]
    for other in states[1:]:
        for key, value in states[0].items():
            assert torch.equal(value, other[key]), key
    return states[0]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["eager_sgd", "eager_sgd_majority", "eager_sgd_backup"])
def test_replicas_end_bit_identical_under_injected_imbalance(tmp_path, strategy):
    states = fit(tmp_path, strategy, "--straggle-ms", "20", "--steps", "30")
    for other in states[1:]:
        for key, value in states[0].items():
            assert torch.equal(value, other[key]), key


@pytest.mark.timeout(300)
def test_sync_mode_reaches_the_same_weights_as_ddp(tmp_path):
    ours = fit(tmp_path, "eager_sgd:sync", "--steps", "20")[0]
    ddp = fit(tmp_path, "ddp", "--steps", "20")[0]
    for key, value in ddp.items():
        torch.testing.assert_close(ours[key], value, rtol=0, atol=1e-6)


def start_fit(out: Path, *extra: str, launch: str = "popen") -> forkrun.Forked | subprocess.Popen:
    """A long fit (one 5 ms straggler per step) that a test then signals (``launch``: see :func:`fit_command`)."""
    return forkrun.start(fit_command(out, "--steps", "100000", "--straggle-ms", "5", *extra, launch=launch),
                         env=FIT_ENV)


def signal_rank_when_running(proc: forkrun.Forked | subprocess.Popen, out: Path, rank: int, signum: int) -> str:
    """Waits for the 4 ranks' pid files, lets some steps run, signals ``rank``; returns stderr."""
    import time

    try:
        deadline = time.monotonic() + 120
        while len(list((out / "pids").glob("*.pid"))) < 4:
            assert time.monotonic() < deadline and proc.poll() is None, "the fit did not start"
            time.sleep(0.2)  # polling for the ranks' pid files (not a timing assert)
        time.sleep(2)  # let a few steps run (not a timing assert)
        os.kill(int((out / "pids" / f"rank{rank}.pid").read_text()), signum)
        return proc.communicate(timeout=120)[1]  # a hang fails here
    finally:
        if proc.poll() is None:
            proc.kill()


def assert_stopped_alike(out: Path, launch: str) -> None:
    """Every rank stopped by SIGTERM at the same step; under ``fork`` the launching process's ``fit``
    returned with ``trainer.interrupted`` (the script launcher's rank 0 is a rank: its ``fit`` raised)."""
    steps = {r: int((out / f"stopped{r}").read_text()) for r in range(4)}
    assert len(set(steps.values())) == 1, steps
    if launch == "fork":
        assert json.loads((out / "parent.json").read_text()) == {"interrupted": True}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("victim, launch", [(2, "popen"), (0, "popen"), (0, "fork")])
def test_sigterm_to_one_rank_stops_every_rank_at_the_same_step(tmp_path, victim, launch):
    """SIGTERM to one rank mid-fit: every rank raises SIGTERMException at the same step, replicas equal. Under the
    script launcher and under the multiprocessing launcher (where Lightning's own would wait forever for
    rank 0's results: ``_compat.StopAwareMultiProcessingLauncher``)."""
    import signal

    out = tmp_path / "run"
    proc = start_fit(out, launch=launch)
    stderr = signal_rank_when_running(proc, out, victim, signal.SIGTERM)
    assert proc.returncode == 0, stderr[-3000:]
    assert_stopped_alike(out, launch)
    assert_identical(out)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["eager_sgd", "abs_sgd"])
def test_sigterm_stops_every_rank_at_the_same_step_without_lightnings_broadcast(tmp_path, strategy):
    """Lightning before 2.6 has no per-batch SIGTERM broadcast for the strategy to replace (its own check comes
    at each rank's batch end: the ranks would stop at different steps, and a stopped engine failed the others'
    next step). The strategy then checks for the agreed stop at its batch start: every rank stops at the same
    step. Checked on Lightning 2.4.0 and 2.5.0 by hand; here by making the replacement find nothing."""
    out = tmp_path / "run"
    command = fit_command(out, "--strategy", strategy, "--steps", "200", "--sigterm-at", "7:1",
                          "--no-broadcast-replacement", launch="fork")
    proc = forkrun.run(command, env=FIT_ENV, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    stopped = {(out / f"stopped{r}").read_text() for r in range(4)}
    assert len(stopped) == 1, stopped


@pytest.mark.timeout(300)
def test_sigterm_with_overlap_stops_every_rank_at_the_same_step(tmp_path):
    """overlap=True: every rank has submitted the round after the stop round when it learns of the stop; that
    round never runs, and every rank still stops at the same step with identical replicas."""
    import signal

    out = tmp_path / "run"
    proc = start_fit(out, "--strategy-kw", '{"overlap": true}', launch="fork")
    stderr = signal_rank_when_running(proc, out, 1, signal.SIGTERM)
    assert proc.returncode == 0, stderr[-3000:]
    assert_stopped_alike(out, "fork")
    assert_identical(out)


@pytest.mark.timeout(300)
def test_sigterm_with_overlap_and_a_save_every_step_stops_every_rank_at_the_same_step(tmp_path):
    """overlap=True with a checkpoint every step: a save takes the round in flight (InFlight.settle), the stop
    round among them, and that engine stops there. The next step applies it without submitting another round
    (which raised EngineClosedError on every rank) and every rank stops at the same step, replicas identical."""
    out = tmp_path / "run"
    proc = forkrun.run(fit_command(out, "--steps", "12", "--sigterm-at", "5:1", "--checkpoint-every", "1",
                                   "--strategy-kw", '{"overlap": true}', launch="fork"), env=FIT_ENV, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert_stopped_alike(out, "fork")
    assert_identical(out)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy, kw", [("eager_sgd", {"overlap": False}), ("eager_sgd", {"overlap": True}),
                                          ("ds_sync", {"max_staleness": 1}), ("wagma_sgd", {"global_every": 10})],
                         ids=["rounds", "overlap", "ds_sync", "wagma_sgd"])
def test_sigterm_in_the_last_step_ends_the_fit_with_identical_replicas(tmp_path, strategy, kw):
    """A stop request carried by the last step's round: no batch is left to raise SIGTERMException at, so
    the fit ends normally, without a final round (the engines ended at the stop round). With
    ``overlap=True`` the stop round is collected only then, and applied. The BatchNorm statistics are
    averaged, as at every end of fit, and so are model averaging's parameters (its final global average,
    over the collective group): every rank ends with the same parameters and buffers."""
    states = fit(tmp_path, strategy, "--steps", "12", "--sigterm-at", "11:1", "--straggle-ms", "5",
                 "--batchnorm", "--strategy-kw", json.dumps(kw))
    assert not list((tmp_path / strategy).glob("stopped*")), "the fit raised SIGTERMException"
    assert json.loads((tmp_path / strategy / "parent.json").read_text()) == {"interrupted": False}
    for other in states[1:]:
        for key, value in states[0].items():
            assert torch.equal(value, other[key]), key


@pytest.mark.timeout(300)
def test_killed_rank_ends_the_fit_with_a_clear_error(tmp_path):
    """SIGKILL to rank 2 mid-fit: the job ends (no hang) and says why."""
    import signal

    out = tmp_path / "run"
    proc = start_fit(out)
    stderr = signal_rank_when_running(proc, out, 2, signal.SIGKILL)
    assert proc.returncode != 0
    # Whichever comes first: a survivor's engine error naming its rank and round,
    # or Lightning's launcher reporting the dead child and ending the others.
    assert ("[partial allreduce, rank" in stderr and "round" in stderr) or "terminated with code -9" in stderr, (
        stderr[-3000:]
    )


@pytest.mark.timeout(300)
def test_sys_exit_in_a_forked_rank_ends_the_fit_with_a_clear_error(tmp_path):
    """A rank whose code calls ``sys.exit(0)`` mid-fit under the multiprocessing launcher: the launching process
    raises, naming the rank, instead of waiting forever for rank 0's results (Lightning's own launcher does);
    the other ranks end too (no hang)."""
    out = tmp_path / "run"
    # collective_timeout: the survivors, waiting for rank 2 in a round, end at the liveness bound rather than
    # after the 30 s torch gives them between its SIGTERM and its SIGKILL.
    command = fit_command(out, "--steps", "100000", "--exit-at", "3:2", "--strategy-kw", '{"collective_timeout": 3}',
                          launch="fork")
    proc = forkrun.run(command, env=FIT_ENV, timeout=240)
    assert proc.returncode != 0
    assert "rank 2 (local process 2) raised SystemExit(0) inside the fit" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.timeout(300)
def test_backbone_unfrozen_mid_fit_ends_the_fit_naming_the_parameters(tmp_path):
    """A ``BaseFinetuning`` callback unfreezes the first layer at the second epoch (a param group added to the
    optimizer): those parameters are in no engine and would train on each rank alone (what plain DDP does,
    Lightning issue 20340). The fit ends at that step with an error naming them, instead of ending with
    replicas that silently differ."""
    out = tmp_path / "run"
    command = fit_command(out, "--devices", "2", "--max-epochs", "2", "--unfreeze-at", "1", launch="fork")
    proc = forkrun.run(command, env=FIT_ENV, timeout=240)
    assert proc.returncode != 0
    assert ("RuntimeError: eager_sgd: the trainable parameters of optimizer 0 changed after the fit started "
            "(step 64): 2 became trainable ('net.0.weight', 'net.0.bias')") in proc.stderr, proc.stderr[-3000:]


def fit_identical(out: Path, *options: str, launch: str = "fork") -> list[dict]:
    """A 4-process fit of tests/scripts/fit.py; asserts it succeeded with bit-identical replicas; the rank records."""
    import json

    proc = forkrun.run(fit_command(out, *options, launch=launch), env=FIT_ENV, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert_identical(out)
    return [json.loads((out / f"callbacks{r}.json").read_text()) for r in range(4)]


@pytest.mark.timeout(300)
def test_staleness_rule_under_momentum_keeps_replicas_identical_and_counts_what_it_withholds(tmp_path):
    """SGD momentum 0.9, unbounded staleness, one straggler per step: the default rule ("auto") resolves to
    "inverse", late gradients are weighted (their withheld share counted in the tracker's summary, the same
    on every rank) and the replicas end bit-identical. With ``final_sync=0.2`` the last 6 of the 30 rounds
    are synchronous (and the flush, which finds nothing left)."""
    records = fit_identical(tmp_path / "run", "--strategy", "eager_sgd", "--strategy-kw",
                            '{"max_staleness": null, "final_sync": 0.2}',
                            "--momentum", "0.9", "--straggle-ms", "25", "--steps", "30", "--track")
    assert all(r["staleness_weights"] == {"rule": "inverse", "momentum": 0.0, "dampening": 0.0} for r in records)
    summaries = [r["staleness"]["0"] for r in records]
    assert summaries[0]["staleness_max"] > 0, "no gradient was late: the test proves nothing"
    assert summaries[0]["discounted_total"] > 0
    assert len({s["discounted_total"] for s in summaries}) == 1
    assert [s["synchronous"] for s in summaries] == [7] * 4, summaries


def test_a_momentum_rule_without_momentum_fails_at_setup(tmp_path):
    from tests.test_abs_sgd import _tiny_fit

    with pytest.raises(ValueError, match="staleness_rule='momentum' needs an optimizer with momentum"):
        _tiny_fit(EagerSGDStrategy(staleness_rule="momentum"), tmp_path)


@pytest.mark.timeout(300)
def test_globally_unused_parameters_stay_untouched_as_under_ddp(tmp_path):
    """find_unused_parameters=True, SGD momentum 0.9 and weight decay: a layer no rank uses keeps its initial
    weights (its grad stays None, so neither decay nor momentum moves it), a layer only rank 0 uses on some
    batches is trained, and the replicas end bit-identical; the same holds for DDP. eager_sgd's final flush
    step runs the on_before_optimizer_step hooks (and gradient clipping) like every other step."""
    for strategy in ("eager_sgd", "eager_sgd_overlap", "ddp_find_unused_parameters_true"):
        kw = {"eager_sgd": ["--strategy-kw", '{"find_unused_parameters": true}'],
              "eager_sgd_overlap": ["--strategy-kw", '{"find_unused_parameters": true, "overlap": true}']}.get(
                  strategy, [])
        strategy, tag = strategy.removesuffix("_overlap"), strategy
        records = fit_identical(tmp_path / tag, "--strategy", strategy, *kw, "--unused", "--momentum", "0.9",
                                "--weight-decay", "0.01", "--straggle-ms", "30", "--steps", "12", "--clip", "0.5")
        changed = records[0]["changed"]
        assert not any(k.startswith("unused.") for k in changed), (strategy, changed)
        assert {"rank0_only.weight", "rank0_only.bias", "net.0.weight"} <= set(changed), (strategy, changed)
        if tag == "eager_sgd":
            # The final flush's step went through on_before_optimizer_step (and so clipping, --clip) too.
            last = records[0]["last_round"]
            assert last["flush"] and last["round"] == 12
            flush_steps = 1 if last["contributions"] else 0
            assert all(r["before_optimizer_steps"] == 12 + flush_steps for r in records), records[0]
        elif tag == "eager_sgd_overlap":
            # 12 loop steps (the first applies nothing), the last round's own step, then the flush's.
            last = records[0]["last_round"]
            assert last["flush"] and last["round"] == 12
            flush_steps = 1 if last["contributions"] else 0
            assert all(r["before_optimizer_steps"] == 13 + flush_steps for r in records), records[0]


@pytest.mark.timeout(300)
def test_a_layer_one_late_rank_used_is_left_alone_alike_on_every_rank(tmp_path):
    """find_unused_parameters=True, one straggler per step: when rank 0 used a layer but its gradient missed the
    round, the others (who never use it) see no use of it in the round and leave it alone; rank 0 must do the
    same (it may not take its own complete gradient for the round's), or the replicas split."""
    fit_identical(tmp_path / "run", "--strategy", "eager_sgd", "--strategy-kw", '{"find_unused_parameters": true}',
                  "--rank0-only", "--momentum", "0.9", "--weight-decay", "0.01", "--straggle-ms", "30", "--steps", "24",
                  "--track")
