"""Bad input, catalogued: every entry fails with a ValueError naming the option, before any training.

Three tables:

* ``CASES``: the four strategies, the engines' configurations, the schedules and the
  callbacks, refused at construction. Nothing starts a process or a group.
* ``SETUP_CASES``: what only set-up can tell (the world size, the trainer's other
  options, the checkpoint being resumed), refused by a 1-process fit in this process
  before its first batch; a checkpoint refused is left byte for byte as it was.
* The recipes' command line: ``CLI_CASES`` in ``tests/test_recipes.py`` (exit status 2,
  one line naming the option, before any process is launched or any batch runs).

Each row: what is built, and a pattern the message must contain (the option's name;
where the option takes names, also the allowed values). What is deliberately
accepted is tested too: a checkpoint from another world size (its pending gradients
remapped, ``tests/test_checkpoint_files.py``).
"""

from __future__ import annotations

import hashlib
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional

import lightning as L
import pytest
import torch
import torch.distributed as dist

from lightning_partial import ABSSGDStrategy, DSSyncStrategy, EagerSGDStrategy, WAGMAStrategy
from lightning_partial.callbacks import AdaptiveBatchSize, GroupRotation, LoadImbalance, StalenessTracker
from lightning_partial.collectives import Heartbeat, PartialAllreduce, PartialAllreduceConfig
from lightning_partial.collectives.delayed import DelayedAllreduce, DelayedConfig
from lightning_partial.collectives.schedules import ButterflySchedule, ShuffleSchedule
from lightning_partial.collectives.staleness import StalenessWeights
from lightning_partial.strategies.checkpoint import CHECKPOINT_KEY, CheckpointMismatchError
from tests.distributed import in_process_fit

