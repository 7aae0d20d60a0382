"""Checkpoint files: what a resume accepts, what it refuses, and writes that never leave a half-written file.

* Another world size is accepted: old rank ``j``'s pending gradients go to new rank
  ``j % P`` and are applied in the first round after the resume.
* Another engine family is refused (``tests/test_bad_input.py``, ``SETUP_CASES``) unless
  the engine state is dropped explicitly (``drop_engine_state``), which is tested here.
* Rank 0 writes a checkpoint to a temporary file in the target's directory and renames
  it (``os.replace``): a write that fails midway leaves the previous file intact and no
  temporary file behind. Remote paths and other ``CheckpointIO`` plugins keep their
  own behaviour.

Every fit here is a 1-process fit in this process (a fraction of a second each).
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.fabric.plugins import TorchCheckpointIO

from lightning_partial import ABSSGDStrategy, DSSyncStrategy, EagerSGDStrategy, WAGMAStrategy
from lightning_partial.strategies import checkpoint as ckpt_module
from lightning_partial.strategies.checkpoint import (
    CHECKPOINT_KEY,
    FAMILY_STRATEGIES,
    CheckpointMismatchError,
    drop_engine_state,
    resume_entry,
    save_atomically,
    write_checkpoint,
)
from tests.test_bad_input import _SaveAt, tiny_fit, variant

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def eager_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("eager")
    path = root / "mid.ckpt"
    tiny_fit(root, EagerSGDStrategy(), seen=[], callbacks=(_SaveAt(path, 2),))
    return path


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class GradientSpy(L.Callback):
    """The engine's state at the first batch of the fit, and per step the own and the applied gradient."""

    def __init__(self) -> None:
        self.first_state: dict[str, Any] = {}
        self.own: list[torch.Tensor] = []
        self.applied: list[torch.Tensor] = []
        self.counts: list[tuple[int, ...]] = []

    @staticmethod
    def _grads(module: L.LightningModule) -> torch.Tensor:
        return torch.cat([p.grad.flatten() for p in module.parameters()]).clone()

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any, i: int) -> None:
        if not self.first_state:
            self.first_state = trainer.strategy._engines[0].state_dict()

    def on_after_backward(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.own.append(self._grads(module))

    def on_before_optimizer_step(self, trainer: L.Trainer, module: L.LightningModule, optimizer: Any) -> None:
        self.applied.append(self._grads(module))

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.counts.append(tuple(trainer.strategy.round_stats[0].counts))


# ------------------------------------------------------------------ another world size: accepted
def test_a_checkpoint_from_another_world_size_is_resumed_and_its_pending_gradients_applied(
    tmp_path: Path, eager_checkpoint: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A 2-rank checkpoint (each rank with one pending gradient) resumed on 1 rank: both go to rank 0
    (j % 1) and the first round after the resume applies them with its own gradient."""
    state = torch.load(eager_checkpoint, weights_only=True)[CHECKPOINT_KEY]["engines"][0][0]
    numel = sum(p.numel() for p in torch.nn.Linear(8, 1).parameters())
    ranks = [{**state, "pending": [[torch.full((numel,), float(r + 1))]], "pending_steps": [1]} for r in range(2)]
    two = variant(eager_checkpoint, tmp_path / "two_ranks.ckpt", world_size=2, engines={0: ranks})
    spy = GradientSpy()
    with caplog.at_level(logging.WARNING, logger="lightning_partial"):
        tiny_fit(tmp_path, EagerSGDStrategy(), seen=[], callbacks=(spy,), ckpt_path=two, steps=4)
    assert "resuming a checkpoint of 2 ranks on 1" in caplog.text
    assert spy.first_state["step"] == 2
    assert [float(p[0][0]) for p in spy.first_state["pending"]] == [1.0, 2.0]  # old ranks 0 and 1
    assert spy.counts[0] == (3,)  # the own gradient and the two carried ones
    assert torch.allclose(spy.applied[0], spy.own[0] + 3.0)  # nothing lost, nothing duplicated
    assert torch.equal(spy.applied[1], spy.own[1])  # and applied once
    assert len(spy.applied) == 2  # steps 3 and 4 only: the loops resumed at step 2


# ------------------------------------------------------------------ another family: refused, or dropped explicitly
def test_dropping_the_engine_state_explicitly_lets_another_family_resume(tmp_path: Path,
                                                                        eager_checkpoint: Path) -> None:
    before = digest(eager_checkpoint)
    with pytest.raises(CheckpointMismatchError, match="drop_engine_state"):
        tiny_fit(tmp_path, WAGMAStrategy(), seen=[], ckpt_path=eager_checkpoint)
    weights_only = tmp_path / "weights_only.ckpt"
    assert drop_engine_state(eager_checkpoint, weights_only) == 0  # a 1-rank fit carries nothing
    assert digest(eager_checkpoint) == before  # the original is untouched
    checkpoint = torch.load(weights_only, weights_only=True)
    assert CHECKPOINT_KEY not in checkpoint and "state_dict" in checkpoint and checkpoint["global_step"] == 2
    seen: list[int] = []
    trainer = tiny_fit(tmp_path, WAGMAStrategy(), seen=seen, ckpt_path=weights_only, steps=4)
    assert trainer.global_step == 4 and len(seen) == 2  # resumed at step 2, engines from round 0
    with pytest.raises(ValueError, match="another file"):
        drop_engine_state(weights_only, weights_only)


def test_dropping_the_engine_state_drops_abs_sgds_accumulated_rounds_and_counts_them(tmp_path: Path) -> None:
    """abs_sgd's rounds summed towards its next step are engine state too: dropped and counted (one set per
    optimizer that had any), where another family would ignore them without a word; the fit's step count
    (which phases the schedulers' frequency) stays."""
    from lightning_partial.strategies.accumulation import ACCUMULATED_KEY

    src, dst = tmp_path / "abs.ckpt", tmp_path / "dropped.ckpt"
    torch.save({"state_dict": {}, "global_step": 3,
                ACCUMULATED_KEY: {0: {"sum": [torch.ones(2)], "samples": 24, "rounds": 2, "steps": 3},
                                  1: {"sum": None, "samples": 0, "rounds": 0, "steps": 3}}}, src)
    assert drop_engine_state(src, dst) == 1
    assert torch.load(dst, weights_only=True)[ACCUMULATED_KEY] == {
        0: {"sum": None, "samples": 0, "rounds": 0, "steps": 3}, 1: {"sum": None, "samples": 0, "rounds": 0, "steps": 3}}


def test_drop_foreign_is_an_explicit_choice(caplog: pytest.LogCaptureFixture) -> None:
    entry = {"strategy": "eager_sgd", "family": "gradients", "world_size": 2,
             "engines": {0: [{"step": 5, "pending": [[torch.zeros(3)]]}, {"step": 5, "pending": []}]}}
    with pytest.raises(CheckpointMismatchError, match=r"1 pending gradient set\(s\)") as exc:
        resume_entry(entry, strategy="ds_sync", family="models", source="x.ckpt")
    assert str(exc.value).startswith("ckpt_path 'x.ckpt': ") and exc.value.source == "x.ckpt"
    with caplog.at_level(logging.WARNING, logger="lightning_partial"):
        assert resume_entry(entry, strategy="ds_sync", family="models", drop_foreign=True) is None
    assert "dropped as asked" in caplog.text and "1 pending gradient set(s) dropped" in caplog.text
    assert resume_entry(entry, strategy="eager_sgd_majority", family="gradients") is entry  # same family
    assert resume_entry(None, strategy="eager_sgd", family="gradients") is None  # e.g. a ddp checkpoint


def test_the_family_table_matches_the_registered_strategies() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    for family, names in FAMILY_STRATEGIES.items():
        for name in names:
            assert StrategyRegistry[name]["strategy"].engine_family == family, name
    for cls in (EagerSGDStrategy, WAGMAStrategy, DSSyncStrategy, ABSSGDStrategy):
        assert cls.strategy_name in FAMILY_STRATEGIES[cls.engine_family]


# ------------------------------------------------------------------ atomic writes
class Unpicklable:
    def __reduce__(self) -> Any:
        raise RuntimeError("cannot pickle this")


def _previous(path: Path) -> str:
    torch.save({"previous": torch.arange(10)}, path)
    return digest(path)


def test_a_write_whose_pickling_fails_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "ckpts" / "last.ckpt"
    path.parent.mkdir()
    before = _previous(path)
    strategy = EagerSGDStrategy()  # never set up: rank 0, no engines (what save_checkpoint writes is the dict)
    with pytest.raises(RuntimeError, match="cannot pickle this"):
        strategy.save_checkpoint({"state_dict": {"w": torch.zeros(1000)}, "bad": Unpicklable()}, path)
    assert digest(path) == before
    assert sorted(p.name for p in path.parent.iterdir()) == ["last.ckpt"]  # no temporary file left behind
    # A first write that fails creates nothing at all.
    with pytest.raises(RuntimeError):
        strategy.save_checkpoint({"bad": Unpicklable()}, tmp_path / "ckpts" / "new.ckpt")
    assert sorted(p.name for p in path.parent.iterdir()) == ["last.ckpt"]


def test_a_write_that_fails_midway_leaves_the_previous_checkpoint(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk fills up after part of the file was written: the target still holds the previous checkpoint."""
    path = tmp_path / "last.ckpt"
    before = _previous(path)
    written: list[int] = []
    real_save = torch.save

    def half_then_full(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        real_save(obj, f, *args, **kwargs)  # the whole checkpoint goes to the temporary file ...
        f.flush()
        written.append(os.fstat(f.fileno()).st_size)
        raise OSError(errno.ENOSPC, "No space left on device")  # ... and then the write fails

    monkeypatch.setattr(ckpt_module.torch, "save", half_then_full)
    with pytest.raises(OSError, match="No space left"):
        EagerSGDStrategy().save_checkpoint({"state_dict": {"w": torch.ones(100_000)}}, path)
    assert written and written[0] > 100_000 * 4  # the temporary file did hold the new bytes
    assert digest(path) == before
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def test_a_fit_writes_through_a_temporary_file_in_the_same_directory(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    renames: list[tuple[str, str]] = []
    real_replace = os.replace

    def spy(src: Any, dst: Any) -> None:
        renames.append((str(src), str(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(ckpt_module.os, "replace", spy)
    path = tmp_path / "out" / "mid.ckpt"
    # abs_sgd: its own save, then ours. At step 1: the synchronous finish (round 2 of 3) applies rounds 1 and 2
    # in one batch, so no batch ends at step 2.
    tiny_fit(tmp_path, ABSSGDStrategy(), seen=[], callbacks=(_SaveAt(path, 1),))
    assert renames and all(dst == str(path) for _, dst in renames)  # (abs_sgd may run several batches at step 1)
    for src, _ in renames:
        temporary = Path(src)
        assert temporary.parent == path.parent and temporary.name.startswith(".mid.ckpt.")
        assert temporary.suffix == ".tmp"  # not *.ckpt: ModelCheckpoint never mistakes it for a checkpoint
    assert torch.load(path, weights_only=True)[CHECKPOINT_KEY]["strategy"] == "abs_sgd"
    assert [p.name for p in path.parent.iterdir()] == ["mid.ckpt"]
    # Permissions as a plain open() would give them (mkstemp's 0o600 is not kept).
    reference = tmp_path / "reference"
    reference.write_bytes(b"")
    assert path.stat().st_mode & 0o777 == reference.stat().st_mode & 0o777
    # Overwriting keeps the existing file's permissions.
    path.chmod(0o640)
    save_atomically({"again": 1}, path)
    assert path.stat().st_mode & 0o777 == 0o640 and torch.load(path)["again"] == 1


def test_remote_paths_and_other_plugins_keep_their_own_behaviour(tmp_path: Path) -> None:
    calls: list[Any] = []

    class Recording(TorchCheckpointIO):
        def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
            calls.append(path)

    write_checkpoint(Recording(), {"a": 1}, tmp_path / "x.ckpt")  # a user's plugin: used as is
    assert calls == [tmp_path / "x.ckpt"] and not (tmp_path / "x.ckpt").exists()
    write_checkpoint(TorchCheckpointIO(), {"a": 2}, "memory://lightning_partial_test/y.ckpt")  # remote: Lightning's
    import fsspec

    with fsspec.open("memory://lightning_partial_test/y.ckpt", "rb") as f:
        assert torch.load(f)["a"] == 2
    write_checkpoint(TorchCheckpointIO(), {"a": 3}, f"file://{tmp_path}/z.ckpt")  # a file:// URL is local
    assert torch.load(tmp_path / "z.ckpt")["a"] == 3
    with pytest.raises(TypeError, match="storage_options"):  # Lightning's own refusal is kept
        write_checkpoint(TorchCheckpointIO(), {"a": 4}, tmp_path / "w.ckpt", storage_options={"x": 1})


def test_evaluating_a_checkpoint_of_another_family_loads_its_weights(tmp_path: Path, eager_checkpoint: Path) -> None:
    """validate / test never use the engines: the family check is for fitting only."""
    from tests.test_bad_input import _Tiny

    class Evaluated(_Tiny):
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.log("val_loss", torch.nn.functional.mse_loss(self.net(batch[0]), batch[1]))

    data = torch.utils.data.TensorDataset(torch.randn(16, 8), torch.randn(16, 1))
    trainer = L.Trainer(strategy=WAGMAStrategy(), accelerator="cpu", devices=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    model = Evaluated()
    results = trainer.validate(model, torch.utils.data.DataLoader(data, batch_size=8), ckpt_path=eager_checkpoint)
    saved = torch.load(eager_checkpoint, weights_only=True)["state_dict"]
    assert torch.equal(model.net.weight.detach(), saved["net.weight"]) and "val_loss" in results[0]
