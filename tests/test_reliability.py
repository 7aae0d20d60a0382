"""Reliability: nothing left behind across fits, bounded bookkeeping, schedules every rank can keep.

* Two fits in one process: the engines' store server closes at the end of each
  fit and no engine thread survives it (``tests/scripts/two_fits.py``); a stop
  ends its own fit only (``tests/scripts/refit_after_stop.py``).
* Callbacks that record per round keep a bounded history.
* ``abs_sgd`` refuses validation every N batches (each rank runs its own number).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from lightning_partial.callbacks import AdaptiveBatchSize, GroupRotation, LoadImbalance

pytestmark = pytest.mark.timeout(240)


# ------------------------------------------------------------------- no leaks
@pytest.mark.parametrize("strategy", ["eager_sgd", "ds_sync", "abs_sgd"])
def test_two_fits_in_one_process_leave_no_store_or_thread_behind(strategy: str) -> None:
    """The engines' store server closes at the end of fit and no engine thread survives it,
    although the trainers stay referenced."""
    proc = subprocess.run([sys.executable, "-m", "tests.scripts.two_fits", "--strategy", strategy, "--devices", "2"],
                          env={**os.environ, "PYTHONWARNINGS": "ignore"}, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    records = [json.loads(line[len("RECORD "):]) for line in proc.stdout.splitlines() if line.startswith("RECORD ")]
    rank0 = [r for r in records if r["rank"] == 0]
    assert [r["fit"] for r in rank0] == [0, 1], proc.stdout[-3000:]
    for r in rank0:
        assert r["port"], f"fit {r['fit']}: no store seen"
        assert r["store_open"] is False, f"fit {r['fit']}: the store on port {r['port']} still accepts connections"
        assert r["threads"] == [], f"fit {r['fit']}: threads left behind: {r['threads']}"
    assert rank0[0]["port"] != rank0[1]["port"]


@pytest.mark.parametrize("strategy", ["eager_sgd", "ds_sync"])
def test_a_stop_ends_its_own_fit_only(strategy: str) -> None:
    """SIGTERM stops every rank of a fit at the same step; a second fit of the same Trainer then trains (as
    Lightning resets its own flag every run), where the strategy's stop flag, never reset, stopped it at its
    first batch (``tests/scripts/refit_after_stop.py``)."""
    proc = subprocess.run([sys.executable, "-m", "tests.scripts.refit_after_stop", "--strategy", strategy],
                          env={**os.environ, "PYTHONWARNINGS": "ignore"}, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    records = [json.loads(line[len("RECORD "):]) for line in proc.stdout.splitlines() if line.startswith("RECORD ")]
    assert sorted(r["rank"] for r in records) == [0, 1], proc.stdout[-3000:]
    assert len({r["first"] for r in records}) == 1 and records[0]["first"] is not None, records
    assert all(r["second"] == 32 for r in records), records  # its one more epoch: 256 samples, 2 ranks of 8


@pytest.mark.parametrize("strategy", ["eager_sgd", "abs_sgd"])
def test_a_fit_without_training_batches_from_a_mid_fit_checkpoint_ends_nothing(strategy: str, tmp_path) -> None:
    """``limit_train_batches=0`` skips Lightning's loop with training not done: the strategy ends no fit at teardown
    (it ends one whose training was done: saved at its last step; this one was saved at the end of the first of
    two epochs), so the fit returns with the weights it loaded, where abs_sgd raised (no train dataloader
    prepared) and eager_sgd flushed a mid-fit checkpoint's carried work."""
    proc = subprocess.run([sys.executable, "-m", "tests.scripts.skipped_loop", "--strategy", strategy,
                           "--out", str(tmp_path)],
                          env={**os.environ, "PYTHONWARNINGS": "ignore"}, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    records = [json.loads(line[len("RECORD "):]) for line in proc.stdout.splitlines() if line.startswith("RECORD ")]
    assert sorted(r["rank"] for r in records) == [0, 1] and all(r["as_loaded"] for r in records), records


# ------------------------------------------------------- abs_sgd: batch-count validation
@pytest.mark.parametrize("interval", [10, 1, 0.5, 0.25])
def test_abs_sgd_refuses_validation_every_n_batches(interval) -> None:
    from types import SimpleNamespace

    from lightning_partial.strategies.abs_sgd import check_validation_schedule

    with pytest.raises(ValueError, match="val_check_interval"):
        check_validation_schedule(SimpleNamespace(val_check_interval=interval))


def test_abs_sgd_accepts_validation_at_epoch_ends() -> None:
    from types import SimpleNamespace

    from lightning_partial.strategies.abs_sgd import check_validation_schedule

    check_validation_schedule(SimpleNamespace(val_check_interval=1.0))



# --------------------------------------------------------------- bounded histories
@pytest.mark.parametrize("make", [
    lambda n: GroupRotation(history=n), lambda n: AdaptiveBatchSize(history=n), lambda n: LoadImbalance(history=n),
], ids=["GroupRotation", "AdaptiveBatchSize", "LoadImbalance"])
def test_callback_histories_are_bounded(make) -> None:
    callback = make(3)
    kept = callback.records if isinstance(callback, LoadImbalance) else callback.history
    for i in range(10):
        kept.append(i)
    assert list(kept) == [7, 8, 9]
    with pytest.raises(ValueError, match="history"):
        make(-1)
