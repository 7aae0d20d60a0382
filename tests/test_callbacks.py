"""LoadImbalance, StalenessTracker and wandb_logger: validation, in-process fits, one real 4-process fit.

The 4-process fit runs ``tests/scripts/fit.py`` through Lightning's launcher
under ``eager_sgd`` with both kinds of imbalance, the tracker, a CSV logger and
the offline W&B logger, and a spy counting default-group collectives.
Everything asserted is a property of what was recorded, never a duration.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import logging
import os
import struct
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Iterator, Optional

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch.utils.data import DataLoader, TensorDataset

from lightning_partial.callbacks import GroupRotation, LoadImbalance, StalenessTracker, draw_stragglers
from lightning_partial.collectives import RoundStats
from lightning_partial.loggers import INSTALL_HINT, wandb_logger

SCRIPT = "tests.scripts.fit"  # run as `python -m` from the repository root
ROOT = Path(__file__).resolve().parents[1]
METRICS = ("fresh", "staleness_mean", "staleness_max", "wait_ms", "activator", "contributions", "discounted", "round")

pytestmark = pytest.mark.timeout(240)


# ------------------------------------------------------------------ validation
@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(delay_ms=-1.0), "delay_ms must be >= 0"),
        (dict(delay_ms=float("nan")), "delay_ms must be a finite"),
        (dict(delay_ms="10"), "delay_ms must be a finite"),
        (dict(delay_ms=5.0, stragglers=0), "stragglers must be >= 1 when delay_ms > 0"),
        (dict(stragglers=-1), "stragglers must be an integer >= 0"),
        (dict(stragglers=1.5), "stragglers must be an integer >= 0"),
        (dict(speed=[1.0, 0.0]), r"speed\[1\] must be in \(0, 1\]"),
        (dict(speed=[1.5]), r"speed\[0\] must be in \(0, 1\]"),
        (dict(speed=[]), "speed must be a non-empty sequence"),
        (dict(speed="1,0.5"), "speed must be a non-empty sequence"),
        (dict(speed=3), "speed must be a non-empty sequence"),
        (dict(seed="x"), "seed must be an int"),
        (dict(history=-1), "history must be"),
        (dict(log="no"), "log must be a bool"),
    ],
)
def test_load_imbalance_rejects_bad_options_at_construction(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=f"LoadImbalance: {match}"):
        LoadImbalance(**kw)


def test_tracker_and_wandb_logger_reject_bad_options() -> None:
    with pytest.raises(ValueError, match="StalenessTracker: log must be a bool"):
        StalenessTracker(log="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="GroupRotation: log must be a bool"):
        GroupRotation(log="yes")  # type: ignore[arg-type]
    from lightning_partial.callbacks import AdaptiveBatchSize

    with pytest.raises(ValueError, match="AdaptiveBatchSize: log must be a bool"):
        AdaptiveBatchSize(log=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="wandb_logger: project"):
        wandb_logger(project="")
    with pytest.raises(ValueError, match="wandb_logger: offline"):
        wandb_logger(offline="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="stragglers must be in 1..world_size"):
        draw_stragglers(0, 0, 4, 5)


# ------------------------------------------------------------- straggler draw
def test_stragglers_for_is_a_pure_function_of_seed_and_counter() -> None:
    a = LoadImbalance(delay_ms=10, stragglers=2, seed=3)
    b = LoadImbalance(delay_ms=10, stragglers=2, seed=3)
    counters = list(range(400))
    draws = [a.stragglers_for(c, 8) for c in counters]
    # Another instance, asked in another order (as after a resume): the same answers.
    assert [b.stragglers_for(c, 8) for c in reversed(counters)] == draws[::-1]
    for draw in draws:
        assert len(draw) == 2 and len(set(draw)) == 2 and all(0 <= r < 8 for r in draw)
    assert set().union(*draws) == set(range(8))  # every rank straggles sometimes
    assert len({tuple(d) for d in draws}) > 1  # the draw changes with the counter
    assert [LoadImbalance(delay_ms=10, stragglers=2, seed=4).stragglers_for(c, 8) for c in counters] != draws
    assert LoadImbalance(delay_ms=0).stragglers_for(5, 4) == []  # no stragglers without a delay


def test_the_draw_is_pinned_across_processes_and_runs() -> None:
    """Golden values: ``random.Random(str)`` hashes the string with SHA-512 (not ``hash()``, which
    PYTHONHASHSEED changes), so every process and run draws these (published figures stay reproducible)."""
    assert [draw_stragglers(1, c, 16, 3) for c in range(5)] == [
        [4, 5, 13],
        [4, 12, 14],
        [2, 3, 5],
        [3, 5, 12],
        [4, 6, 11],
    ]
    assert [draw_stragglers(0, c, 4, 1) for c in range(8)] == [[0], [1], [3], [2], [2], [2], [2], [3]]


# ---------------------------------------------------------- in-process fits
class Tiny(L.LightningModule):
    """A 1-process model; with ``manual``: two optimizers, the second stepped on even batches only."""

    def __init__(self, manual: bool = False) -> None:
        super().__init__()
        self.automatic_optimization = not manual
        self.a = torch.nn.Linear(4, 1)
        self.b = torch.nn.Linear(4, 1)
        self.batches = 0

    def training_step(self, batch: Any, batch_idx: int) -> Optional[torch.Tensor]:
        self.batches += 1
        x, y = batch
        if self.automatic_optimization:
            return torch.nn.functional.mse_loss(self.a(x) + self.b(x), y)
        opt_a, opt_b = self.optimizers()
        opt_a.zero_grad()
        self.manual_backward(torch.nn.functional.mse_loss(self.a(x), y))
        opt_a.step()
        if batch_idx % 2 == 0:
            opt_b.zero_grad()
            self.manual_backward(torch.nn.functional.mse_loss(self.b(x), y))
            opt_b.step()
        return None

    def configure_optimizers(self) -> Any:
        if self.automatic_optimization:
            return torch.optim.SGD(self.parameters(), lr=0.01)
        return torch.optim.SGD(self.a.parameters(), lr=0.01), torch.optim.SGD(self.b.parameters(), lr=0.01)


class SyntheticRounds(SingleDeviceStrategy):
    """A 1-process strategy exposing ``round_stats`` like EagerSGDStrategy: one new round per optimizer step."""

    def __init__(self) -> None:
        super().__init__(device=torch.device("cpu"))
        self.round_stats: dict[int, RoundStats] = {}

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        inner = getattr(optimizer, "_optimizer", optimizer)
        index = next(i for i, o in enumerate(self.optimizers) if o is inner)
        previous = self.round_stats.get(index)
        r = 0 if previous is None else previous.round_index + 1
        self.round_stats[index] = RoundStats(
            round_index=r,
            activator=0,
            initiator=None,
            synchronous=False,
            flush=False,
            fresh=(0,),
            counts=(1,),
            staleness=(r % 3,),
            oldest_staleness=(r % 3,),
            progress=(r + 1,),
            dropped=(0,),
            contributions=1,
            divisor=1.0,
            wait_time=0.002,
        )
        return super().optimizer_step(optimizer, closure, model, **kwargs)


class SyntheticGroupRounds(SyntheticRounds):
    """SyntheticRounds whose rounds are group rounds; a consensus distance on every fifth."""

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        for index, stats in self.round_stats.items():
            r = stats.round_index
            self.round_stats[index] = dataclasses.replace(
                stats, group=(0,), group_id=r % 3, consensus=float(r) if r % 5 == 0 else None)
        return out


def tiny_fit(
    tmp_path: Path,
    callbacks: list[L.Callback],
    *,
    steps: int,
    manual: bool = False,
    accumulate: int = 1,
    strategy: Any = "auto",
    csv_logger: bool = False,
    ckpt: Optional[Path] = None,
    log_every: int = 1,
) -> tuple[L.Trainer, Tiny]:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(256, 4, generator=g), torch.randn(256, 1, generator=g))
    model = Tiny(manual=manual)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        callbacks=callbacks,
        logger=CSVLogger(tmp_path, name="csv", version=0) if csv_logger else False,
        log_every_n_steps=log_every,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(data, batch_size=8), ckpt_path=ckpt)
    return trainer, model


@pytest.mark.parametrize(
    "callback, match",
    [
        (LoadImbalance(speed=[1.0, 0.5]), r"speed needs one factor per rank: got 2 for a world size of 1"),
        (LoadImbalance(delay_ms=1.0, stragglers=2), r"stragglers \(2\) must be <= the world size \(1\)"),
    ],
)
def test_options_that_need_the_world_size_fail_at_setup(tmp_path: Path, callback: LoadImbalance, match: str) -> None:
    model_batches: list[int] = []

    class Count(L.Callback):
        def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, i: int) -> None:
            model_batches.append(i)

    with pytest.raises(ValueError, match=match):
        tiny_fit(tmp_path, [Count(), callback], steps=3)
    assert model_batches == []  # before any batch ran


def test_load_imbalance_records_delay_and_slowdown_and_logs_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    slow = LoadImbalance(delay_ms=1.0, stragglers=1, speed=[0.5], seed=5)
    tiny_fit(tmp_path, [slow], steps=6, accumulate=2, csv_logger=True)
    records = list(slow.records)
    assert [r.counter for r in records] == list(range(12))  # one per batch, accumulated ones included
    assert all(r.stragglers == (0,) and r.delay_ms == 1.0 for r in records)  # P=1: rank 0 is always drawn
    assert all(r.slowdown_ms > 0 for r in records)  # on_after_backward fired on every accumulated batch
    assert slow.batches == 12 and slow.last_delay_ms == records[-1].total_ms
    assert slow.injected_ms == pytest.approx(sum(r.total_ms for r in records))
    rows = list(csv.DictReader((tmp_path / "csv" / "version_0" / "metrics.csv").open()))
    logged = [float(r["imbalance/delay_ms"]) for r in rows if r.get("imbalance/delay_ms")]
    assert logged and all(v > 1.0 for v in logged)

    every3 = LoadImbalance(delay_ms=1.0, stragglers=1, seed=5)
    calls = _count_logs(monkeypatch, "imbalance/")
    tiny_fit(tmp_path / "every3", [every3], steps=9, csv_logger=True, log_every=3)
    assert calls == [2, 5, 8]  # log() at the written batches only
    logged_at = {int(step): float(m["imbalance/delay_ms"])
                 for step, m in _by_step(_csv_rows(tmp_path / "every3"), "imbalance/").items()}
    # Written at batches 2, 5, 8 (log_every_n_steps=3): each the value of its own batch.
    assert logged_at == {b: list(every3.records)[b].total_ms for b in (2, 5, 8)}

    full = LoadImbalance(speed=[1.0], log=False)
    tiny_fit(tmp_path / "full", [full], steps=3)
    assert [r.total_ms for r in full.records] == [0.0, 0.0, 0.0]  # full speed, no stragglers: nothing injected


class SkipsOddBatches(Tiny):
    """Returns ``None`` on odd batches: no backward there, as a batch whose compute a strategy skipped."""

    def training_step(self, batch: Any, batch_idx: int) -> Optional[torch.Tensor]:
        loss = super().training_step(batch, batch_idx)
        return None if batch_idx % 2 else loss


def test_straggle_at_backward_sleeps_once_per_computed_batch(tmp_path: Path, monkeypatch) -> None:
    """straggle_at="backward": the drawn rank sleeps at the batch's first backward, once (two backwards under
    manual optimization), and not at all on a batch without a backward."""
    slept: list[float] = []
    monkeypatch.setattr(LoadImbalance, "_sleep_ms", staticmethod(lambda ms: slept.append(ms) or ms if ms > 0 else 0.0))
    manual = LoadImbalance(delay_ms=1.0, log=False, straggle_at="backward")
    tiny_fit(tmp_path / "manual", [manual], steps=4, manual=True)  # P=1: rank 0 is drawn on every batch
    batches = len(manual.records)
    assert batches >= 2 and [r.delay_ms for r in manual.records] == [1.0] * batches and slept == [1.0] * batches

    slept.clear()
    skipping = LoadImbalance(delay_ms=1.0, log=False, straggle_at="backward")
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=6, callbacks=[skipping], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g))
    trainer.fit(SkipsOddBatches(), DataLoader(data, batch_size=8))
    assert [r.delay_ms for r in skipping.records] == [1.0, 0.0] * 3  # a batch without a backward does not straggle
    assert slept == [1.0] * 3


def test_the_batch_counter_survives_a_checkpoint_resume(tmp_path: Path) -> None:
    first = LoadImbalance(delay_ms=0.1, seed=1, log=False)
    trainer, _ = tiny_fit(tmp_path, [first], steps=4)
    ckpt = tmp_path / "mid.ckpt"
    trainer.save_checkpoint(ckpt)
    resumed = LoadImbalance(delay_ms=0.1, seed=1, log=False)
    tiny_fit(tmp_path, [resumed], steps=8, ckpt=ckpt)
    assert [r.counter for r in first.records] == [0, 1, 2, 3]
    assert [r.counter for r in resumed.records] == [4, 5, 6, 7]  # the draw continues where it stopped


def test_tracker_logs_each_round_once_with_a_suffix_per_optimizer(tmp_path: Path) -> None:
    tracker = StalenessTracker()
    tiny_fit(tmp_path, [tracker], steps=6, manual=True, strategy=SyntheticRounds(), csv_logger=True)
    rows = list(csv.DictReader((tmp_path / "csv" / "version_0" / "metrics.csv").open()))
    rounds_0 = [float(r["partial/round"]) for r in rows if r.get("partial/round")]
    rounds_1 = [float(r["partial/round_1"]) for r in rows if r.get("partial/round_1")]
    # Lightning counts both optimizers' steps in global_step: 6 steps = 4 batches (a, b, a, a, b, a).
    assert rounds_0 == [0.0, 1.0, 2.0, 3.0]
    # Optimizer 1 steps on batches 0 and 2 only. Lightning hands loggers the last
    # value of every step metric at each step, so its row repeats on batches 1
    # and 3; the tracker itself counted each round once (summary below).
    assert rounds_1 == [0.0, 0.0, 1.0, 1.0]
    for row in rows:
        for metric in METRICS:
            if row.get("partial/round"):
                assert row[f"partial/{metric}"] != "", metric
    assert float(rows[0]["partial/wait_ms"]) == pytest.approx(2.0)
    assert {i: (s.rounds, s.staleness_max, s.last_round) for i, s in tracker.summary.items()} == {
        0: (4, 2, 3),
        1: (2, 1, 1),
    }
    assert tracker.summary[0].activators == Counter({0: 4})


def test_tracker_under_accumulation_logs_only_stepping_batches(tmp_path: Path) -> None:
    tracker = StalenessTracker()
    tiny_fit(tmp_path, [tracker], steps=3, accumulate=3, strategy=SyntheticRounds(), csv_logger=True)
    rows = list(csv.DictReader((tmp_path / "csv" / "version_0" / "metrics.csv").open()))
    assert [float(r["partial/round"]) for r in rows if r.get("partial/round")] == [0.0, 1.0, 2.0]
    assert tracker.summary[0].rounds == 3


def _csv_rows(root: Path) -> list[dict[str, str]]:
    return list(csv.DictReader((root / "csv" / "version_0" / "metrics.csv").open()))


def _by_step(rows: list[dict[str, str]], prefix: str) -> dict[str, dict[str, str]]:
    """The logged ``prefix`` metrics of each step (a step may take several rows)."""
    out: dict[str, dict[str, str]] = {}
    for row in rows:
        out.setdefault(row["step"], {}).update({k: v for k, v in row.items() if k.startswith(prefix) and v != ""})
    return {step: metrics for step, metrics in out.items() if metrics}


def _count_logs(monkeypatch: pytest.MonkeyPatch, prefix: str) -> list[int]:
    """Records, per ``LightningModule.log`` call of a ``prefix`` metric, the batch it was made at."""
    calls: list[int] = []
    original = L.LightningModule.log

    def counting(self: L.LightningModule, name: str, *args: Any, **kwargs: Any) -> None:
        if name.startswith(prefix):
            calls.append(self.trainer.fit_loop.epoch_loop._batches_that_stepped)
        original(self, name, *args, **kwargs)

    monkeypatch.setattr(L.LightningModule, "log", counting)
    return calls


@pytest.mark.parametrize(
    "callback, strategy, prefix, manual, accumulate",
    [
        (StalenessTracker, SyntheticRounds, "partial/", False, 1),
        (StalenessTracker, SyntheticRounds, "partial/", True, 1),
        (StalenessTracker, SyntheticRounds, "partial/", False, 2),
        (GroupRotation, SyntheticGroupRounds, "groups/", False, 1),
        (GroupRotation, SyntheticGroupRounds, "groups/", True, 1),
    ],
)
def test_round_callbacks_log_only_where_lightning_writes_what_every_batch_would_show(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, callback: type, strategy: type, prefix: str, manual: bool,
    accumulate: int,
) -> None:
    """With ``log_every_n_steps=3`` a callback calls ``log`` only at the batches whose metrics Lightning writes,
    and the loggers receive there exactly what logging at every batch gives them, over two epochs (32 batches
    each) and with a metric logged only now and then (``groups/consensus``)."""
    calls = _count_logs(monkeypatch, prefix)
    runs = {}
    for every in (1, 3):
        calls.clear()
        tiny_fit(tmp_path / str(every), [callback()], steps=40 if accumulate == 1 else 20, manual=manual,
                 accumulate=accumulate, strategy=strategy(), csv_logger=True, log_every=every)
        runs[every] = (_by_step(_csv_rows(tmp_path / str(every)), prefix), sorted(set(calls)), len(calls))
    (dense, _, dense_calls), (sparse, sparse_at, sparse_calls) = runs[1], runs[3]
    assert sparse and len(sparse) < len(dense)
    assert sparse == {step: dense[step] for step in sparse}  # the same figures where Lightning wrote
    assert all((b + 1) % 3 == 0 for b in sparse_at)  # log() was called at written batches only
    assert 0 < sparse_calls < dense_calls / 2
    if callback is GroupRotation:
        assert any(f"{prefix}consensus" in m for m in sparse.values())


def test_log_false_logs_nothing_although_lightning_sets_every_callbacks_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lightning assigns ``callback.log = module.log`` at fit start: the option must not live there."""
    calls = _count_logs(monkeypatch, "")
    callbacks = [StalenessTracker(log=False), GroupRotation(log=False), LoadImbalance(delay_ms=1.0, log=False)]
    tiny_fit(tmp_path, callbacks, steps=6, strategy=SyntheticGroupRounds(), csv_logger=True)
    assert calls == []
    assert callbacks[0].last[0]["round"] == 5.0 and len(callbacks[1].history) == 6  # they still record


