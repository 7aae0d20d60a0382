"""The CUDA path's safety rules, shown where a CPU can show them.

* Buffers are pooled: in a steady state an engine allocates no buffer set per
  round (``TensorLayout.allocations``), for gradients (``PartialAllreduce``,
  ``DelayedAllreduce``) and models (``GroupAverage``, whose received models,
  sums and consensus copies come from the pool too). The GPU's peak-memory
  bound is in ``tests/test_cuda.py``.
* The strategies' own collectives never touch the default group during fit
  (the invariant in ``lightning_partial/strategies/partial.py``): with a
  default group that is not plain gloo (``"cpu:gloo"``, standing for NCCL here)
  a fit that logs with ``sync_dist=True``, gathers and waits at a barrier every
  step issues no collective on the default group; with a gloo default group the
  same calls are seen on it (the spy works).
* ``SyncBatchNorm`` is refused unless rounds are fully synchronous.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from lightning_partial.collectives import PartialAllreduce, PartialAllreduceConfig
from lightning_partial.collectives.delayed import DelayedAllreduce, DelayedConfig
from lightning_partial.collectives.group_average import GroupAverage, apply_average
from lightning_partial.collectives.schedules import ShuffleSchedule
from lightning_partial.strategies import ABSSGDStrategy, DSSyncStrategy, EagerSGDStrategy, WAGMAStrategy
from tests.distributed import run_threads

pytestmark = pytest.mark.timeout(240)

ROUNDS = 40
WARM = 6
SCRIPT = "tests.scripts.fit"  # run as `python -m` from the repository root


def _config(**kw) -> PartialAllreduceConfig:
    return PartialAllreduceConfig(timeout=timedelta(seconds=30), setup_timeout=timedelta(seconds=120), **kw)


def _assert_steady(warm: int, final: int) -> None:
    """A handful of sets in all, none per round. Not tied to the count after the warm rounds: on a loaded host
    a rank falls behind later in the run, and each carried gradient then keeps one more set alive (4 after 1)."""
    assert final <= 8, f"{final} buffer sets allocated in {ROUNDS} rounds ({warm} after {WARM})"


def _like() -> list[torch.Tensor]:
    return [torch.zeros(300, 7), torch.zeros(11), torch.zeros(5, dtype=torch.float64)]


@pytest.mark.parametrize("mode", ["solo", "sync"])
def test_partial_allreduce_allocates_no_buffers_in_a_steady_state(mode: str) -> None:
    def fn(rank: int, store) -> tuple[int, int]:
        engine = PartialAllreduce(_config(mode=mode, normalize="sum"), store=store, rank=rank, world_size=2,
                                  like=_like()).start()
        try:
            for step in range(ROUNDS):
                if step == WARM:
                    warm = engine.layout.allocations
                grads = [torch.full_like(t, float(rank + step)) for t in _like()]
                engine.arrive(grads).release()
            engine.flush().release()
            return warm, engine.layout.allocations
        finally:
            engine.close()

    for warm, final in run_threads(2, fn):
        _assert_steady(warm, final)


def test_delayed_allreduce_allocates_no_buffers_in_a_steady_state() -> None:
    from tests.test_delayed import quiesce

    barrier, agree = threading.Barrier(2), {}

    def fn(rank: int, store) -> tuple[int, int]:
        engine = DelayedAllreduce(
            DelayedConfig(target_samples=4, timeout=timedelta(seconds=30), setup_timeout=timedelta(seconds=120)),
            store=store, rank=rank, world_size=2, like=_like(),
        ).start()
        warm = None
        try:
            for step in range(ROUNDS):
                for result in engine.deposit([torch.full_like(t, 1.0) for t in _like()], samples=2):
                    result.release()
                if step == 2 * WARM:
                    warm = engine.layout.allocations
            final = engine.layout.allocations
            # Agree on the last round and let it complete before closing (the strategy's quiesce): a rank that
            # closed its groups with the other still in a round's allreduce would fail it (seen under load).
            quiesce(engine, rank, barrier, agree)
            return warm, final
        finally:
            engine.close()

    for warm, final in run_threads(2, fn):
        assert warm is not None
        _assert_steady(warm, final)


def test_group_average_allocates_no_buffers_in_a_steady_state() -> None:
    """Received models, group sums and consensus copies come from the engine's pool."""
    schedule = ShuffleSchedule(world_size=4, num_groups=2, seed=3)

    def fn(rank: int, store) -> tuple[int, int]:
        w = [torch.full((257,), float(rank)), torch.full((3, 3), float(rank), dtype=torch.float64)]
        engine = GroupAverage(_config(mode="solo", normalize="sum", sync_every=5), schedule=schedule, store=store,
                              rank=rank, world_size=4, like=w, measure_every=3).start()
        try:
            for step in range(ROUNDS):
                if step == WARM:
                    warm = engine.layout.allocations
                for t in w:
                    t.add_(1.0)
                result = engine.arrive(w)
                apply_average(result, w)
                result.release()
            last = engine.flush(w)
            apply_average(last, w)
            return warm, engine.layout.allocations
        finally:
            engine.close()

    for warm, final in run_threads(4, fn):
        _assert_steady(warm, final)


