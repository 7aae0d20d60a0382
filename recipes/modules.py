"""The recipes' LightningModules: one per workload, over a shared base (optimiser, schedule, metrics).

Every module implements :meth:`RecipeModule.loss_and_metrics` (loss, correct
predictions, predictions counted); from it come the training loss, the
validation metrics (``val_loss``, ``val_acc``) and the final evaluation that
:class:`recipes.summary.FitSummary` runs on rank 0 after the fit. ``num_classes``,
``feature_dim`` and the vocabulary sizes are linked from the data module by the CLI.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from recipes.errors import check_choice, check_float, check_int
from recipes.models import LSTMClassifier, Seq2SeqTransformer, WideResNet, cifar_resnet, resnet18_cifar, torchvision_model

Optimizer = Literal["sgd", "adamw"]
Schedule = Literal["constant", "cosine", "inverse_sqrt"]


class RecipeModule(L.LightningModule):
    """Shared training logic. Subclasses build ``self.net`` and implement :meth:`loss_and_metrics`.

    Args:
        optimizer: ``"sgd"`` (with ``momentum``, Nesterov off) or ``"adamw"`` (betas 0.9, 0.98).
        lr: peak learning rate.
        momentum: SGD momentum.
        weight_decay: L2 (SGD) / decoupled (AdamW) weight decay.
        lr_schedule: ``"constant"``; ``"cosine"`` to 0 over ``trainer.max_steps`` (or ``max_epochs``; a
            loader without a length needs ``max_steps``, else the rate stays constant, with a warning);
            ``"inverse_sqrt"`` (Transformer: ``lr * min(1, sqrt(warmup/step))``).
        warmup_steps: linear warm-up steps (every schedule).
    """

    def __init__(self, *, optimizer: Optimizer = "sgd", lr: float = 0.1, momentum: float = 0.9,
                 weight_decay: float = 0.0, lr_schedule: Schedule = "constant", warmup_steps: int = 0) -> None:
        super().__init__()
        self.optimizer_name = check_choice(optimizer, "model.optimizer", ("sgd", "adamw"))
        self.lr = check_float(lr, "model.lr", minimum=0.0, inclusive_min=False)
        self.momentum = check_float(momentum, "model.momentum", minimum=0.0, maximum=1.0)
        self.weight_decay = check_float(weight_decay, "model.weight_decay", minimum=0.0)
        self.lr_schedule = check_choice(lr_schedule, "model.lr_schedule", ("constant", "cosine", "inverse_sqrt"))
        self.warmup_steps = check_int(warmup_steps, "model.warmup_steps", minimum=0)

    def loss_and_metrics(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Mean loss of the batch, number of correct predictions (tensor), number of predictions."""
        raise NotImplementedError

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss, _, _ = self.loss_and_metrics(batch)
        self.log("train_loss", loss, prog_bar=True)  # per rank: no collective per step
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        loss, correct, count = self.loss_and_metrics(batch)
        self.log("val_loss", loss, sync_dist=True, batch_size=count)
        self.log("val_acc", correct.float() / max(count, 1), sync_dist=True, prog_bar=True, batch_size=count)

    @torch.no_grad()
    def evaluate_batch(self, batch: Any) -> tuple[float, int, int]:
        """Summed loss, correct predictions and predictions of one batch (the final evaluation; no logging)."""
        loss, correct, count = self.loss_and_metrics(batch)
        return float(loss) * count, int(correct), count

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "sgd":
            opt: torch.optim.Optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum,
                                                         weight_decay=self.weight_decay)
        else:
            opt = torch.optim.AdamW(self.parameters(), lr=self.lr, betas=(0.9, 0.98), weight_decay=self.weight_decay)
        if self.lr_schedule == "constant" and self.warmup_steps == 0:
            return opt
        total = self.trainer.max_steps if self.trainer is not None and self.trainer.max_steps > 0 else None
        if self.lr_schedule == "cosine" and total is None:
            try:  # max_epochs: Lightning's estimate (unknown for an unsized loader, e.g. under abs_sgd)
                estimate = self.trainer.estimated_stepping_batches
                total = int(estimate) if math.isfinite(estimate) and estimate > 0 else None
            except Exception:  # noqa: BLE001 - any failure of the estimate: fall back to a constant rate
                total = None
            if total is None:
                # Said once, on rank 0: a fit that asked for a decay and trains at a constant rate
                # ends mid-descent, which a user comparing runs must know.
                rank_zero_warn(
                    "model.lr_schedule='cosine' needs the number of steps, and the training loader has no "
                    "length (an iterable loader, e.g. under abs_sgd, whose epochs end by global samples): "
                    "the learning rate stays constant. Set trainer.max_steps to decay it to 0 over that many steps."
                )
        warmup, schedule = self.warmup_steps, self.lr_schedule

        def factor(step: int) -> float:
            if warmup and step < warmup:
                return (step + 1) / warmup
            if schedule == "cosine" and total:
                progress = min(1.0, (step - warmup) / max(1, total - warmup))
                return 0.5 * (1.0 + math.cos(math.pi * progress))
            if schedule == "inverse_sqrt" and warmup:
                return math.sqrt(warmup / max(step, 1))
            return 1.0

        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class ImageClassifier(RecipeModule):
    """Cross-entropy classification of ``(images, labels)`` batches by ``self.net``."""

    net: nn.Module
    label_smoothing = 0.0

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(images)

    def loss_and_metrics(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor, int]:
        images, labels = batch
        logits = self(images)
        loss = F.cross_entropy(logits, labels, label_smoothing=self.label_smoothing)
        return loss, (logits.argmax(dim=1) == labels).sum(), int(labels.numel())


