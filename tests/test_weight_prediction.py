"""Weight prediction (``weight_prediction=True``), the mechanism ``eager_sgd`` and ``abs_sgd`` share.

One-process fits record the weights each forward pass sees: exactly the current
weights plus the last step's update, the weights restored exactly afterwards.
The mechanism's arithmetic itself is pinned in tests/test_units.py; the
checkpoint's copy of the last update in tests/test_abs_sgd.py; bit-identical
replicas under prediction in every multi-process fit of both strategies.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_partial import ABSSGDStrategy, EagerSGDStrategy
from tests.distributed import in_process_fit

STRATEGIES = {"abs_sgd": ABSSGDStrategy, "eager_sgd": EagerSGDStrategy}


def recorded_fit(strategy, tmp_path: Path, *, inputs: int, outputs: int, samples: int, optimizer, **trainer_options):
    """A 1-process fit (one epoch, batches of 8) of a linear model that records its weights per batch: at the
    batch start (``actual``) and as the forward pass sees them (``seen``); returns the model.

    ``trainer_options`` go to the ``Trainer`` (default: no logger)."""
    import lightning as L

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(inputs, outputs)
            self.initial = self.net.weight.detach().clone()
            self.actual: list[torch.Tensor] = []
            self.seen: list[torch.Tensor] = []

        def on_train_batch_start(self, batch, batch_idx):
            self.actual.append(self.net.weight.detach().clone())

        def training_step(self, batch, batch_idx):
            self.seen.append(self.net.weight.detach().clone())
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return optimizer(self.parameters())

    model = Model()
    options = {"logger": False, **trainer_options}
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_epochs=1, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path, **options)
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(samples, inputs, generator=g),
                                          torch.randn(samples, outputs, generator=g))
    with in_process_fit():
        trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=8))
    return model


@pytest.mark.timeout(120)
@pytest.mark.parametrize("weight_prediction", [True, False])
@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_each_gradient_is_computed_at_the_predicted_weights(tmp_path, name, weight_prediction):
    """One rank, AdamW: the forward pass of every batch sees the current weights
    plus the last step's update (exactly: w + (w - w_before)), the weights are restored exactly afterwards,
    and the first batches, before any update, see the weights as they are. Off: as they are. eager_sgd
    predicts nothing at world size 1, where no gradient is late (its steps are strategy="auto"'s);
    abs_sgd's results are a round late at any world size."""
    strategy = STRATEGIES[name](weight_prediction=weight_prediction)
    predicts = weight_prediction and name != "eager_sgd"
    model = recorded_fit(strategy, tmp_path, inputs=4, outputs=1, samples=96,
                         optimizer=lambda params: torch.optim.AdamW(params, lr=0.05))
    seen, actual = model.seen, model.actual
    assert len(seen) == len(actual) >= 10
    last_update = None
    predicted = 0
    for t in range(len(seen)):
        if t > 0 and not torch.equal(actual[t], actual[t - 1]):
            last_update = actual[t] - actual[t - 1]  # one optimizer step per batch at most
        if predicts and last_update is not None:
            assert torch.equal(seen[t], actual[t] + last_update), t
            predicted += 1
        else:
            assert torch.equal(seen[t], actual[t]), t
    assert predicted >= (len(seen) - 3 if predicts else 0)


@pytest.mark.timeout(120)
def test_a_fit_predicts_nothing_from_an_earlier_one(tmp_path):
    """A strategy holding a last update from an earlier fit of another model (as after a tuner's trial fit)
    starts the next fit without it: the first batch sees the weights as they are, and the shapes differ.
    (abs_sgd: one rank predicts under it; eager_sgd predicts nothing at world size 1.)"""
    strategy = ABSSGDStrategy()
    # What an earlier fit of a 4-input model leaves.
    strategy._prediction._updates = {0: [torch.ones(2, 4), torch.ones(2)]}
    model = recorded_fit(strategy, tmp_path, inputs=3, outputs=2, samples=48,
                         optimizer=lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9))
    assert torch.equal(model.seen[0], model.initial)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name, rule, predicts", [("eager_sgd", "inverse", False), ("abs_sgd", "momentum", True)])
def test_the_update_rule_is_logged_as_hyperparameters(tmp_path, name, rule, predicts):
    """StalenessTracker records the update rule in force (the rule resolved for SGD momentum; prediction as
    in force at world size 1: off for eager_sgd. tests/test_callbacks.py checks it on at 4 ranks)."""
    import yaml
    from lightning.pytorch.loggers import CSVLogger

    from lightning_partial.callbacks import StalenessTracker

    recorded_fit(STRATEGIES[name](), tmp_path, inputs=3, outputs=1, samples=32,
                 optimizer=lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9),
                 logger=CSVLogger(tmp_path, name="csv"), callbacks=[StalenessTracker()])
    hparams = yaml.safe_load((tmp_path / "csv" / "version_0" / "hparams.yaml").read_text())
    assert hparams["partial/weight_prediction"] is predicts
    assert hparams["partial/staleness_rule"] == rule
    if name == "abs_sgd":
        assert hparams["partial/step_samples"] == "global_batch"  # one optimizer step per global batch
        assert hparams["partial/step_boundary"] == "nearest"  # the step ends at the round nearest to it
        assert hparams["partial/delay"] == 1  # "auto" under SGD: the paper's one-round delay
        assert hparams["partial/overlap_arrival"] is True  # arrivals by samples or time go on (AdaptiveBatchSize)


@pytest.mark.timeout(120)
def test_overlap_is_logged_with_its_retiming(tmp_path):
    """With overlap every result is applied a step late, at any world size: prediction is in force at one rank,
    and the step's re-timing under SGD momentum (spike compensation) is logged beside the rule, as is the
    synchronous finish (its last rounds synchronous: one rank's are anyway)."""
    import yaml
    from lightning.pytorch.loggers import CSVLogger

    from lightning_partial.callbacks import StalenessTracker

    model = recorded_fit(EagerSGDStrategy(overlap=True, final_sync=0.25), tmp_path, inputs=3, outputs=1, samples=32,
                         optimizer=lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9),
                         logger=CSVLogger(tmp_path, name="csv"), callbacks=[StalenessTracker()])
    hparams = yaml.safe_load((tmp_path / "csv" / "version_0" / "hparams.yaml").read_text())
    assert hparams["partial/overlap"] is True
    assert hparams["partial/overlap_retiming"] == "momentum"
    assert hparams["partial/final_sync"] == 0.25
    assert hparams["partial/weight_prediction"] is True
    # The first step applied nothing (no round was complete): the second batch saw the initial weights.
    assert torch.equal(model.actual[1], model.initial)
    assert not torch.equal(model.actual[2], model.initial)