# ------------------------------------------------------ the strategy's collectives
def _fit(tmp: Path, *extra: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", SCRIPT, "--out", str(tmp), "--launch", "fork", "--devices", "2", "--steps", "8", "--spy",
           "--sync-dist", *extra]
    proc = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads((tmp / "callbacks0.json").read_text())


def test_strategy_collectives_never_use_a_default_group_that_is_not_gloo(tmp_path: Path) -> None:
    """``"cpu:gloo"`` is not plain gloo: the strategy's collectives go to its own gloo group, as under NCCL."""
    record = _fit(tmp_path, "--strategy", "eager_sgd", "--strategy-kw", json.dumps({"process_group_backend": "cpu:gloo"}))
    assert record["collectives_at_train_end"] == 0, record["collective_names"]


def test_the_spy_sees_the_strategy_collectives_on_a_gloo_default_group(tmp_path: Path) -> None:
    """The control: with a gloo default group the collective group *is* the default group."""
    record = _fit(tmp_path, "--strategy", "eager_sgd")
    assert record["collectives_at_train_end"] > 0
    assert {"all_reduce", "barrier"} <= set(record["collective_names"]), record["collective_names"]


# ------------------------------------------------------------------ SyncBatchNorm
@pytest.mark.parametrize("make", [
    lambda: EagerSGDStrategy(), lambda: EagerSGDStrategy(mode="majority"), lambda: WAGMAStrategy(),
    lambda: DSSyncStrategy(), lambda: ABSSGDStrategy(),
], ids=["eager_sgd", "eager_sgd_majority", "wagma_sgd", "ds_sync", "abs_sgd"])
def test_sync_batchnorm_is_refused_unless_rounds_are_synchronous(make) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.SyncBatchNorm(4))
    with pytest.raises(ValueError, match="SyncBatchNorm"):
        make()._refuse_sync_batchnorm(model)
    make()._refuse_sync_batchnorm(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)))


def test_sync_batchnorm_is_allowed_in_fully_synchronous_mode() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.SyncBatchNorm(4))
    EagerSGDStrategy(mode="sync")._refuse_sync_batchnorm(model)



def test_sync_batchnorm_is_reverted_after_a_synchronous_fit(tmp_path) -> None:
    """``Trainer(sync_batchnorm=True)`` under ``mode="sync"``: the module leaves the fit with its BatchNorm layers,
    as under DDP, so that the same module can be fitted again under a partial mode (which refuses SyncBatchNorm)."""
    import lightning as L

    from tests.test_bad_input import tiny_fit

    class Normed(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    module = Normed()
    converted: list[type] = []

    class Layer(L.Callback):
        def on_train_start(self, trainer, pl_module):
            converted.append(type(pl_module.net[1]))

    # SyncBatchNorm runs on GPUs only: the fit stops at its first forward, after set-up converted the layer.
    with pytest.raises(ValueError, match="SyncBatchNorm expected input tensor to be on GPU"):
        tiny_fit(tmp_path / "sync", EagerSGDStrategy(mode="sync"), seen=[], module=module, sync_batchnorm=True,
                 callbacks=(Layer(),))
    assert converted == [torch.nn.SyncBatchNorm]
    # What DDP's teardown leaves too (Lightning's revert: a plain batch norm of the same statistics).
    assert not isinstance(module.net[1], torch.nn.SyncBatchNorm)
    assert isinstance(module.net[1], torch.nn.modules.batchnorm._BatchNorm)
    tiny_fit(tmp_path / "solo", EagerSGDStrategy(), seen=[], module=module)  # refused if it kept SyncBatchNorm