CASES: list[tuple[str, Callable[[], Any], str]] = [
    # eager_sgd
    ("eager_sgd unknown mode", lambda: EagerSGDStrategy(mode="fastest"), r"mode.*solo"),
    ("eager_sgd quorum without mode", lambda: EagerSGDStrategy(quorum=3), r"quorum"),
    ("eager_sgd quorum mode without quorum", lambda: EagerSGDStrategy(mode="quorum"), r"quorum"),
    ("eager_sgd quorum 0", lambda: EagerSGDStrategy(mode="quorum", quorum=0), r"quorum"),
    ("eager_sgd backup_workers 0", lambda: EagerSGDStrategy(mode="quorum", backup_workers=0),
     r"backup_workers must be an integer >= 1"),
    ("eager_sgd backup_workers without quorum mode", lambda: EagerSGDStrategy(backup_workers=1),
     r"backup_workers=1 is only meaningful with mode='quorum'"),
    ("eager_sgd unknown late", lambda: EagerSGDStrategy(late="keep"), r"late.*carry"),
    ("eager_sgd unknown normalize", lambda: EagerSGDStrategy(normalize="mean"), r"normalize.*world"),
    ("eager_sgd negative staleness", lambda: EagerSGDStrategy(max_staleness=-1), r"max_staleness"),
    ("eager_sgd float staleness", lambda: EagerSGDStrategy(max_staleness=1.5), r"max_staleness"),
    ("eager_sgd weight_prediction not a bool", lambda: EagerSGDStrategy(weight_prediction="yes"),
     r"eager_sgd: weight_prediction must be a bool"),
    ("eager_sgd overlap not a bool", lambda: EagerSGDStrategy(overlap=1), r"eager_sgd: overlap must be a bool"),
    ("eager_sgd overlap in sync mode", lambda: EagerSGDStrategy(mode="sync", overlap=True),
     r"overlap=True is not available with mode='sync'"),
    ("eager_sgd catch_up not a bool", lambda: EagerSGDStrategy(catch_up="yes"), r"eager_sgd: catch_up must be a bool"),
    ("eager_sgd catch_up with overlap", lambda: EagerSGDStrategy(catch_up=True, overlap=True),
     r"catch_up=True .*\(not overlap=True\); got mode='solo', overlap=True$"),
    ("eager_sgd catch_up in sync mode", lambda: EagerSGDStrategy(catch_up=True, mode="sync"),
     r"catch_up=True .*not mode='sync'.*got mode='sync', overlap=False$"),
    ("LoadImbalance straggle_at unknown", lambda: LoadImbalance(delay_ms=1.0, straggle_at="forward"),
     r"LoadImbalance: straggle_at must be one of 'batch_start', 'backward', got 'forward'"),
    ("eager_sgd sync_every 0", lambda: EagerSGDStrategy(sync_every=0), r"sync_every"),
    ("eager_sgd bool sync_every", lambda: EagerSGDStrategy(sync_every=True), r"sync_every"),
    ("eager_sgd final_sync 1", lambda: EagerSGDStrategy(final_sync=1.0), r"eager_sgd: final_sync must be .*\[0, 1\)"),
    ("eager_sgd negative final_sync", lambda: EagerSGDStrategy(final_sync=-0.1), r"final_sync"),
    ("eager_sgd nan final_sync", lambda: EagerSGDStrategy(final_sync=float("nan")), r"final_sync"),
    ("eager_sgd bool final_sync", lambda: EagerSGDStrategy(final_sync=True), r"final_sync"),
    ("eager_sgd unknown staleness rule", lambda: EagerSGDStrategy(staleness_rule="linear"), r"staleness_rule.*inverse"),
    ("eager_sgd zero timeout", lambda: EagerSGDStrategy(timeout=timedelta(0)), r"timeout"),
    ("eager_sgd timeout in seconds", lambda: EagerSGDStrategy(timeout=30), r"timeout"),
    ("eager_sgd start method", lambda: EagerSGDStrategy(start_method="forkserver"), r"start_method.*'fork'"),
    # wagma_sgd / ds_sync
    ("wagma_sgd group size 3", lambda: WAGMAStrategy(group_size=3), r"group_size"),
    ("wagma_sgd group size 0", lambda: WAGMAStrategy(group_size=0), r"group_size"),
    ("wagma_sgd global_every 0", lambda: WAGMAStrategy(global_every=0), r"global_every"),
    ("wagma_sgd unknown stale", lambda: WAGMAStrategy(stale="repeat"), r"stale.*skip"),
    ("wagma_sgd unknown late", lambda: WAGMAStrategy(late="keep"), r"late.*damp"),
    ("wagma_sgd final_sync as a step count", lambda: WAGMAStrategy(final_sync=20), r"wagma_sgd: final_sync"),
    ("ds_sync infinite final_sync", lambda: DSSyncStrategy(final_sync=float("inf")), r"ds_sync: final_sync"),
    ("wagma_sgd unknown order", lambda: WAGMAStrategy(order="random"), r"order"),
    ("wagma_sgd unknown normalize", lambda: WAGMAStrategy(normalize="world"), r"normalize.*group"),
    ("ds_sync num_groups 0", lambda: DSSyncStrategy(num_groups=0), r"num_groups"),
    ("ds_sync measure_every 0", lambda: DSSyncStrategy(measure_every=0), r"measure_every"),
    ("ds_sync unknown mode", lambda: DSSyncStrategy(mode="all"), r"mode"),
    ("wagma_sgd backup_workers without quorum mode", lambda: WAGMAStrategy(backup_workers=1),
     r"backup_workers=1 is only meaningful with mode='quorum'"),
    ("ds_sync backup_workers 0", lambda: DSSyncStrategy(mode="quorum", backup_workers=0), r"backup_workers"),
    ("ds_sync quorum and backup_workers", lambda: DSSyncStrategy(mode="quorum", quorum=3, backup_workers=1),
     r"quorum.*backup_workers"),
    ("ds_sync unknown adaptive_scaling", lambda: DSSyncStrategy(adaptive_scaling="sqrt"),
     r"ds_sync: unknown adaptive_scaling 'sqrt': expected one of auto, global_batch, none"),
    ("wagma_sgd adaptive_scaling not a string", lambda: WAGMAStrategy(adaptive_scaling=True),
     r"wagma_sgd: unknown adaptive_scaling True"),
    # abs_sgd
    ("abs_sgd unknown trigger", lambda: ABSSGDStrategy(trigger="steps"), r"trigger.*samples"),
    ("abs_sgd time trigger without interval", lambda: ABSSGDStrategy(trigger="time"), r"interval"),
    ("abs_sgd interval with samples", lambda: ABSSGDStrategy(interval=0.5), r"interval"),
    ("abs_sgd target_samples 0", lambda: ABSSGDStrategy(target_samples=0), r"target_samples"),
    ("abs_sgd delay 2", lambda: ABSSGDStrategy(delay=2), r"delay must be 0, 1 or .auto."),
    ("abs_sgd reference_samples -4", lambda: ABSSGDStrategy(reference_samples=-4), r"reference_samples"),
    ("abs_sgd reference_samples unknown word", lambda: ABSSGDStrategy(reference_samples="auto"), r"reference_samples"),
    ("abs_sgd weight_prediction not a bool", lambda: ABSSGDStrategy(weight_prediction=1), r"weight_prediction"),
    ("abs_sgd step_samples 0", lambda: ABSSGDStrategy(step_samples=0), r"step_samples"),
    ("abs_sgd step_samples unknown word", lambda: ABSSGDStrategy(step_samples="batch"), r"step_samples"),
    ("abs_sgd step_samples a float", lambda: ABSSGDStrategy(step_samples=64.0), r"step_samples"),
    ("abs_sgd step_boundary unknown", lambda: ABSSGDStrategy(step_boundary="round"), r"step_boundary"),
    ("abs_sgd unknown staleness rule", lambda: ABSSGDStrategy(staleness_rule="spike"), r"staleness_rule"),
    ("abs_sgd shuffle not a bool", lambda: ABSSGDStrategy(shuffle="no"), r"shuffle must be True or False"),
    ("abs_sgd seed not an integer", lambda: ABSSGDStrategy(seed="x"), r"seed must be an integer"),
    ("abs_sgd seed a bool", lambda: ABSSGDStrategy(seed=True), r"seed must be an integer"),
    ("unknown process group backend", lambda: EagerSGDStrategy(process_group_backend="foo"),
     r"process_group_backend must be None or a torch.distributed backend.*got 'foo'"),
    ("process group backend not a string", lambda: WAGMAStrategy(process_group_backend=2),
     r"process_group_backend.*got 2"),
    ("unknown backend for a device", lambda: ABSSGDStrategy(process_group_backend="cpu:gloo,cuda:foo"),
     r"process_group_backend.*'cpu:gloo,cuda:foo'"),
    # engine configurations and schedules
    ("engine config name with slash", lambda: PartialAllreduceConfig(name="a/b"), r"name"),
    ("engine setup_timeout negative", lambda: PartialAllreduceConfig(setup_timeout=timedelta(seconds=-1)),
     r"setup_timeout"),
    ("engine staleness not weights", lambda: PartialAllreduceConfig(staleness="inverse"), r"staleness"),
    ("staleness weights unknown rule", lambda: StalenessWeights(rule="linear"), r"rule"),
    ("delayed config max_epochs without epoch_samples", lambda: DelayedConfig(target_samples=8, max_epochs=2),
     r"epoch_samples"),
    ("delayed config infinite interval", lambda: DelayedConfig(trigger="time", interval=float("inf")),
     r"needs interval > 0 \(seconds, finite\), got inf"),
    ("engine config name not a string", lambda: PartialAllreduceConfig(name=123), r"name must be .*got 123"),
    ("engine config seed a bool", lambda: PartialAllreduceConfig(seed=True), r"seed must be an integer, got True"),
    ("engine timeout beyond what a wait takes", lambda: PartialAllreduceConfig(timeout=timedelta.max),
     r"^timeout must be at most threading.TIMEOUT_MAX"),
    ("engine rank a float", lambda: PartialAllreduce(PartialAllreduceConfig(), store=dist.HashStore(), rank=0.5,
                                                     world_size=2, like=torch.zeros(1)),
     r"^rank must be an integer >= 0, got 0\.5$"),
    ("engine rank a bool", lambda: PartialAllreduce(PartialAllreduceConfig(), store=dist.HashStore(), rank=True,
                                                    world_size=2, like=torch.zeros(1)),
     r"^rank must be an integer >= 0, got True$"),
    ("engine integer tensors divided by the world", lambda: PartialAllreduce(
        PartialAllreduceConfig(normalize="world"), store=dist.HashStore(), rank=0, world_size=1,
        like=[torch.zeros(2), torch.zeros(3, dtype=torch.int64)]),
     r"normalize='world' divides .*floating point.*normalize='sum'.*torch.int64"),
    ("engine integer tensors divided by the contributors", lambda: PartialAllreduce(
        PartialAllreduceConfig(normalize="contributors"), store=dist.HashStore(), rank=0, world_size=1,
        like=torch.zeros(3, dtype=torch.int32)),
     r"normalize='contributors' divides"),
    ("delayed engine integer tensors", lambda: DelayedAllreduce(
        DelayedConfig(target_samples=1), store=dist.HashStore(), rank=0, world_size=1,
        like=torch.zeros(3, dtype=torch.int64)),
     r"^DelayedAllreduce: normalize='contributors' divides"),
    ("heartbeat infinite exit_grace", lambda: Heartbeat(
        dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=5), on_dead=print, exit_grace=float("inf")),
     r"exit_grace must be a finite positive number"),
    ("heartbeat interval a bool", lambda: Heartbeat(
        dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=5), on_dead=print, interval=True),
     r"heartbeat interval must be in \(0, timeout\), got True"),
    ("heartbeat rank a bool", lambda: Heartbeat(
        dist.HashStore(), rank=True, world_size=2, timeout=timedelta(seconds=5), on_dead=print),
     r"^rank must be an integer >= 0, got True$"),
    ("heartbeat timeout beyond what a wait takes", lambda: Heartbeat(
        dist.HashStore(), rank=0, world_size=1, timeout=timedelta.max, on_dead=print),
     r"^heartbeat timeout must be at most threading.TIMEOUT_MAX"),
    ("butterfly world not a power of the group", lambda: ButterflySchedule(world_size=6, group_size=4),
     r"world_size|group_size"),
    ("butterfly global_every 0", lambda: ButterflySchedule(world_size=4, group_size=2, global_every=0),
     r"^global_every must be an integer >= 1 or None, got 0$"),
    ("shuffle more groups than ranks", lambda: ShuffleSchedule(world_size=4, num_groups=8), r"num_groups"),
    # callbacks
    ("LoadImbalance negative delay", lambda: LoadImbalance(delay_ms=-5), r"delay_ms"),
    ("LoadImbalance speed above 1", lambda: LoadImbalance(speed=[1.0, 2.0]), r"speed"),
    ("LoadImbalance stragglers -1", lambda: LoadImbalance(stragglers=-1), r"stragglers"),
    ("AdaptiveBatchSize window 0", lambda: AdaptiveBatchSize(window=0), r"window"),
    ("AdaptiveBatchSize unknown arrival", lambda: AdaptiveBatchSize(arrival="tide"),
     r"unknown arrival 'tide': expected one of count, samples, time"),
    ("AdaptiveBatchSize slices 0", lambda: AdaptiveBatchSize(slices=0), r"slices must be an integer >= 1"),
    ("AdaptiveBatchSize first_window 0", lambda: AdaptiveBatchSize(first_window=0),
     r"first_window must be an integer >= 1"),
    ("AdaptiveBatchSize first_window above window", lambda: AdaptiveBatchSize(window=4, first_window=5),
     r"first_window must be at most window \(4\), got 5"),
    ("GroupRotation consensus_every 0", lambda: GroupRotation(consensus_every=0), r"consensus_every"),
    ("GroupRotation switch_at round 0", lambda: GroupRotation(switch_at={0: ButterflySchedule(world_size=4, group_size=2)}),
     r"switch_at"),
    ("StalenessTracker log not a bool", lambda: StalenessTracker(log="yes"), r"log"),
    # wrong types
    ("wagma_sgd group size as a string", lambda: WAGMAStrategy(group_size="2"), r"group_size.*power of two"),
    ("wagma_sgd global_every as a string", lambda: WAGMAStrategy(global_every="10"), r"global_every"),
    ("wagma_sgd mode None", lambda: WAGMAStrategy(mode=None), r"mode.*solo, majority, quorum, sync"),
    ("ds_sync num_groups as a float", lambda: DSSyncStrategy(num_groups=2.5), r"num_groups.*integer"),
    ("ds_sync negative timeout", lambda: DSSyncStrategy(timeout=timedelta(seconds=-1)), r"timeout.*timedelta"),
    ("abs_sgd target_samples as a string", lambda: ABSSGDStrategy(target_samples="64"), r"target_samples"),
    ("abs_sgd negative time interval", lambda: ABSSGDStrategy(trigger="time", interval=-1.0), r"interval"),
    ("eager_sgd quorum as a string", lambda: EagerSGDStrategy(mode="quorum", quorum="3"), r"quorum.*integer"),
    ("LoadImbalance delay as a string", lambda: LoadImbalance(delay_ms="5"), r"delay_ms"),
    ("LoadImbalance speed not a sequence", lambda: LoadImbalance(speed=0.5), r"speed.*sequence"),
    ("AdaptiveBatchSize window as a float", lambda: AdaptiveBatchSize(window=2.5), r"window.*integer"),
    ("AdaptiveBatchSize first_window as a float", lambda: AdaptiveBatchSize(first_window=1.5),
     r"first_window.*integer"),
    ("GroupRotation schedule by name", lambda: GroupRotation(schedule="butterfly"), r"schedule.*Schedule"),
]


