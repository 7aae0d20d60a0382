"""The imbalance benchmark's task and model: a random teacher MLP's labels, the student MLP, batch loading.

Also used by the heterogeneity, delay-progress and memory-soak benchmarks. Torch only.
"""

from __future__ import annotations

import math

import torch

IN_DIM, CLASSES = 32, 10
TEACHER_HIDDEN = 64
TRAIN_SAMPLES, TEST_SAMPLES, TRAIN_EVAL_SAMPLES = 131_072, 8_192, 8_192


def make_task(seed: int) -> dict[str, torch.Tensor]:
    """The synthetic task: inputs and a fixed random teacher's labels (identical on every rank)."""
    g = torch.Generator().manual_seed(seed + 1234)
    w1 = torch.randn(IN_DIM, TEACHER_HIDDEN, generator=g) / math.sqrt(IN_DIM)
    w2 = torch.randn(TEACHER_HIDDEN, CLASSES, generator=g) / math.sqrt(TEACHER_HIDDEN)

    def teacher(x: torch.Tensor) -> torch.Tensor:
        return (torch.tanh(x @ w1) @ w2).argmax(dim=1)

    x_train = torch.randn(TRAIN_SAMPLES, IN_DIM, generator=g)
    x_test = torch.randn(TEST_SAMPLES, IN_DIM, generator=g)
    return {"x_train": x_train, "y_train": teacher(x_train), "x_test": x_test, "y_test": teacher(x_test)}


def cosine_factor(step: int, *, steps: int) -> float:
    """The learning-rate factor at optimizer step ``step`` of ``steps``: cosine from 1 to 0."""
    return 0.5 * (1.0 + math.cos(math.pi * min(step, steps) / steps))


def build_mlp(width: int, depth: int) -> torch.nn.Sequential:
    """The student: ``depth`` hidden ReLU layers of ``width``; no buffers (DDP would broadcast them per step)."""
    layers: list[torch.nn.Module] = []
    fan_in = IN_DIM
    for _ in range(depth):
        layers += [torch.nn.Linear(fan_in, width), torch.nn.ReLU()]
        fan_in = width
    layers.append(torch.nn.Linear(fan_in, CLASSES))
    return torch.nn.Sequential(*layers)


class BatchDataset(torch.utils.data.Dataset):
    """Tensor dataset that indexes a whole batch at once (``__getitems__``).

    The default per-sample fetch and collate would cost a few ms per batch of
    Python, in every configuration alike, diluting the differences measured.
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]

    def __getitems__(self, indices: list[int]) -> list[torch.Tensor]:
        idx = torch.as_tensor(indices)
        return [self.x[idx], self.y[idx]]


def batch_collate(batch: list[torch.Tensor]) -> list[torch.Tensor]:
    """``collate_fn`` for :class:`BatchDataset`: the batch is already stacked."""
    return batch


@torch.no_grad()
def evaluate(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """Mean cross-entropy and accuracy of ``net`` on ``(x, y)``."""
    net.eval()
    loss_sum, correct = 0.0, 0
    for start in range(0, len(x), 2048):
        logits = net(x[start : start + 2048])
        target = y[start : start + 2048]
        loss_sum += torch.nn.functional.cross_entropy(logits, target, reduction="sum").item()
        correct += int((logits.argmax(dim=1) == target).sum())
    net.train()
    return loss_sum / len(x), correct / len(x)


def parameter_digest(params: list[torch.nn.Parameter]) -> float:
    """float64 sum of every parameter: equal on bit-identical replicas, different otherwise (almost surely)."""
    with torch.no_grad():
        return float(sum(p.detach().double().sum() for p in params))
