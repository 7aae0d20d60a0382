"""Image classifiers: CIFAR ResNets (He et al. 2016), ResNet-18 for CIFAR, WideResNet, torchvision's zoo.

Every size is a parameter, so that the tests and the main job can build tiny
versions: ``width`` scales every stage's channels.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from recipes.errors import RecipeConfigError, check_float, check_int


def _conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with batch norm; a 1x1 projection shortcut where the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1, self.bn1 = _conv3x3(cin, cout, stride), nn.BatchNorm2d(cout)
        self.conv2, self.bn2 = _conv3x3(cout, cout), nn.BatchNorm2d(cout)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet(nn.Module):
    """A stack of :class:`BasicBlock` stages over a 3x3 stem (no max-pool: CIFAR-sized inputs)."""

    def __init__(self, blocks: list[int], widths: list[int], num_classes: int, in_channels: int = 3) -> None:
        super().__init__()
        self.stem = nn.Sequential(_conv3x3(in_channels, widths[0]), nn.BatchNorm2d(widths[0]), nn.ReLU())
        layers: list[nn.Module] = []
        cin = widths[0]
        for i, (n, w) in enumerate(zip(blocks, widths)):
            for j in range(n):
                layers.append(BasicBlock(cin, w, stride=2 if i > 0 and j == 0 else 1))
                cin = w
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def cifar_resnet(depth: int = 20, width: int = 16, num_classes: int = 10) -> ResNet:
    """ResNet-``depth`` for CIFAR (depth = 6n + 2: 20, 32, 44, 56, 110): three stages of n blocks, widths w, 2w, 4w."""
    check_int(depth, "model.depth", minimum=8)
    if (depth - 2) % 6:
        raise RecipeConfigError("model.depth", f"a CIFAR ResNet has depth 6n + 2 (20, 32, 44, 56, 110), got {depth}")
    check_int(width, "model.width", minimum=1)
    n = (depth - 2) // 6
    return ResNet([n, n, n], [width, 2 * width, 4 * width], check_int(num_classes, "model.num_classes", minimum=2))


def resnet18_cifar(width: int = 64, num_classes: int = 10) -> ResNet:
    """ResNet-18 adapted to 32x32 inputs (3x3 stem, no max-pool): blocks 2-2-2-2, widths w, 2w, 4w, 8w."""
    check_int(width, "model.width", minimum=1)
    return ResNet([2, 2, 2, 2], [width, 2 * width, 4 * width, 8 * width],
                  check_int(num_classes, "model.num_classes", minimum=2))


class WideBlock(nn.Module):
    """Pre-activation wide block (BN-ReLU-conv, dropout between the two convolutions)."""

    def __init__(self, cin: int, cout: int, stride: int, dropout: float) -> None:
        super().__init__()
        self.bn1, self.conv1 = nn.BatchNorm2d(cin), _conv3x3(cin, cout, stride)
        self.bn2, self.conv2 = nn.BatchNorm2d(cout), _conv3x3(cout, cout)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Conv2d(cin, cout, 1, stride=stride, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(x))
        shortcut = x if isinstance(self.shortcut, nn.Identity) else self.shortcut(out)
        out = self.conv1(out)
        out = self.conv2(self.dropout(torch.relu(self.bn2(out))))
        return out + shortcut


class WideResNet(nn.Module):
    """WRN-``depth``-``widen_factor`` (Zagoruyko & Komodakis 2016): depth = 6n + 4, widths 16, 16k, 32k, 64k."""

    def __init__(self, depth: int = 28, widen_factor: int = 10, dropout: float = 0.0, num_classes: int = 10,
                 base_width: int = 16) -> None:
        super().__init__()
        check_int(depth, "model.depth", minimum=10)
        if (depth - 4) % 6:
            raise RecipeConfigError("model.depth", f"a WideResNet has depth 6n + 4 (10, 16, 22, 28, 40), got {depth}")
        k = check_int(widen_factor, "model.widen_factor", minimum=1)
        b = check_int(base_width, "model.base_width", minimum=1)
        check_float(dropout, "model.dropout", minimum=0.0, maximum=1.0)
        n = (depth - 4) // 6
        widths = [b * k, 2 * b * k, 4 * b * k]
        self.stem = _conv3x3(3, b)
        blocks: list[nn.Module] = []
        cin = b
        for i, w in enumerate(widths):
            for j in range(n):
                blocks.append(WideBlock(cin, w, 2 if i > 0 and j == 0 else 1, dropout))
                cin = w
        self.blocks = nn.Sequential(*blocks)
        self.bn = nn.BatchNorm2d(cin)
        self.head = nn.Linear(cin, check_int(num_classes, "model.num_classes", minimum=2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn(self.blocks(self.stem(x))))
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def torchvision_model(arch: str = "resnet50", num_classes: int = 1000, **kwargs: Any) -> nn.Module:
    """A torchvision classification model by name, randomly initialised (``weights=None``: nothing is downloaded)."""
    from torchvision import models

    available = models.list_models(module=models)
    if arch not in available:
        raise RecipeConfigError("model.arch", f"unknown torchvision classification model {arch!r}; e.g. resnet50, "
                                              f"resnet18, wide_resnet50_2 (one of {len(available)})")
    return models.get_model(arch, weights=None, num_classes=check_int(num_classes, "model.num_classes", minimum=2),
                            **kwargs)