@pytest.mark.parametrize("build, pattern", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_fails_at_construction_naming_the_option(build: Callable[[], Any], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        build()


# ------------------------------------------------------------------ set-up: world size, trainer, checkpoints
class _Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(8, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _ManualTiny(_Tiny):
    """_Tiny under manual optimization."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(super().training_step(batch, batch_idx))
        optimizer.step()


class _Batches(L.Callback):
    """Records every training batch that starts (a refused configuration must leave it empty)."""

    def __init__(self, seen: list[int]) -> None:
        self.seen = seen

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, i: int) -> None:
        self.seen.append(i)


class _SaveAt(L.Callback):
    def __init__(self, path: Path, step: int) -> None:
        self.path, self.step = path, step

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def tiny_fit(root: Path, strategy: Any, *, seen: list[int], callbacks: tuple = (), ckpt_path: Any = None,
             steps: int = 3, module: Optional[L.LightningModule] = None, **trainer_kwargs: Any) -> L.Trainer:
    """A 1-process fit in this process (the strategies' set-up runs for real: gloo, one rank)."""
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=steps, logger=False,
                        callbacks=[_Batches(seen), *callbacks], enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, default_root_dir=root,
                        **trainer_kwargs)
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
    with in_process_fit():
        trainer.fit(module or _Tiny(), torch.utils.data.DataLoader(data, batch_size=8), ckpt_path=ckpt_path)
    return trainer


@pytest.fixture(scope="module")
def eager_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real checkpoint: eager_sgd, 1 process, saved mid-fit after step 2 (engine state included)."""
    root = tmp_path_factory.mktemp("eager_checkpoint")
    path = root / "mid.ckpt"
    tiny_fit(root, EagerSGDStrategy(), seen=[], callbacks=(_SaveAt(path, 2),))
    entry = torch.load(path, weights_only=True)[CHECKPOINT_KEY]
    assert entry["strategy"] == "eager_sgd" and entry["family"] == "gradients" and entry["world_size"] == 1
    return path


def variant(source: Path, target: Path, **changes: Any) -> Path:
    """A copy of checkpoint ``source`` with its engine entry changed (``engines=None`` removes the engines)."""
    checkpoint = torch.load(source, weights_only=True)
    entry = checkpoint[CHECKPOINT_KEY]
    for key, value in changes.items():
        if value is None:
            entry.pop(key)
        else:
            entry[key] = value
    torch.save(checkpoint, target)
    return target


def _two_ranks_at(steps: tuple[int, int]) -> Callable[[dict[str, Any]], dict[int, list[dict[str, Any]]]]:
    return lambda state: {0: [{**state, "step": s} for s in steps]}


def _from(strategy: str, family: str) -> Callable[[Path, Path], Path]:
    """The real eager_sgd checkpoint, relabelled as written by ``strategy`` of ``family``."""
    return lambda src, tmp: variant(src, tmp / f"{strategy}.ckpt", strategy=strategy, family=family)


def _rounds_apart(src: Path, tmp: Path) -> Path:
    state = torch.load(src, weights_only=True)[CHECKPOINT_KEY]["engines"][0][0]
    return variant(src, tmp / "apart.ckpt", world_size=2, engines=_two_ranks_at((2, 3))(state))


SetupBuild = Callable[[Path, Path], tuple[Any, dict[str, Any]]]
SETUP_CASES: list[tuple[str, SetupBuild, str]] = [
    # the world size (one process here)
    ("eager_sgd majority on one rank", lambda src, tmp: (EagerSGDStrategy(mode="majority"), {}),
     r"mode='majority' needs at least 2 ranks.*'sync' or 'solo'"),
    ("eager_sgd quorum above the world size", lambda src, tmp: (EagerSGDStrategy(mode="quorum", quorum=2), {}),
     r"quorum must be in 1\.\.1"),
    ("eager_sgd backup worker on one rank", lambda src, tmp: (EagerSGDStrategy(mode="quorum", backup_workers=1), {}),
     r"backup_workers must be below the world size 1"),
    ("ds_sync backup worker on one rank",
     lambda src, tmp: (DSSyncStrategy(mode="quorum", backup_workers=1, num_groups=1), {}),
     r"backup_workers must be below the world size 1"),
    ("wagma_sgd group larger than the world", lambda src, tmp: (WAGMAStrategy(group_size=4), {}),
     r"group_size 4 exceeds the world size 1"),
    ("wagma_sgd adaptive_scaling global_batch under SGD", lambda src, tmp: (
        WAGMAStrategy(adaptive_scaling="global_batch"), {}),
     r"wagma_sgd: adaptive_scaling='global_batch' reads Adam's moments.*SGD does not keep"),
    ("ds_sync more groups than ranks", lambda src, tmp: (DSSyncStrategy(num_groups=2), {}),
     r"num_groups 2 exceeds the world size 1"),
    ("GroupRotation schedule built for 4 ranks", lambda src, tmp: (
        WAGMAStrategy(), {"callbacks": (GroupRotation(schedule=ButterflySchedule(world_size=4, group_size=2)),)}),
     r"built for 4 ranks"),
    ("LoadImbalance speed for 2 ranks", lambda src, tmp: (EagerSGDStrategy(), {"callbacks": (LoadImbalance(
        speed=[1.0, 0.5]),)}), r"speed needs one factor per rank"),
    ("LoadImbalance more stragglers than ranks", lambda src, tmp: (EagerSGDStrategy(), {"callbacks": (LoadImbalance(
        delay_ms=1.0, stragglers=2),)}), r"stragglers \(2\) must be <= the world size"),
    # conflicting trainer options
    ("abs_sgd with validation every half epoch", lambda src, tmp: (ABSSGDStrategy(), {"val_check_interval": 0.5}),
     r"val_check_interval"),
    ("abs_sgd with validation by time", lambda src, tmp: (ABSSGDStrategy(), {"val_check_interval": "00:00:00:05"}),
     r"abs_sgd: Trainer\(val_check_interval=<5 s>\) validates by time"),
    ("abs_sgd with gradient accumulation", lambda src, tmp: (ABSSGDStrategy(), {"accumulate_grad_batches": 2}),
     r"accumulate_grad_batches.*must be 1"),
    ("abs_sgd with min_steps", lambda src, tmp: (ABSSGDStrategy(), {"min_steps": 5}),
     r"abs_sgd: Trainer\(min_steps=5\) holds a stop.*Use min_epochs"),
    ("eager_sgd catch_up with gradient accumulation", lambda src, tmp: (
        EagerSGDStrategy(catch_up=True), {"accumulate_grad_batches": 2}),
     r"eager_sgd: catch_up=True skips whole batches.*accumulate_grad_batches=2\) must be 1"),
    ("eager_sgd catch_up under manual optimization", lambda src, tmp: (
        EagerSGDStrategy(catch_up=True), {"module": _ManualTiny()}),
     r"eager_sgd: catch_up=True needs automatic optimization"),
    # a checkpoint written by a strategy of another family (its pending state would be lost)
    ("eager_sgd checkpoint under wagma_sgd", lambda src, tmp: (WAGMAStrategy(), {"ckpt_path": src}),
     r"written by strategy 'eager_sgd' \(engine family 'gradients'.*'wagma_sgd'.*eager_sgd, eager_sgd_majority"
     r".*drop_engine_state"),
    ("eager_sgd checkpoint under ds_sync", lambda src, tmp: (DSSyncStrategy(), {"ckpt_path": src}),
     r"written by strategy 'eager_sgd'.*'ds_sync' belongs to the 'models' family"),
    ("eager_sgd checkpoint under abs_sgd", lambda src, tmp: (ABSSGDStrategy(), {"ckpt_path": src}),
     r"written by strategy 'eager_sgd'.*'abs_sgd' belongs to the 'abs_sgd' family"),
    ("wagma_sgd checkpoint under eager_sgd", lambda src, tmp: (EagerSGDStrategy(), {
        "ckpt_path": _from("wagma_sgd", "models")(src, tmp)}),
     r"written by strategy 'wagma_sgd' \(engine family 'models'.*'eager_sgd'.*wagma_sgd, ds_sync"),
    ("abs_sgd checkpoint under eager_sgd", lambda src, tmp: (EagerSGDStrategy(), {
        "ckpt_path": _from("abs_sgd", "abs_sgd")(src, tmp)}),
     r"written by strategy 'abs_sgd'.*Resume it with one of: abs_sgd"),
    # a checkpoint that is not a consistent cut, or not this library's
    ("checkpoint saved with the ranks at different rounds", lambda src, tmp: (EagerSGDStrategy(), {
        "ckpt_path": _rounds_apart(src, tmp)}), r"different rounds \[2, 3\]"),
    ("checkpoint entry without engines", lambda src, tmp: (EagerSGDStrategy(), {
        "ckpt_path": variant(src, tmp / "bare.ckpt", engines=None)}), r"'lightning_partial' entry is malformed"),
]


def _digest(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("build, pattern", [c[1:] for c in SETUP_CASES], ids=[c[0] for c in SETUP_CASES])
def test_bad_setup_fails_before_the_first_batch(tmp_path: Path, eager_checkpoint: Path, build: SetupBuild,
                                                pattern: str) -> None:
    strategy, kwargs = build(eager_checkpoint, tmp_path)
    ckpt = kwargs.get("ckpt_path")
    before = _digest(ckpt) if ckpt is not None else None
    seen: list[int] = []
    with pytest.raises(ValueError, match=pattern) as exc:
        tiny_fit(tmp_path, strategy, seen=seen, **kwargs)
    assert seen == [], f"{len(seen)} batches ran before the error"
    if ckpt is not None:
        assert isinstance(exc.value, CheckpointMismatchError)
        assert str(ckpt) in str(exc.value)  # names the file given as ckpt_path
        assert _digest(ckpt) == before  # the refused checkpoint is left as it was


def test_the_tables_are_long_enough() -> None:
    assert len(CASES) >= 25 and len(SETUP_CASES) >= 15


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(name="n", value=True), r"^n must be an integer >= 1, got True$"),
        (dict(name="n", value=1.0), r"^n must be an integer >= 1, got 1\.0$"),
        (dict(name="n", value=None), r"^n must be an integer >= 1, got None$"),
        (dict(name="n", value=-1, minimum=0, optional=True), r"^n must be an integer >= 0 or None, got -1$"),
        (dict(name="n", value="2", owner="Thing"), r"^Thing: n must be an integer >= 1, got '2'$"),
    ],
)
def test_the_shared_integer_check_names_the_option(kw, match):
    """One helper (lightning_partial.collectives.checks.check_int) behind every integer option."""
    from lightning_partial.collectives.checks import check_int

    with pytest.raises(ValueError, match=match):
        check_int(**kw)
    check_int("n", None, optional=True)  # accepted
    check_int("n", 0, minimum=0)


class _Retrain(L.Callback):
    """At step ``at``, ``net.weight`` becomes trainable (``True``) or frozen (``False``): what BaseFinetuning's
    unfreeze, or a user's freeze, does mid-fit."""

    def __init__(self, at: int, trainable: bool) -> None:
        self.at, self.trainable = at, trainable

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, i: int) -> None:
        if trainer.global_step == self.at:
            pl_module.net.weight.requires_grad_(self.trainable)


@pytest.mark.parametrize("make", [EagerSGDStrategy, WAGMAStrategy, DSSyncStrategy, ABSSGDStrategy],
                         ids=["eager_sgd", "wagma_sgd", "ds_sync", "abs_sgd"])
@pytest.mark.parametrize("trainable", [True, False], ids=["unfrozen", "frozen"])
def test_a_trainable_set_changed_mid_fit_is_refused_naming_the_parameters(tmp_path, make, trainable) -> None:
    """The engines take the parameters trainable at train start, for the whole fit: one made trainable later
    would train on each rank alone (replicas drifting apart silently), one frozen later would still be moved by
    the others' contributions. The step that first sees the change raises, naming the parameters."""
    module = _Tiny()
    if trainable:
        module.net.weight.requires_grad_(False)  # in the optimizer, frozen: not in the engine
    change = "became trainable" if trainable else "stopped being trainable"
    with pytest.raises(RuntimeError, match=rf"the trainable parameters of optimizer 0 changed after the fit started "
                                           rf"\(step 2\): 1 {change} \('net\.weight'\)\. .* param group whose "
                                           "learning rate is 0"):
        tiny_fit(tmp_path, make(), seen=[], module=module, steps=4, callbacks=(_Retrain(2, trainable),))