def test_tracker_without_round_stats_warns_once_and_logs_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tracker = StalenessTracker()
    with caplog.at_level(logging.WARNING, logger="lightning_partial.callbacks.staleness"):
        trainer, _ = tiny_fit(tmp_path, [tracker], steps=4)
    warnings = [r for r in caplog.records if "has no round_stats" in r.getMessage()]
    assert len(warnings) == 1 and "SingleDeviceStrategy" in warnings[0].getMessage()
    assert not [k for k in trainer.callback_metrics if k.startswith("partial/")]
    assert tracker.summary == {}


# -------------------------------------------------------------- wandb helper
def test_nothing_imports_wandb_at_import_time() -> None:
    code = (
        "import sys, lightning_partial, lightning_partial.callbacks, lightning_partial.loggers; "
        "print(sorted(m for m in sys.modules if m == 'wandb' or m.startswith('wandb.')))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"


def test_wandb_logger_without_wandb_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # what an environment without wandb looks like to find_spec
    with pytest.raises(ImportError, match=r'pip install -e "\.\[recipes\]"'):
        wandb_logger()
    assert "recipes" in INSTALL_HINT


def test_wandb_logger_is_offline_unless_the_environment_says_otherwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_SILENT", raising=False)
    logger = wandb_logger(save_dir=tmp_path / "a")  # builds the logger; no run starts until it is used
    assert logger._offline and os.environ["WANDB_MODE"] == "offline" and os.environ["WANDB_SILENT"] == "true"
    assert (tmp_path / "a").is_dir()

    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_SILENT", "false")
    logger = wandb_logger(save_dir=tmp_path / "b")
    assert not logger._offline
    assert os.environ["WANDB_MODE"] == "online" and os.environ["WANDB_SILENT"] == "false"  # the user's choice stays

    logger = wandb_logger(save_dir=tmp_path / "c", offline=True)  # an explicit argument wins over the environment
    assert logger._offline and logger._wandb_init["mode"] == "offline"

    # The WANDB_MODE an earlier offline logger of the process left behind does not make offline=False offline:
    # the mode goes to wandb.init, which prefers it to the environment.
    monkeypatch.delenv("WANDB_MODE")
    assert wandb_logger(save_dir=tmp_path / "d")._wandb_init["mode"] == "offline"
    assert os.environ["WANDB_MODE"] == "offline"
    logger = wandb_logger(save_dir=tmp_path / "e", offline=False)
    assert not logger._offline and logger._wandb_init["mode"] == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_logger(save_dir=tmp_path / "f", offline=False)._wandb_init["mode"] == "disabled"


# ------------------------------------------------------- a real 4-process fit
STEPS = 12
SPEED = (1.0, 1.0, 1.0, 0.5)


def wandb_records(path: Path) -> Iterator[Any]:
    """The records of an offline run's transaction log (``run-<id>.wandb``, wandb's LevelDB-style log).

    wandb 0.31 offline writes neither ``files/wandb-summary.json`` nor history
    files: everything is in this log until ``wandb sync``. Format: a 7-byte
    header (``:W&B``, magic 0xBEE1, version); 32 KiB blocks of chunks, each
    with a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last).
    """
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    ident, magic, _version = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B" and magic == 0xBEE1, (ident, magic)
    block, pos, pending = 32768, 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


@pytest.fixture(scope="module")
def fit4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("wandb")
    out = tmp_path_factory.mktemp("fit4")
    home = out / "wandb_home"  # wandb's config/cache/data stay in the test's directory
    env = {k: v for k, v in os.environ.items()  # WANDB_MODE unset: default offline; the script picks its port
           if not k.startswith("WANDB_") and k not in ("MASTER_ADDR", "MASTER_PORT")}
    env.update(
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
        WANDB_CONFIG_DIR=str(home / "config"),
        WANDB_CACHE_DIR=str(home / "cache"),
        WANDB_DATA_DIR=str(home / "data"),
        # Any attempt to reach a server would fail at once rather than reach the internet.
        WANDB_BASE_URL="http://127.0.0.1:9",
    )
    # SGD momentum 0.9: the default staleness rule weighs late gradients (partial/discounted > 0).
    options = f"--strategy eager_sgd --steps {STEPS} --track --spy --momentum 0.9".split()
    options += "--imbalance-ms 10 --stragglers 2 --imbalance-seed 11".split()
    options += ["--speed", ",".join(map(str, SPEED)), "--csv", str(out / "csv"), "--wandb", str(out / "wandb")]
    proc = subprocess.run(
        [sys.executable, "-m", SCRIPT, "--out", str(out), *options],
        env=env,
        stdin=subprocess.DEVNULL,  # a prompt would read EOF and fail the fit
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out


def rank_records(out: Path) -> list[dict[str, Any]]:
    return [json.loads((out / f"callbacks{r}.json").read_text()) for r in range(4)]


def test_every_rank_delays_exactly_the_shared_draw(fit4: Path) -> None:
    records = rank_records(fit4)
    reference = LoadImbalance(delay_ms=10, stragglers=2, seed=11)
    draws = [rec["imbalance"]["records"] for rec in records]
    for rank, batches in enumerate(draws):
        assert [b["counter"] for b in batches] == list(range(STEPS))
        for b in batches:
            assert b["stragglers"] == reference.stragglers_for(b["counter"], 4)
            assert b["delay_ms"] == (10.0 if rank in b["stragglers"] else 0.0), (rank, b)
    assert all([b["stragglers"] for b in d] == [b["stragglers"] for b in draws[0]] for d in draws)


def test_the_slowed_rank_injects_its_slowdown_and_the_others_none(fit4: Path) -> None:
    records = rank_records(fit4)
    slowdown = [sum(b["slowdown_ms"] for b in rec["imbalance"]["records"]) for rec in records]
    assert slowdown[:3] == [0.0, 0.0, 0.0]
    assert all(b["slowdown_ms"] > 0 for b in records[3]["imbalance"]["records"])
    delays = [sum(b["delay_ms"] for b in rec["imbalance"]["records"]) for rec in records]
    assert records[3]["imbalance"]["injected_ms"] > delays[3]  # the slowdown comes on top of its straggler delays
    for rec, delay, slow in zip(records, delays, slowdown, strict=True):
        assert rec["imbalance"]["injected_ms"] == pytest.approx(delay + slow)


def test_callbacks_and_loggers_issue_no_collective_while_batches_run(fit4: Path) -> None:
    for rec in rank_records(fit4):
        assert rec["collectives_at_train_end"] == 0, rec["collective_names"]


def test_tracker_summary_agrees_across_ranks(fit4: Path) -> None:
    summaries = [rec["staleness"]["0"] for rec in rank_records(fit4)]
    shared = ("rounds", "synchronous", "fresh_total", "contributions_total", "staleness_max", "activators",
              "discounted_total")
    for s in summaries[1:]:
        assert {k: s[k] for k in shared} == {k: summaries[0][k] for k in shared}  # only wait_ms is per rank
    s = summaries[0]
    # Every step's round, then the final flush (synchronous), which the tracker counts at on_fit_end.
    assert s["rounds"] == STEPS + 1 and s["last_round"] == STEPS and s["synchronous"] >= 1
    assert set(s["activators"]) <= {"-1", "0", "1", "2", "3"}
    # Each step's round has at least its activator fresh; the final flush carries no fresh
    # gradient (flush() is called without tensors), so it adds 0.
    assert STEPS <= s["fresh_total"] <= 4 * STEPS


def test_csv_log_has_every_partial_metric_at_every_step(fit4: Path) -> None:
    rows = list(csv.DictReader((fit4 / "csv" / "fit" / "version_0" / "metrics.csv").open()))
    partial = [r for r in rows if r.get("partial/round")]
    assert [int(float(r["partial/round"])) for r in partial] == list(range(STEPS))
    assert [int(r["step"]) for r in partial] == list(range(STEPS))
    for r in partial:
        values = {m: float(r[f"partial/{m}"]) for m in METRICS}
        assert 1 <= values["fresh"] <= 4
        assert values["fresh"] <= values["contributions"]
        assert 0 <= values["staleness_mean"] <= values["staleness_max"]
        assert -1 <= values["activator"] <= 3 and values["activator"] == int(values["activator"])
        assert values["wait_ms"] >= 0
        # The default rule ("inverse" under momentum) withholds tau / (1 + tau) of each late gradient,
        # nothing of a fresh one.
        assert 0 <= values["discounted"] <= values["contributions"]
        assert (values["discounted"] > 0) == (values["staleness_max"] > 0)
        assert r["imbalance/delay_ms"] != ""


def test_the_update_rule_in_force_at_four_ranks_is_logged(fit4: Path) -> None:
    """eager_sgd's defaults under SGD momentum at world size 4: weight prediction on (off only at world size 1)
    and the "inverse" rule, as StalenessTracker's hyperparameters."""
    import yaml

    hparams = yaml.safe_load((fit4 / "csv" / "fit" / "version_0" / "hparams.yaml").read_text())
    assert hparams["partial/weight_prediction"] is True and hparams["partial/staleness_rule"] == "inverse", hparams


def test_wandb_run_is_offline_and_holds_the_partial_metrics(fit4: Path) -> None:
    runs = sorted((fit4 / "wandb" / "wandb").glob("*run-*"))
    assert [p.name.split("-")[0] for p in runs] == ["offline"], runs  # no online run directory
    logs = list(runs[0].glob("run-*.wandb"))
    assert len(logs) == 1
    records = list(wandb_records(logs[0]))
    kinds = Counter(r.WhichOneof("record_type") for r in records)
    assert kinds["run"] == 1 and kinds["exit"] == 1, kinds
    history = [  # wandb stores a key with "/" as its parts (nested_key)
        {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
        for r in records
        if r.HasField("history")
    ]
    steps = [h for h in history if "partial/round" in h]
    assert [int(h["partial/round"]) for h in steps] == list(range(STEPS))
    for h in steps:
        assert {f"partial/{m}" for m in METRICS} | {"imbalance/delay_ms"} <= set(h)
        assert 1 <= h["partial/fresh"] <= 4 and h["partial/staleness_max"] >= 0
    run = next(r.run for r in records if r.HasField("run"))
    assert run.project == "lightning_partial" and run.display_name == "fit"


def test_a_skipped_batch_is_logged_and_counted() -> None:
    """catch_up: the round of a batch this rank skipped logs partial/skipped = 1 and is counted in the summary."""
    from lightning_partial.callbacks.staleness import StalenessSummary, round_metrics

    stats = RoundStats(round_index=3, activator=1, initiator=None, synchronous=False, flush=False, fresh=(1,),
                       counts=(0, 1), staleness=(None, 0), oldest_staleness=(None, 0), progress=(4, 4), dropped=(0, 0),
                       contributions=1, divisor=2.0, skipped=True)
    assert round_metrics(stats)["skipped"] == 1.0
    assert round_metrics(dataclasses.replace(stats, skipped=False))["skipped"] == 0.0
    summary = StalenessSummary()
    summary.add(stats)
    summary.add(dataclasses.replace(stats, round_index=4, skipped=False))
    assert summary.skipped == 1 and summary.as_dict()["skipped"] == 1


def test_a_second_fit_counts_and_logs_its_own_rounds(tmp_path: Path) -> None:
    """The same StalenessTracker and GroupRotation in a second fit, whose rounds start again at 0: it logs them
    and counts them from its own first round (it skipped every round up to the first fit's last)."""
    tracker, rotation = StalenessTracker(), GroupRotation()
    tiny_fit(tmp_path / "a", [tracker, rotation], steps=6, strategy=SyntheticGroupRounds(), csv_logger=True)
    assert tracker.summary[0].rounds == 6 and len(rotation.history) == 6
    tiny_fit(tmp_path / "b", [tracker, rotation], steps=4, strategy=SyntheticGroupRounds(), csv_logger=True)
    assert (tracker.summary[0].rounds, tracker.summary[0].last_round) == (4, 3)
    rows = _csv_rows(tmp_path / "b")
    assert [float(r["partial/round"]) for r in rows if r.get("partial/round")] == [0.0, 1.0, 2.0, 3.0]
    assert len([r for r in rows if r.get("groups/group_size")]) == 4


class _LargeGroupRounds(SyntheticRounds):
    """Group rounds of ranks 0 and 1024: a members mask no float holds."""

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        for index, stats in self.round_stats.items():
            self.round_stats[index] = dataclasses.replace(stats, group=(0, 1024), group_id=0)
        return out


def test_group_rotation_logs_no_members_mask_for_ranks_from_53_on(tmp_path: Path) -> None:
    """groups/members is a float bit mask: exact below 2**53, an OverflowError from 1024 ranks (which ended the
    fit on every rank); for such groups it is not logged, the size and id are."""
    rotation = GroupRotation()
    tiny_fit(tmp_path, [rotation], steps=3, strategy=_LargeGroupRounds(), csv_logger=True)
    rows = [r for r in _csv_rows(tmp_path) if r.get("groups/group_size")]
    assert len(rows) == 3 and all(float(r["groups/group_size"]) == 2.0 and not r.get("groups/members") for r in rows)
    assert [record.members for record in rotation.history] == [(0, 1024)] * 3
