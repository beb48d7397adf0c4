"""Models for the training job (torch)."""

import math

import torch
from torch import nn

from .cli import MODEL_NAMES as NAMES  # noqa: E402


class LogisticRegression(nn.Module):
    def __init__(self, shape, classes):
        super().__init__()
        self.linear = nn.Linear(math.prod(shape), classes)

    def forward(self, x):
        return self.linear(x.flatten(1))


class MLP(nn.Module):
    def __init__(self, shape, classes, hidden=128):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(shape), hidden), nn.ReLU(),
                                 nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, classes))

    def forward(self, x):
        return self.net(x)


class SmallCNN(nn.Module):
    """Two 3x3 conv layers and a linear head; for (C, H, W) images of any size >= 4x4."""

    def __init__(self, shape, classes, width=32):
        super().__init__()
        if len(shape) != 3:
            raise ValueError(f"cnn needs image inputs (C, H, W), got shape {tuple(shape)}")
        c = shape[0]
        self.features = nn.Sequential(
            nn.Conv2d(c, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2))
        self.head = nn.Linear(8 * width, classes)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


class _Block(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = nn.Sequential()
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.short(x))


class ResNet18(nn.Module):
    """CIFAR-style ResNet-18: 3x3 stem without max-pool, stages of 64-128-256-512 channels."""

    def __init__(self, shape, classes):
        super().__init__()
        if len(shape) != 3:
            raise ValueError(f"resnet18 needs image inputs (C, H, W), got shape {tuple(shape)}")
        self.stem = nn.Sequential(nn.Conv2d(shape[0], 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU())
        layers, cin = [], 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers += [_Block(cin, cout, stride), _Block(cout, cout, 1)]
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(512, classes)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def build(name, shape, classes, width=None):
    """The model ``name``; ``width``: the MLP's hidden units (default 128) or the CNN's first
    layer's channels (default 32)."""
    if width is not None and name in ("mlp", "cnn"):
        return {"mlp": MLP, "cnn": SmallCNN}[name](shape, classes, width)
    table = {"logreg": LogisticRegression, "mlp": MLP, "cnn": SmallCNN, "resnet18": ResNet18}
    if name not in table:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(NAMES)}")
    return table[name](shape, classes)