class CifarResNet(ImageClassifier):
    """ResNet-20/32/44/56/110 for CIFAR (``depth`` = 6n + 2; ``width``: first stage's channels, 16 in the paper)."""

    def __init__(self, num_classes: int = 10, depth: int = 20, width: int = 16, *, optimizer: Optimizer = "sgd",
                 lr: float = 0.1, momentum: float = 0.9, weight_decay: float = 1e-4,
                 lr_schedule: Schedule = "cosine", warmup_steps: int = 0) -> None:
        super().__init__(optimizer=optimizer, lr=lr, momentum=momentum, weight_decay=weight_decay,
                         lr_schedule=lr_schedule, warmup_steps=warmup_steps)
        self.save_hyperparameters()
        self.net = cifar_resnet(depth, width, num_classes)


class CifarResNet18(ImageClassifier):
    """ResNet-18 for 32x32 inputs (``width``: first stage's channels, 64 in the paper)."""

    def __init__(self, num_classes: int = 10, width: int = 64, *, optimizer: Optimizer = "sgd", lr: float = 0.1,
                 momentum: float = 0.9, weight_decay: float = 5e-4, lr_schedule: Schedule = "cosine",
                 warmup_steps: int = 0) -> None:
        super().__init__(optimizer=optimizer, lr=lr, momentum=momentum, weight_decay=weight_decay,
                         lr_schedule=lr_schedule, warmup_steps=warmup_steps)
        self.save_hyperparameters()
        self.net = resnet18_cifar(width, num_classes)


class CifarWideResNet(ImageClassifier):
    """WideResNet-``depth``-``widen_factor`` for CIFAR (WRN-28-10 in the DS-Sync paper; ``base_width`` 16)."""

    def __init__(self, num_classes: int = 10, depth: int = 28, widen_factor: int = 10, dropout: float = 0.3,
                 base_width: int = 16, *, optimizer: Optimizer = "sgd", lr: float = 0.1, momentum: float = 0.9,
                 weight_decay: float = 5e-4, lr_schedule: Schedule = "cosine", warmup_steps: int = 0) -> None:
        super().__init__(optimizer=optimizer, lr=lr, momentum=momentum, weight_decay=weight_decay,
                         lr_schedule=lr_schedule, warmup_steps=warmup_steps)
        self.save_hyperparameters()
        self.net = WideResNet(depth, widen_factor, dropout, num_classes, base_width)


