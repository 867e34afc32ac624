"""Models for notebooks and benchmarks, built from torch.nn alone (no downloads, no torchvision):
the ResNet-18 and ResNet-50 layouts, a GPT-2-small-sized decoder, and a small MLP."""

from __future__ import annotations

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
    """The ResNet-18 layout: 11.7 M parameters."""
    layers = _stem()
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, num_classes)]
    return nn.Sequential(*layers)


def mlp(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))


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


class GPT(nn.Module):
    """A GPT-2-small-sized decoder from torch.nn: 12 layers, width 768, 12 heads."""

    def __init__(self, vocab: int = 50257, ctx: int = 1024, width: int = 768, layers: int = 12):
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(ctx, width)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(
                width,
                width // 64,
                4 * width,
                dropout=0.1,
                activation="gelu",
                batch_first=True,
                norm_first=True,
            )
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        n = idx.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(n, device=idx.device)
        h = self.tok(idx) + self.pos(torch.arange(n, device=idx.device))
        for layer in self.layers:
            h = layer(h, src_mask=mask, is_causal=True)
        out: torch.Tensor = self.head(self.norm(h))
        return out
