"""Image models from torch.nn: the ResNet-18 and ResNet-50 layouts, a ViT-S/16-sized vision
transformer and a small CNN; torchvision's own models where torchvision is installed."""

from __future__ import annotations

import importlib

import torch
from torch import nn


def _stem() -> list[nn.Module]:
    """ResNet's stem: a 7x7 stride-2 convolution, batch norm, ReLU, a stride-2 max pool."""
    return [
        nn.Conv2d(3, 64, 7, 2, 3, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.MaxPool2d(3, 2, 1),
    ]


def _shortcut(cin: int, cout: int, stride: int) -> nn.Module:
    """The residual path: identity, or a 1x1 convolution where the shape changes."""
    if stride == 1 and cin == cout:
        return nn.Identity()
    return nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = _shortcut(cin, cout, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.down(x))


def resnet18(num_classes: int = 1000) -> nn.Module:
    """The ResNet-18 layout: 11.7 M parameters. Its BasicBlocks sit at 4..11 of the Sequential."""
    layers = _stem()
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, num_classes)]
    return nn.Sequential(*layers)


class Bottleneck(nn.Module):
    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * 4
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.down = _shortcut(cin, cout, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        y = torch.relu(self.bn2(self.conv2(y)))
        return torch.relu(self.bn3(self.conv3(y)) + self.down(x))


def resnet50(num_classes: int = 1000) -> nn.Module:
    """The ResNet-50 layout: 25.6 M parameters."""
    layers = _stem()
    cin = 64
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for b in range(blocks):
            layers.append(Bottleneck(cin, width, stride if b == 0 else 1))
            cin = width * 4
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2048, num_classes)]
    return nn.Sequential(*layers)


class ViT(nn.Module):
    """A vision transformer, ViT-S/16-sized by default: 16x16 patches, width 384, pre-norm."""

    def __init__(self, size: int = 224, patch: int = 16, width: int = 384, layers: int = 6):
        super().__init__()
        self.patches = nn.Conv2d(3, width, patch, stride=patch)
        n = (size // patch) ** 2
        self.pos = nn.Parameter(torch.zeros(1, n, width))
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(
                width, width // 64, 4 * width, batch_first=True, norm_first=True, activation="gelu"
            )
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 1000)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.patches(x).flatten(2).transpose(1, 2) + self.pos
        for block in self.blocks:
            h = block(h)
        out: torch.Tensor = self.head(self.norm(h).mean(1))
        return out


def small_cnn(classes: int = 10) -> nn.Module:
    """Two convolutions with batch norm, pooled into a linear head: 20 K parameters."""
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, stride=2, padding=1),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, classes),
    )


def torchvision_resnet50() -> nn.Module:
    """torchvision's ResNet-50, untrained (no download). Needs torchvision, imported here."""
    model: nn.Module = importlib.import_module("torchvision.models").resnet50()
    return model


def torchvision_vit_b_16() -> nn.Module:
    """torchvision's ViT-B/16, untrained (no download). Needs torchvision, imported here."""
    model: nn.Module = importlib.import_module("torchvision.models").vit_b_16()
    return model


class TorchvisionBottleneck(nn.Module):
    """torchvision's ``Bottleneck`` (ResNet v1.5: the stride on the 3×3), its modules in its
    order, with its in-place ReLU and residual sum."""

    def __init__(self, cin: int, width: int, stride: int, down: nn.Module | None) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, width * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(width * 4)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one call a statement, as torchvision writes it: each input is let go as soon as the
        # next call returns (nested calls would hold it one call longer, which without grad
        # moves the peak: 25 MiB more in ResNet-50's first stage)
        identity = x
        out = self.conv1(x)
        out = self.bn1(out)
        out = self.relu(out)
        out = self.conv2(out)
        out = self.bn2(out)
        out = self.relu(out)
        out = self.conv3(out)
        out = self.bn3(out)
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        done: torch.Tensor = self.relu(out)
        return done


class TorchvisionResNet50(nn.Module):
    """torchvision's ``resnet50()`` rebuilt from torch.nn: the same modules, parameters and
    buffers in the same order, the same forward (in-place ReLUs and sums, one call a
    statement, which decides when each activation is freed without grad), so that where
    torchvision does not import, its validation cases can still be predicted. The recorded
    model's arrival on the GPU (tests/data/validation/resnet-50-torchvision-*) checks the
    parameters' order and sizes."""

    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        cin, stages = 64, []
        for width, count, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            down = nn.Sequential(nn.Conv2d(cin, width * 4, 1, stride, bias=False))
            down.append(nn.BatchNorm2d(width * 4))
            blocks = [TorchvisionBottleneck(cin, width, stride, down)]
            blocks += [TorchvisionBottleneck(width * 4, width, 1, None) for _ in range(count - 1)]
            stages.append(nn.Sequential(*blocks))
            cin = width * 4
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(2048, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv1(x)
        x = self.bn1(x)
        x = self.relu(x)
        x = self.maxpool(x)
        x = self.layer1(x)
        x = self.layer2(x)
        x = self.layer3(x)
        x = self.layer4(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        out: torch.Tensor = self.fc(x)
        return out