class ImageNetClassifier(ImageClassifier):
    """A torchvision model (``arch``, default ResNet-50), randomly initialised, label smoothing 0.1."""

    label_smoothing = 0.1

    def __init__(self, num_classes: int = 1000, arch: str = "resnet50", *, optimizer: Optimizer = "sgd",
                 lr: float = 0.1, momentum: float = 0.9, weight_decay: float = 1e-4,
                 lr_schedule: Schedule = "cosine", warmup_steps: int = 0) -> None:
        super().__init__(optimizer=optimizer, lr=lr, momentum=momentum, weight_decay=weight_decay,
                         lr_schedule=lr_schedule, warmup_steps=warmup_steps)
        self.save_hyperparameters()
        self.net = torchvision_model(arch, num_classes)


class VideoClassifier(RecipeModule):
    """LSTM over per-frame features of variable-length videos (``(features, lengths, labels)`` batches)."""

    def __init__(self, feature_dim: int = 64, num_classes: int = 101, hidden_size: int = 512, num_layers: int = 1,
                 dropout: float = 0.5, *, optimizer: Optimizer = "sgd", lr: float = 0.1, momentum: float = 0.9,
                 weight_decay: float = 0.0, lr_schedule: Schedule = "constant", warmup_steps: int = 0) -> None:
        super().__init__(optimizer=optimizer, lr=lr, momentum=momentum, weight_decay=weight_decay,
                         lr_schedule=lr_schedule, warmup_steps=warmup_steps)
        self.save_hyperparameters()
        self.net = LSTMClassifier(feature_dim, num_classes, hidden_size, num_layers, dropout)

    def forward(self, features: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return self.net(features, lengths)

    def loss_and_metrics(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor, int]:
        features, lengths, labels = batch
        logits = self(features, lengths)
        return F.cross_entropy(logits, labels), (logits.argmax(dim=1) == labels).sum(), int(labels.numel())


class TranslationModel(RecipeModule):
    """Transformer encoder-decoder trained with teacher forcing; accuracy is per target token (padding excluded)."""

    def __init__(self, src_vocab_size: int = 32_000, tgt_vocab_size: int = 32_000, max_positions: int = 102,
                 d_model: int = 512, nhead: int = 8, num_encoder_layers: int = 6, num_decoder_layers: int = 6,
                 dim_feedforward: int = 2048, dropout: float = 0.1, label_smoothing: float = 0.1, *,
                 optimizer: Optimizer = "adamw", lr: float = 5e-4, momentum: float = 0.9, weight_decay: float = 0.0,
                 lr_schedule: Schedule = "inverse_sqrt", warmup_steps: int = 4000) -> None:
        super().__init__(optimizer=optimizer, lr=lr, momentum=momentum, weight_decay=weight_decay,
                         lr_schedule=lr_schedule, warmup_steps=warmup_steps)
        self.save_hyperparameters()
        self.label_smoothing = check_float(label_smoothing, "model.label_smoothing", minimum=0.0, maximum=1.0)
        self.net = Seq2SeqTransformer(src_vocab_size, tgt_vocab_size, d_model, nhead, num_encoder_layers,
                                      num_decoder_layers, dim_feedforward, dropout, max_positions)

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        return self.net(src, tgt_in)

    def loss_and_metrics(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor, int]:
        src, tgt = batch
        logits = self(src, tgt[:, :-1])
        target = tgt[:, 1:]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=0,
                               label_smoothing=self.label_smoothing)
        mask = target.ne(0)
        return loss, ((logits.argmax(dim=-1) == target) & mask).sum(), int(mask.sum())
